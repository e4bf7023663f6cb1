"""OpenAI embeddings (`POST /v1/embeddings`): input as text, texts, token ids or lists of them; nothing generated.

Counted, limited and WAF'd like a completions prompt; the guard scans it only where the policy asks
(`guard.embeddings`): text sent for embedding is stored and retrieved, not obeyed, until it is.
"""

from __future__ import annotations

from typing import Any

from gateway.apis.completions import check_prompt
from gateway.apis.openai_carriers import EMBEDDINGS
from gateway.apis.openai_fields import USER, FieldChecks, check_fields, check_model, is_int
from gateway.apis.shape import Api, CountForm
from gateway.errors import invalid_request

MAX_INPUTS = 2048  # OpenAI's limit on inputs per request
_FIELDS = FieldChecks(
    USER,
    ("dimensions", lambda v: is_int(v) and v >= 1, "a positive integer"),
    ("encoding_format", lambda v: v in ("float", "base64"), "'float' or 'base64'"),
)


class Embeddings(Api):
    name = "embeddings"
    path = "/v1/embeddings"
    operation = "embeddings"
    output_fields = ()
    fill_field = None
    carriers = EMBEDDINGS

    def check(self, payload: dict[str, Any]) -> None:
        check_model(payload)
        check_fields(payload, _FIELDS)
        if payload.get("stream"):
            raise invalid_request("embeddings do not stream", param="stream")
        check_prompt(payload.get("input"), "input")
        inputs = payload["input"]
        if isinstance(inputs, list) and not isinstance(inputs[0], int) and len(inputs) > MAX_INPUTS:
            raise invalid_request(f"'input' may hold at most {MAX_INPUTS} inputs, got {len(inputs)}", param="input")

    def guarded(self, embeddings: bool) -> bool:
        return embeddings

    def counted(self, payload: dict[str, Any]) -> tuple[CountForm, Any]:
        return "prompt", payload.get("input")
