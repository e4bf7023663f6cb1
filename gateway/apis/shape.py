"""What every stage needs to know of one request shape, so no stage asks which route it serves.

An `Api` says, for its route: which body is valid (the parse stage); which texts a model will read, with the role
each came in and where it lives in the payload (the WAF's prompt part, the guard's inputs, redaction in place); the
prompt as a tokenizer counts it (exact token counts, prefix hashes); and which fields bound what it generates (token
limits reserve them). Each shape is one module beside this one; `gateway/apis/routes.py` lists them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from starlette.responses import Response

from gateway.errors import GatewayError
from gateway.sse import DONE
from gateway.tool_text import dotted

Location = tuple[str | int, ...]  # keys and indices from the payload's root
# content: what a message says; tool_arguments: the arguments of a call the model made earlier (model-written);
# tool_definition: a tool's or parameter's description (where a poisoned third-party tool hides instructions).
TextKind = Literal["content", "tool_arguments", "tool_definition"]
PROMPT_ROLE = "prompt"  # completions prompts and embeddings inputs: text with no message role
CountForm = Literal["chat", "prompt"]  # chat messages through a chat template, or a completions-style prompt


@dataclass(slots=True)
class PromptText:
    """One text a model will read: its role ("prompt" for role-less text), where it lives, and what it is."""

    text: str
    role: str
    loc: Location
    holder: Any  # the dict or list holding it, so redaction can rewrite it in place (holder[loc[-1]])
    kind: TextKind = "content"

    @property
    def where(self) -> str:
        """Where it is, for people: the message or part it is the text of ("messages[2]",
        "messages[0].content[1]"), or its own field ("tools[0].function.description")."""
        return dotted(self.loc[:-1] if self.loc[-1] in ("content", "text") and len(self.loc) > 1 else self.loc)

    @property
    def key(self) -> str | int:
        return self.loc[-1]


@dataclass(frozen=True, slots=True)
class TokenPrompt:
    """A prompt sent as token ids: the model reads them as surely as text, so the guard decodes and scans them."""

    ids: list[int]
    loc: Location


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
    prompt_keys: frozenset[str] = frozenset()  # top-level keys under which prompt text may live
    array_fields: tuple[str, ...] = ()  # top-level arrays bounded by `limits.max_messages`

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

    @abstractmethod
    def texts(self, payload: dict[str, Any]) -> Iterator[PromptText]:
        """Every text of the request a model will read, in payload order (the payload passed `check`)."""

    def token_prompts(self, payload: dict[str, Any]) -> Iterator[TokenPrompt]:
        """Prompts sent as token ids (completions and embeddings only)."""
        return iter(())

    @abstractmethod
    def is_prompt(self, loc: Location) -> bool:
        """Whether a body location (under one of `prompt_keys`) is prompt text, hidden from the WAF's web-attack
        parts, rather than an application field; a whole subtree is prompt when its root is."""

    @abstractmethod
    def counted(self, payload: dict[str, Any]) -> tuple[CountForm, Any]:
        """The prompt as a tokenizer counts it: ("chat", messages in OpenAI chat shape) or ("prompt", a
        completions-style prompt: text, texts, token ids or lists of them)."""
