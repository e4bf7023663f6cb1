"""RequestContext: the one object that flows through every stage, from the first byte in to the last byte out."""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from opentelemetry.trace import Span
from starlette.requests import Request

if TYPE_CHECKING:
    from gateway.routing.policies import RouteRequest
    from gateway.routing.pool import Pool
    from gateway.routing.replica import KvHold, Replica


@dataclass(slots=True)
class Usage:
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reasons: list[str] = field(default_factory=list)
    generated: bool = False  # output (text, content, a tool call) came back: completion tokens were spent


@dataclass(slots=True)
class RequestContext:
    """What stages know about one request. Stages read and write it; they never call each other."""

    request: Request
    route: str  # "chat" | "completions"
    span: Span
    client_ip: str = ""
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    started: float = field(default_factory=time.perf_counter)
    # parse
    body: bytes = b""
    payload: dict[str, Any] = field(default_factory=dict)
    json_values: int = 0  # how many values the body holds: with its size, whether its work leaves the event loop
    model: str = ""
    stream: bool = False
    # tokenize
    prompt_tokens: int | None = None
    prompt_token_ids: list[int] | None = None  # only when exactly the upstream's ids (prefix-cache prediction)
    # what the request may generate over all its choices: the larger of max_tokens and max_completion_tokens (or
    # the policy's default), times n
    max_tokens: int | None = None
    # auth
    tenant: str | None = None
    key_id: str | None = None  # short digest prefix: identifies a key in limits and logs, reveals nothing
    key_label: str | None = None
    # admission / route
    pool: Pool | None = None
    route_request: RouteRequest | None = None
    predicted_cached_tokens: int | None = None  # what routing expected the replica to have cached
    kv_hold: KvHold | None = None  # KV blocks counted against a replica while this request runs
    candidates: list[Replica] = field(default_factory=list)
    # guard: set when the policy turns the output guard on (gateway.guard.output.OutputGuard)
    output_guard: Any = None
    # upstream / response
    replica: Replica | None = None
    status: int = 0
    usage: Usage = field(default_factory=Usage)
    stream_error: str | None = None
    annotations: dict[str, Any] = field(default_factory=dict)
    response_headers: dict[str, str] = field(default_factory=dict)
    # run once when the response has ended, however it ended (settle limits, free slots)
    on_complete: list[Callable[[RequestContext], Awaitable[None]]] = field(default_factory=list)

    @property
    def operation(self) -> str:
        """GenAI semantic-convention operation name."""
        return "chat" if self.route == "chat" else "text_completion"
