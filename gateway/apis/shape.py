"""What every stage needs to know of one request shape, so no stage asks which route it serves.

An `Api` says, for its route: which body is valid (the parse stage); what the request carries (its content
inventory, gateway/apis/inventory.py: every string, what it is and where it lives, which the WAF, the guard and
redaction read); the prompt as a tokenizer counts it (exact token counts, prefix hashes); and which fields bound what
it generates (token limits reserve them). Each shape is one module beside this one; `gateway/apis/routes.py` lists
them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Literal

from starlette.responses import Response

from gateway.apis.inventory import Inventory, Spec, take
from gateway.errors import GatewayError
from gateway.streaming.sse import DONE

CountForm = Literal["chat", "prompt"]  # chat messages through a chat template, or a completions-style prompt


class Api(ABC):
    """One request shape. Subclasses fill in the class attributes and the methods that differ."""

    name: str  # the route's name in policies, metrics and logs
    path: str
    operation: str  # gen_ai.operation.name
    # The fields that bound what a request generates, in the order upstreams honour them; the one the policy's
    # default is written into when none is sent (None: the shape requires one, or generates nothing).
    output_fields: tuple[str, ...] = ("max_tokens",)
    fill_field: str | None = "max_tokens"
    choice_fields: tuple[str, ...] = ()  # fields that multiply the choices generated (n, best_of)
    carriers: Spec  # what the shape's payload carries (gateway/apis/openai_carriers.py, anthropic/carriers.py)
    array_fields: tuple[str, ...] = ()  # top-level arrays bounded by `limits.max_messages`
    names_model: bool = True  # its body names the model it is for (every model route's; not MCP's messages)

    @property
    def generates(self) -> bool:
        return bool(self.output_fields)

    def error_response(self, error: GatewayError) -> Response:
        """A refusal in this route's own error shape (OpenAI's, unless a shape says otherwise)."""
        return error.response()

    def stream_error(self, error: GatewayError) -> bytes:
        """The event that ends a stream that broke after it started, in this route's stream format."""
        return error.sse_event() + DONE

    def guarded(self, embeddings: bool) -> bool:
        """Whether the input guard reads this shape's requests (`embeddings`: the policy's guard.embeddings)."""
        return True

    @abstractmethod
    def check(self, payload: dict[str, Any]) -> None:
        """The schema essentials every later stage relies on; a 400 (GatewayError) naming the field otherwise."""

    def inventory(self, payload: Any) -> Inventory:
        """Everything the payload carries, each string classified (gateway/apis/inventory.py); any payload, checked
        or not (the WAF reads it before the parse stage's checks have been applied to a raw request)."""
        return take(self.carriers, payload)

    @abstractmethod
    def counted(self, payload: dict[str, Any]) -> tuple[CountForm, Any]:
        """The prompt as a tokenizer counts it: ("chat", messages in OpenAI chat shape) or ("prompt", a
        completions-style prompt: text, texts, token ids or lists of them)."""
