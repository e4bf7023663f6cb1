"""OpenAI's Embeddings API on the engine: request bodies in, the list of vectors out.

A vector is the input's final hidden states mean-pooled (`LLMEngine.embed`) and L2-normalised; `dimensions` keeps
the first N components and normalises again, as OpenAI's shortened embeddings do. "base64" is the vector's
little-endian float32 bytes in base64, which the openai SDK asks for by default and decodes.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

import numpy as np

from backend_engine.model.prompt import prompt_too_long
from backend_engine.openai_protocol.errors import APIError
from backend_engine.openai_protocol.requests import RequestParser, field, is_token_id, known_fields, token_ids

REQUEST_FIELDS = frozenset({"input", "model", "encoding_format", "dimensions", "user"})
MAX_INPUTS = 2048  # OpenAI's limit per request
ENCODING_FORMATS = ("float", "base64")


@dataclass(frozen=True)
class EmbeddingRequest:
    inputs: list[list[int]]  # token ids, one list per input, in the request's order
    encoding_format: str
    dimensions: int | None


def parse_embedding_request(body: dict[str, Any], parser: RequestParser) -> EmbeddingRequest:
    """A /v1/embeddings body checked against the engine's model and limits; 400 (OpenAI's shape) when not."""
    known_fields(body, REQUEST_FIELDS)
    parser.check_model(body)
    field(body, "user", str, None)
    encoding_format = field(body, "encoding_format", str, "float")
    if encoding_format not in ENCODING_FORMATS:
        raise APIError(400, "encoding_format must be 'float' or 'base64'", param="encoding_format")
    hidden_size = parser.engine.loaded.config.hidden_size
    dimensions = field(body, "dimensions", int, None)
    if dimensions is not None and not 1 <= dimensions <= hidden_size:
        raise APIError(400, f"dimensions must be between 1 and {hidden_size} for this model", param="dimensions")
    inputs = _token_lists(body.get("input"), parser)
    for i, ids in enumerate(inputs):
        try:
            parser.engine.validate_embedding_input(ids)
        except ValueError as e:
            raise APIError(400, f"input {i}: {e}", param="input") from None
    return EmbeddingRequest(inputs, encoding_format, dimensions)


def _token_lists(value: Any, parser: RequestParser) -> list[list[int]]:
    """`input` as token ids: a string, an array of strings, an array of token ids, or an array of such arrays.

    Texts are measured before any is tokenized: one longer than any context holds (`RequestParser.max_prompt_chars`)
    is refused as it is, where tokenizing 8 MB of text took seconds of a core the engine's steps share."""

    def encode_all(texts: list[str]) -> list[list[int]]:
        for text in texts:
            if len(text) > parser.max_prompt_chars:
                raise APIError(400, prompt_too_long(len(text)), param="input", code="context_length_exceeded")
        return [parser.engine.tokenizer.encode(text) for text in texts]

    max_len = parser.engine.max_model_len
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


def embedding_response(req: EmbeddingRequest, pooled: list[np.ndarray], model_name: str) -> dict[str, Any]:
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
        "model": model_name,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
