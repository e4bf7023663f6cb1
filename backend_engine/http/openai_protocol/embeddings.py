"""OpenAI's Embeddings API on the engine: request bodies in, the list of vectors out.

Two models may embed: the engine's sentence-embedding model (`backend_engine.embedding`, all-MiniLM-L6-v2 where its
wheel is installed), which a request naming no model gets, and the chat model, whose vector is the input's final
hidden states mean-pooled (`LLMEngine.embed`). Either is L2-normalised; `dimensions` keeps the first N components
and normalises again, as OpenAI's shortened embeddings do. "base64" is the vector's little-endian float32 bytes in
base64, which the openai SDK asks for by default and decodes.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from backend_engine.embedding.encoder import SentenceEncoder
from backend_engine.http.openai_protocol.errors import APIError
from backend_engine.http.openai_protocol.requests import RequestParser, field, is_token_id, known_fields, token_ids
from backend_engine.model.prompt import prompt_too_long

REQUEST_FIELDS = frozenset({"input", "model", "encoding_format", "dimensions", "user"})
MAX_INPUTS = 2048  # OpenAI's limit per request
ENCODING_FORMATS = ("float", "base64")


@dataclass(frozen=True)
class EmbeddingRequest:
    encoder: SentenceEncoder | None  # the sentence-embedding model that embeds the inputs; None: the chat model
    model: str  # the served name of the model that embeds them
    inputs: list[list[int]]  # token ids, one list per input, in the request's order
    encoding_format: str
    dimensions: int | None


@dataclass(frozen=True)
class InputRules:
    """How a model takes its inputs: its tokenizer, the most token ids it takes, the longest text it tokenizes (a
    longer one is refused or cut by `encode`, as the model's rules say) and what else its token ids must be."""

    encode: Callable[[list[str]], list[list[int]]]
    max_ids: int
    max_text_chars: int | None  # None: `encode` cuts longer texts itself
    validate: Callable[[list[int]], None]  # ValueError for ids the model cannot embed
    dimensions: int


def chat_model_rules(parser: RequestParser) -> InputRules:
    """The chat model's: its tokenizer, its context, its hidden size."""
    engine = parser.engine
    return InputRules(
        encode=lambda texts: [engine.tokenizer.encode(text) for text in texts],
        max_ids=engine.max_model_len,
        max_text_chars=parser.max_prompt_chars,
        validate=engine.validate_embedding_input,
        dimensions=engine.loaded.config.hidden_size,
    )


def encoder_rules(encoder: SentenceEncoder) -> InputRules:
    """A sentence-embedding model's: texts truncated at its max_seq_length, token ids refused past it."""
    return InputRules(encoder.encode, encoder.max_tokens, None, encoder.validate, encoder.dimensions)


def parse_embedding_request(
    body: dict[str, Any], parser: RequestParser, encoder: SentenceEncoder | None = None
) -> EmbeddingRequest:
    """A /v1/embeddings body checked against the model it names (the encoder when it names none and there is one)
    and its limits; 404 for a model the engine does not serve, 400 (OpenAI's shape) for the rest."""
    known_fields(body, REQUEST_FIELDS)
    model = body.get("model")
    if encoder is not None and model in (None, encoder.name):
        chosen, rules = encoder, encoder_rules(encoder)
    else:
        parser.check_model(body)
        chosen, rules = None, chat_model_rules(parser)
    field(body, "user", str, None)
    encoding_format = field(body, "encoding_format", str, "float")
    if encoding_format not in ENCODING_FORMATS:
        raise APIError(400, "encoding_format must be 'float' or 'base64'", param="encoding_format")
    dimensions = field(body, "dimensions", int, None)
    if dimensions is not None and not 1 <= dimensions <= rules.dimensions:
        raise APIError(400, f"dimensions must be between 1 and {rules.dimensions} for this model", param="dimensions")
    inputs = _token_lists(body.get("input"), rules)
    for i, ids in enumerate(inputs):
        try:
            rules.validate(ids)
        except ValueError as e:
            raise APIError(400, f"input {i}: {e}", param="input") from None
    name = chosen.name if chosen is not None else parser.model_name
    return EmbeddingRequest(chosen, name, inputs, encoding_format, dimensions)


def _token_lists(value: Any, rules: InputRules) -> list[list[int]]:
    """`input` as token ids: a string, an array of strings, an array of token ids, or an array of such arrays.

    Texts are measured before any is tokenized: one longer than any context holds (`InputRules.max_text_chars`)
    is refused as it is, where tokenizing 8 MB of text took seconds of a core the engine's steps share."""

    def encode_all(texts: list[str]) -> list[list[int]]:
        for text in texts:
            if rules.max_text_chars is not None and len(text) > rules.max_text_chars:
                raise APIError(400, prompt_too_long(len(text)), param="input", code="context_length_exceeded")
        return rules.encode(texts)

    max_len = rules.max_ids
    if isinstance(value, str):
        return encode_all([value])
    if isinstance(value, list) and value and is_token_id(value[0]):  # one input of token ids
        ids = token_ids(value, max_len, "input")
        if ids is not None:
            return [ids]
    elif isinstance(value, list) and value:
        if len(value) > MAX_INPUTS:
            raise APIError(400, f"at most {MAX_INPUTS} inputs per request", param="input")
        if all(isinstance(s, str) for s in value):
            return encode_all(value)
        lists = [ids for v in value if (ids := token_ids(v, max_len, "input")) is not None]
        if len(lists) == len(value):
            return lists
    raise APIError(
        400,
        "'input' must be a string, an array of strings, an array of token ids or an array of token-id arrays, "
        "and not empty",
        param="input",
    )


def unit_vector(pooled: np.ndarray, dimensions: int | None) -> np.ndarray:
    """The pooled hidden state's first `dimensions` components (all when None), scaled to length 1."""
    v = np.asarray(pooled[:dimensions] if dimensions is not None else pooled, dtype=np.float32)
    norm = np.linalg.norm(v)
    return v / norm if norm > 0 else v


def _encoded(v: np.ndarray, encoding_format: str) -> Any:
    if encoding_format == "base64":
        return base64.b64encode(v.astype("<f4").tobytes()).decode("ascii")
    return v.tolist()


def embedding_response(req: EmbeddingRequest, pooled: list[np.ndarray]) -> dict[str, Any]:
    tokens = sum(len(ids) for ids in req.inputs)
    return {
        "object": "list",
        "data": [
            {
                "object": "embedding",
                "index": i,
                "embedding": _encoded(unit_vector(p, req.dimensions), req.encoding_format),
            }
            for i, p in enumerate(pooled)
        ],
        "model": req.model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
