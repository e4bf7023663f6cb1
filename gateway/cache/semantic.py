"""The opt-in semantic match (`spec.cache.semantic`): a request answered with the stored answer of an earlier one
from the same tenant that differs from it only in its last user message, whose text means nearly the same.

Which requests: chat and Messages requests whose last message is the user's, as text (a string, or text parts
only), and (unless `tools` says otherwise) without tools, whose calls hang on the exact words; the exact cache's
own rules (deterministic only, no-store, a key's tenant) hold first. Two requests are in one *bucket* when they are
equal in everything but that text: the bucket is keyed as the exact cache keys a request (gateway/cache/key.py), on
the request with that text taken out, so the tenant, route, pool, model, the rest of the conversation and every
setting must match exactly. Within a bucket, the texts are compared by the cosine similarity of their embeddings,
asked of the pool that serves `semantic.model` (its /v1/embeddings): the nearest at `threshold` or above is a hit,
unless the words of the two texts say they ask different questions (a number, a negation, the order, one short
edit: gateway/cache/wording.py), when the next nearest is tried.

The embeddings are this process's (`response_cache.max_embeddings` in all, the least recently used bucket out
first), kept for answers it stored; the answers
themselves are in the answer store, so a match whose answer expired or was pushed out is a miss. An embedding the
pool cannot give (down, slow past `EMBED_TIMEOUT`, a body that is no embedding) skips the semantic match: the
request goes on as a miss.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import aiohttp
import numpy as np
import orjson

from gateway.cache.key import cache_key
from gateway.cache.wording import Wording
from gateway.routing.pool import Pools

log = logging.getLogger(__name__)

SEMANTIC_ROUTES = frozenset({"chat", "messages"})
EMBED_TIMEOUT = 2.0  # seconds an embedding may take before the request goes on without it
MAX_EMBEDDING_BYTES = 1 << 20  # an embeddings answer for one text: a vector of a few thousand numbers
# texts at the threshold or above whose words are compared, nearest first: a bucket of thousands of texts alike
# in meaning but not in words would otherwise have each request compare them all on the event loop
MAX_CANDIDATES = 8
Vector = np.ndarray[Any, np.dtype[np.float32]]


def last_user_text(payload: dict[str, Any]) -> str | None:
    """The text of the request's last message where it is the user's and text alone; else None."""
    messages = payload.get("messages")
    if not isinstance(messages, list) or not messages or not isinstance(messages[-1], dict):
        return None
    last = messages[-1]
    content = last.get("content")
    if last.get("role") != "user":
        return None
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and all(_is_text_part(part) for part in content):
        return "\n".join(part["text"] for part in content)
    return None


def _is_text_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)


def bucket_key(
    tenant: str, route: str, pool: str, payload: dict[str, Any], beta: str | None, embedder: str
) -> str | None:
    """The key of the requests equal to this one but for its last user message's text, compared by `embedder`'s
    embeddings (another model's are not comparable); None where the body has no canonical form."""
    messages = list(payload["messages"])
    messages[-1] = {**messages[-1], "content": None}
    return cache_key(tenant, f"semantic:{embedder}:{route}", pool, {**payload, "messages": messages}, beta)


class SemanticIndex:
    """Embeddings of answered texts, per bucket, with each text's words and the exact key of its answer;
    `max_entries` in all, the oldest of the least recently used bucket out first."""

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._buckets: OrderedDict[str, tuple[list[Vector], list[Wording], list[str]]] = OrderedDict()
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def nearest(self, bucket: str, vector: Vector, wording: Wording, threshold: float) -> tuple[str, float] | None:
        """The exact key of the bucket's text nearest `vector` at `threshold` or more whose words do not conflict
        with `wording` (of the MAX_CANDIDATES nearest), with its similarity."""
        found = self._buckets.get(bucket)
        if found is None:
            return None
        self._buckets.move_to_end(bucket)
        vectors, wordings, keys = found
        similarities = np.stack(vectors) @ vector
        near = np.flatnonzero(similarities >= threshold)
        for best in near[np.argsort(-similarities[near])][:MAX_CANDIDATES]:
            if wordings[best].conflict(wording) is None:
                return keys[best], float(similarities[best])
        return None

    def add(self, bucket: str, vector: Vector, wording: Wording, key: str) -> None:
        vectors, wordings, keys = self._buckets.setdefault(bucket, ([], [], []))
        self._buckets.move_to_end(bucket)
        if key in keys:
            return
        vectors.append(vector)
        wordings.append(wording)
        keys.append(key)
        self._size += 1
        while self._size > self.max_entries:
            oldest, (old_vectors, old_wordings, old_keys) = next(iter(self._buckets.items()))
            old_vectors.pop(0)
            old_wordings.pop(0)
            old_keys.pop(0)
            self._size -= 1
            if not old_keys:
                del self._buckets[oldest]


class Embedder:
    """Embeddings from the pool that serves a model, through its own connections and key."""

    def __init__(self, pools: Callable[[], Pools]) -> None:
        self._pools = pools  # the pools now: a config reload replaces them

    async def embed(self, model: str, text: str) -> Vector | None:
        """`text`'s embedding, unit length; None where the pool gives none."""
        pool = self._pools().for_model(model)
        if pool is None or pool.config.api != "openai":
            log.warning("response cache: no OpenAI-compatible pool serves the embeddings model %r", model)
            return None
        replica = pool.rank(pool.request_shape(0, 0, None)).replicas[0]
        headers = {"content-type": "application/json"}
        if api_key := pool.api_key_for(None):
            headers["authorization"] = f"Bearer {api_key}"
        body = orjson.dumps({"model": model, "input": text})
        try:
            async with pool.session.post(
                replica.url + "/v1/embeddings",
                data=body,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=EMBED_TIMEOUT),
            ) as response:
                if response.status != 200 or (response.content_length or 0) > MAX_EMBEDDING_BYTES:
                    return None
                content = await response.content.read(MAX_EMBEDDING_BYTES + 1)
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("response cache: embedding from %s failed: %s", replica.url, exc)
            return None
        return embedding_of(content)


def embedding_of(content: bytes) -> Vector | None:
    """The first embedding of an embeddings answer, scaled to unit length; None for anything else."""
    if len(content) > MAX_EMBEDDING_BYTES:
        return None
    try:
        numbers = orjson.loads(content)["data"][0]["embedding"]
        vector = np.asarray(numbers, dtype=np.float32)
    except (orjson.JSONDecodeError, KeyError, IndexError, TypeError, ValueError):
        return None
    norm = float(np.linalg.norm(vector)) if vector.ndim == 1 and vector.size else 0.0
    if not np.isfinite(norm) or norm == 0.0:
        return None
    return vector / norm
