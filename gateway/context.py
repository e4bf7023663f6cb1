"""RequestContext: the one object that flows through every stage, from the first byte in to the last byte out.

The stages' contracts live here. What a stage leaves for later ones is a typed field; what a later stage cannot run
without, it reads through an accessor that names the stage it depends on (`placed`), so a pipeline built in the
wrong order fails saying so. The body the upstream is sent is encoded in one place (`outgoing_body`): a stage that
rewrites the payload only sets `payload_rewritten`, however many of them do.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from opentelemetry.trace import Span
from starlette.requests import Request

from gateway.apis.exchange import Exchange, exchange_for
from gateway.apis.inventory import Inventory
from gateway.apis.routes import BY_NAME
from gateway.apis.shape import Api

if TYPE_CHECKING:
    from starlette.responses import Response

    from gateway.admission.fair_queue import FairQueue
    from gateway.cache.fill import CacheFill
    from gateway.fleet import Fleet
    from gateway.guard.output import OutputGuard
    from gateway.keystore.records import KeyRecord
    from gateway.mcp.call import McpCall
    from gateway.policy.model import PriceTable
    from gateway.ratelimit.limiter import Grant
    from gateway.routing.policies import RouteRequest
    from gateway.routing.pool import Pool
    from gateway.routing.replica import KvHold, Replica
    from gateway.spend.charge import Charge
    from gateway.tenancy.stage import MadeObjects


_REQUEST_ID_PREFIX = os.urandom(8).hex()  # this process's: ids from several processes never collide
_request_numbers = itertools.count()


def new_request_id() -> str:
    """32 hex digits, unique across processes, without a system call per request (uuid4 reads the OS's random
    source each time; a request id needs to be unique, not unpredictable)."""
    return f"{_REQUEST_ID_PREFIX}{next(_request_numbers):016x}"


class StageOrderError(RuntimeError):
    """A stage read what an earlier stage sets before that stage ran: the pipeline is built wrong (not the client's
    fault)."""


@dataclass(slots=True)
class Usage:
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    reasoning_tokens: int | None = None  # of the completion tokens, those spent reasoning (where reported)
    finish_reasons: list[str] = field(default_factory=list)
    generated: bool = False  # output (text, content, a tool call) came back: completion tokens were spent
    response_id: str | None = None  # the answer's own id and the model that wrote it, as the upstream named them
    response_model: str | None = None


class Demand(NamedTuple):
    """What one attempt asks of the model it goes to: the prompt as that model's tokenizer counts it (and its ids,
    when they are exactly the upstream's), and the most it may generate within that model's context window. Limits
    reserve it and budgets price it at that model (gateway/stages/authority.py)."""

    model: str
    prompt_tokens: int
    prompt_token_ids: list[int] | None
    max_tokens: int
    filled: int | None = None  # the output bound the gateway fills in where the request names none


@dataclass(slots=True)
class Placement:
    """Where admission put a request: its pool, its shape for routing, and the KV blocks it holds on a replica until
    it ends. Routing adds the replicas to try, best first."""

    pool: Pool
    request: RouteRequest
    kv_hold: KvHold
    queue: FairQueue | None = None  # the fair queue that let it in: charged the real output when it ends
    candidates: Sequence[Replica] = ()


@dataclass(slots=True)
class RequestContext:
    """What stages know about one request. Stages read and write it; they never call each other."""

    request: Request
    route: str  # the request shape's name (gateway/apis/routes.py): "chat", "completions", "responses", ...
    span: Span  # the request's span: every stage's attributes go here
    client_ip: str = ""
    request_id: str = field(default_factory=new_request_id)
    started: float = field(default_factory=time.perf_counter)
    # the pools, models and fallbacks the request arrived on (gateway/fleet.py), held until it has settled
    fleet: Fleet | None = None
    # parse
    body: bytes = b""  # as received: what the WAF reads, and what sizes a body for the offload executor
    payload: dict[str, Any] = field(default_factory=dict)
    # the payload as parse decoded it, encoded again: each key spelled `"key":` (gateway/edge/json_bounds.py); None
    # where the route's parse gives none
    encoded_payload: bytes | None = None
    payload_rewritten: bool = False  # a stage changed the payload: the upstream gets it re-encoded
    json_values: int = 0  # how many values the body holds: with its size, whether its work leaves the event loop
    model: str = ""
    stream: bool = False
    # the MCP route (gateway/mcp/): the exchange with the client, and a tools/call's "server/tool" per-tool limits count
    mcp: McpCall | None = None
    tool: str = ""
    # auth
    tenant: str | None = None
    key_id: str | None = None  # short digest prefix: identifies a key in limits and logs, reveals nothing
    key_label: str | None = None
    key: KeyRecord | None = None  # a stored key's record (allowed models, limit overrides, budget); None if static
    # authority (gateway/stages/authority.py): what the request's current attempt is authorised for. `model` above is
    # its model; these are that model's counts and the pool the attempt goes to (admission places the request there)
    pool: Pool | None = None
    prompt_tokens: int | None = None
    prompt_token_ids: list[int] | None = None  # only when exactly the upstream's ids (prefix-cache prediction)
    # what the request may generate over all its choices: the larger of max_tokens and max_completion_tokens (or
    # the policy's default), times n
    max_tokens: int | None = None
    # what its limits and budgets granted (slots, token and spend reservations), held until the request ends or the
    # attempt they were granted for fails (a passthrough route's rate-limit stage grants them too)
    rate_limits: Grant | None = None
    # admission / route: read `placed` in the stages after admission
    placement: Placement | None = None
    predicted_cached_tokens: int | None = None  # what routing expected the replica to have cached
    # guard: set when the policy turns the output guard on; the upstream relay runs the answer through it
    output_guard: OutputGuard | None = None
    # cache (gateway/stages/cache.py): "hit", "semantic_hit", "miss" or "bypass" where the policy's response cache
    # covers the request; on a miss, what takes the answer to store; on a hit, the answer, and the stages after it
    # do not run
    cache_result: str | None = None
    cache_fill: CacheFill | None = None
    answered: Response | None = None
    # fallbacks (gateway/relay/fallbacks.py): the model the client asked for, once a fallback step serves it instead
    fallback_from: str | None = None
    fallback_step: int = 0  # 0: the requested model on its own pool; n: the model's n-th fallback target
    # upstream / response
    usage_asked: bool = False  # the gateway asked a stream for usage the client did not: stripped from its answer
    replica: Replica | None = None
    status: int = 0
    usage: Usage = field(default_factory=Usage)
    stream_error: str | None = None
    response_headers: dict[str, str] = field(default_factory=dict)
    # objects the upstream makes for the tenant (a stored response): recorded as theirs (gateway/tenancy/stage.py)
    made_objects: MadeObjects | None = None
    # what the ended request is charged, at which price table (gateway/spend/charge.py): settlement and billing ask
    charged: tuple[PriceTable, Charge] | None = None
    # the payload's content inventory, taken once for the stages that read content (`content`), and the payload it is of
    _content: tuple[dict[str, Any], Inventory] | None = field(default=None, repr=False)

    @property
    def api(self) -> Api:
        """The request shape: what its text is, how it is counted, what bounds its output."""
        return BY_NAME[self.route]

    def content(self) -> Inventory:
        """What the payload carries (gateway/apis/inventory.py): the WAF, the guard and redaction read only this. Taken
        again if a stage replaced the payload; a stage that rewrites a text does so through the inventory. Taking it
        walks the whole body: a big body's belongs on the offload executor."""
        taken = self._content
        if taken is None or taken[0] is not self.payload:
            taken = self._content = (self.payload, self.api.inventory(self.payload))
        return taken[1]

    def kept_content(self) -> Inventory | None:
        """The payload's inventory where a stage took it already (the parse stage does, on the model routes)."""
        taken = self._content
        return taken[1] if taken is not None and taken[0] is self.payload else None

    def keep_content(self, inventory: Inventory) -> None:
        """The payload's inventory as a stage took it (the WAF, on the offload executor), for the later ones."""
        self._content = (self.payload, inventory)

    @property
    def served_from_cache(self) -> bool:
        """Whether the response cache answered the request (no upstream was asked)."""
        return self.cache_result in ("hit", "semantic_hit")

    @property
    def exchange(self) -> Exchange:
        """How this request travels to its pool and back (after admission chose the pool)."""
        pool = self.placed.pool
        return exchange_for(self.api, pool.config.api, pool.name)

    @property
    def operation(self) -> str:
        """GenAI semantic-convention operation name."""
        return self.api.operation

    @property
    def on_fleet(self) -> Fleet:
        if self.fleet is None:
            raise StageOrderError("the request holds no fleet: its endpoint must give it the current one")
        return self.fleet

    @property
    def placed(self) -> Placement:
        """Admission's placement, for routing and the upstream call."""
        if self.placement is None:
            raise StageOrderError("the request has no placement: admission must run before routing and the upstream")
        return self.placement

    def outgoing_body(self) -> bytes:
        """The body the upstream is sent: as received, or the payload re-encoded when a stage rewrote it."""
        return json.dumps(self.payload).encode() if self.payload_rewritten else self.body
