"""What the response cache serves and what identifies an answer in it.

A request is looked up only when its tenant's policy turns the cache on for its route, model and pool, when it
names no `Cache-Control: no-store` or `no-cache`, when a key identified its tenant (a gateway with no keys serves
every caller as one anonymous tenant: they share no cache), and, under `deterministic_only`, when its answer is
reproducible: temperature 0 or a seed (embeddings always). Some requests are never served from it whatever the
policy: a Responses request that runs in the background or adds to a conversation (its answer changes state upstream
a cached answer would skip).

The key is a SHA-256 over the tenant, the route, the pool the request is routed to (the model is in the body) and the
request body as it would go upstream (after the input guard's redactions and the model a fallback chose), with its
keys sorted: every field counts but the transport-only ones (`_TRANSPORT`), reviewed one by one: `stream` and
`stream_options` change how the answer travels, never what it says. `user`, `metadata`, `cache_salt` and the like
stay in: a tenant is never served another's answer whatever it sends, since the tenant is in the key, and a field
that may change moderation or routing upstream changes the key. An Anthropic pool's `anthropic-beta` header opts in
to features that change the answer, so it is in the key too.
"""

from __future__ import annotations

import hashlib
from typing import Any

import orjson

from gateway.policy.model import CacheSpec

_TRANSPORT = frozenset({"stream", "stream_options"})
_CACHEABLE_ROUTES = frozenset({"chat", "completions", "responses", "embeddings", "messages"})
KEY_VERSION = b"portcullis-cache-v1"


def refused_by_client(cache_control: str | None) -> bool:
    """Whether the request's Cache-Control asks for a fresh answer, not stored (no-store) or not served from a cache
    (no-cache); either keeps the request out of the cache both ways."""
    if not cache_control:
        return False
    directives = {part.strip().split("=", 1)[0].lower() for part in cache_control.split(",")}
    return "no-store" in directives or "no-cache" in directives


def bypass_reason(
    spec: CacheSpec, route: str, tenant: str | None, payload: dict[str, Any], cache_control: str | None
) -> str | None:
    """Why a request is not looked up (None: it is), the policy's scope already applied."""
    if route not in _CACHEABLE_ROUTES:
        return "route"
    if tenant is None:
        return "anonymous"
    if refused_by_client(cache_control):
        return "cache_control"
    if route == "responses" and (payload.get("background") or payload.get("conversation") is not None):
        return "stateful"
    if spec.deterministic_only and not deterministic(route, payload):
        return "sampled"
    return None


def deterministic(route: str, payload: dict[str, Any]) -> bool:
    """Whether the request asks for a reproducible answer: greedy decoding (temperature 0) or, on the OpenAI routes,
    a fixed seed. An absent temperature is the API's default of 1: sampled."""
    if route == "embeddings":
        return True
    temperature = payload.get("temperature")
    if isinstance(temperature, (int, float)) and not isinstance(temperature, bool) and temperature == 0:
        return True
    seed = payload.get("seed")
    return route != "messages" and isinstance(seed, int) and not isinstance(seed, bool)


def cache_key(tenant: str, route: str, pool: str, payload: dict[str, Any], beta: str | None) -> str | None:
    """The answer's key: hex SHA-256 of the request as identified above; None for a body JSON allows that has no
    canonical form here (an integer past 64 bits): such a request is not cached."""
    try:
        canonical = orjson.dumps({k: v for k, v in payload.items() if k not in _TRANSPORT}, option=orjson.OPT_SORT_KEYS)
    except orjson.JSONEncodeError:
        return None
    digest = hashlib.sha256(KEY_VERSION)
    for part in (tenant, route, pool, beta or ""):
        encoded = part.encode()
        digest.update(len(encoded).to_bytes(4, "big") + encoded)  # length-prefixed: no two splits hash alike
    digest.update(canonical)
    return digest.hexdigest()
