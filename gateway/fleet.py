"""The fleet: what portcullis.yaml's pools, models and fallbacks build, as one set a config reload replaces whole.

Its parts are the pools (their connections, routing state and upstream keys), the fallback steps between them,
which tenant may call which model, the tokenizers and context windows of the models, and the stages that decide on
them (authority, admission). A reload builds a new fleet beside the running one, then swaps it in with one
assignment. Each request holds the fleet it arrived on until it has ended and settled, so every decision about it
is made on one set or the other, never a mix of both. A pool the new config keeps exactly as it was is carried over
(its connections, scraped load, prefix index and fair queue go on); one it drops or changes is closed once every
request on an older fleet has ended, so a reload neither cuts a stream short nor leaks a session.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator
from operator import attrgetter
from typing import Literal

from opentelemetry.trace import Tracer

from gateway.config import GatewayConfig, PoolConfig
from gateway.context import RequestContext
from gateway.edge.offload import Offload
from gateway.observability.telemetry import Metrics
from gateway.policy.loader import PolicySet
from gateway.relay.fallbacks import Fallbacks
from gateway.relay.upstream import Upstream
from gateway.routing.pool import Pool, Pools
from gateway.stages.admission import AdmissionStage
from gateway.stages.authority import AuthorityStage
from gateway.stages.ratelimit import RateLimitStage
from gateway.stages.tokenize import Tokenize
from gateway.tenancy.batch_requests import BatchRequestChecks
from gateway.tenancy.models import TenantModels
from gateway.tenancy.ownership import TenantObjects
from gateway.tenancy.passthrough import ObjectPassthrough

log = logging.getLogger(__name__)


class Fleet:
    def __init__(
        self,
        pools: Pools,
        tokenize: Tokenize,
        models: TenantModels,
        authority: AuthorityStage,
        admission: AdmissionStage,
        object_passthrough: ObjectPassthrough,
    ) -> None:
        self.pools = pools
        self.tokenize = tokenize
        self.models = models
        self.authority = authority
        self.admission = admission
        self.object_passthrough = object_passthrough
        self._users = 0
        self._retired = False
        self.drained = asyncio.Event()  # set once retired and no request holds it

    def enter(self) -> Fleet:
        """A request starts on this fleet; it calls `leave` once it has settled."""
        self._users += 1
        return self

    def leave(self) -> None:
        self._users -= 1
        if self._retired and self._users == 0:
            self.drained.set()

    def retire(self) -> None:
        self._retired = True
        if self._users == 0:
            self.drained.set()


class FleetBuilder:
    """Builds a fleet from a config, on what every fleet shares (the rate limits, the tenants' objects, the upstream
    client)."""

    def __init__(
        self,
        policies: Callable[[], PolicySet],
        offload: Offload,
        limits: RateLimitStage,
        objects: TenantObjects,
        upstream: Upstream,
        batch_requests: BatchRequestChecks,
        tracer: Tracer,
        metrics: Metrics,
    ) -> None:
        self._policies = policies
        self._batch_requests = batch_requests
        self._offload = offload
        self._limits = limits
        self._objects = objects
        self._upstream = upstream
        self._tracer = tracer
        self._metrics = metrics

    def build(self, config: GatewayConfig, previous: Fleet | None = None) -> Fleet:
        """The fleet `config` describes, carrying over `previous`'s pools that are configured exactly as they were.
        A new pool starts nothing until the fleet is swapped in: a config refused here (an upstream key's variable
        not set) leaves nothing behind."""
        running = {pool.name: pool for pool in previous.pools.pools} if previous else {}
        pools = Pools([_carried(running.get(p.name), p) or Pool(p) for p in config.pools])
        carried = {p.name for p in pools.pools if running.get(p.name) is p}
        tokenize = (
            previous.tokenize.for_models(config.models)
            if previous
            else Tokenize(config.models, self._policies, self._offload)
        )
        models = TenantModels(self._objects, config.pools)
        fallbacks = Fallbacks(config.fallbacks, pools, self._metrics.fallbacks)
        queues = {name: q for name, q in previous.admission.queues.items() if name in carried} if previous else {}
        return Fleet(
            pools,
            tokenize,
            models,
            AuthorityStage(tokenize, self._limits, fallbacks, models, self._tracer),
            AdmissionStage(pools.pools, self._tracer, self._metrics, queues),
            ObjectPassthrough(self._objects, models, self._upstream, self._batch_requests),
        )


def _carried(running: Pool | None, config: PoolConfig) -> Pool | None:
    """The running pool of that name, where the reloaded config leaves it exactly as it was."""
    return running if running is not None and running.config == config else None


class Fleets:
    """The fleet new requests start on, and the retired ones whose dropped pools close once drained."""

    def __init__(self, first: Fleet) -> None:
        self.current = first
        self._closing: list[asyncio.Task[None]] = []  # one per retired fleet, oldest first

    def start(self) -> None:
        self.current.pools.start()

    @contextlib.contextmanager
    def holding(self) -> Iterator[Fleet]:
        """The current fleet, held for the time of a look at its pools (a probe, a model list)."""
        fleet = self.current.enter()
        try:
            yield fleet
        finally:
            fleet.leave()

    def swap(self, fleet: Fleet) -> None:
        """Serve new requests on `fleet` (its new pools started); the running one's pools that `fleet` does not keep
        close once it, and every fleet retired before it, has no request left."""
        old = self.current
        running, kept = {id(pool) for pool in old.pools.pools}, {id(pool) for pool in fleet.pools.pools}
        for pool in fleet.pools.pools:
            if id(pool) not in running:
                pool.start()
        self.current = fleet
        old.retire()
        dropped = [pool for pool in old.pools.pools if id(pool) not in kept]
        before = self._closing[-1] if self._closing else None
        self._closing = [task for task in self._closing if not task.done()]
        self._closing.append(asyncio.get_running_loop().create_task(_close_when_drained(old, dropped, before)))

    async def aclose(self) -> None:
        """At shutdown: every pool, also those still waiting on requests of a retired fleet."""
        for task in self._closing:
            task.cancel()
        await asyncio.gather(*self._closing, return_exceptions=True)
        await self.current.pools.aclose()


async def _close_when_drained(fleet: Fleet, dropped: list[Pool], before: asyncio.Task[None] | None) -> None:
    """A request of an older fleet may still use a pool this one dropped, so those fleets drain first."""
    try:
        if before is not None:
            await asyncio.shield(before)
        await fleet.drained.wait()
    finally:  # cancelled at shutdown too: they close now
        for pool in dropped:
            try:
                await pool.aclose()
            except Exception:
                log.exception("closing pool %s after a config reload failed", pool.name)
        if dropped:
            log.info("closed pools %s, dropped by a config reload", ", ".join(p.name for p in dropped))


class OnFleet:
    """A stage of the fleet the request holds (authority, admission): the pipeline names it once, and each request
    runs, and settles, its own fleet's. `name` is the fleet's attribute that holds the stage."""

    def __init__(self, name: Literal["authority", "admission"]) -> None:
        self.name: str = name
        self._stage: Callable[[Fleet], AuthorityStage | AdmissionStage] = attrgetter(name)

    def __call__(self, ctx: RequestContext) -> Awaitable[None]:
        """The fleet's stage run for the request: the pipeline awaits that stage's own coroutine, not one of ours
        around it."""
        return self._stage(ctx.on_fleet)(ctx)

    def settle(self, ctx: RequestContext) -> None:
        if ctx.fleet is not None:
            self._stage(ctx.fleet).settle(ctx)
