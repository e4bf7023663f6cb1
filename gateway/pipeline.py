"""The ordered stage runner: each stage is one module, one span, one latency histogram.

A request passes through two phases of the pipeline, the way Envoy's external processors see a request's headers and
body on the way in and its end on the way out:
- the request phase: each stage in order passes by returning, rejects by raising `GatewayError`, and leaves what
  later stages need on the context (gateway/context.py says what each one sets); a stage that answers the request
  itself (the response cache's hit) leaves the answer in `ctx.answered`, and the stages after it do not run;
- the settle phase: once the response has ended, however it ended (answered, refused by a stage, failed upstream,
  abandoned by its client), every stage that holds something for a request until then (`Settles`: rate-limit slots
  and token reservations, KV blocks) settles it, in stage order.
Between the two, the upstream relay runs the answer through the output guard the guard stage may leave.

A stage joins the request by being added to the list gateway/app.py builds; no stage knows another. A stage that a
policy set can leave with nothing to do for any request (`Conditional`: the response cache where no policy turns it
on, the guard where no tenant's reads requests or refuses unknown content) is left out of the pipeline while that set
is in force, decided once per set, not per request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from opentelemetry.trace import Status, StatusCode, Tracer

from gateway.context import RequestContext
from gateway.errors import GatewayError
from gateway.observability.metric_tallies import HistogramTally
from gateway.observability.telemetry import Metrics

if TYPE_CHECKING:
    from gateway.policy.loader import PolicySet

log = logging.getLogger(__name__)


class Stage(Protocol):
    name: str

    def __call__(self, ctx: RequestContext) -> Awaitable[None]:
        """The stage's work for the request: a coroutine, its own or (a stage that hands the request on) another's."""
        ...


@runtime_checkable
class Settles(Protocol):
    """A stage that holds something for a request until its response ends. `settle` runs for every request that
    entered the pipeline, also one refused before this stage ran: it settles what the context shows it took.

    It never waits: what needs I/O (a shared store's settlement) is handed to a delivery of its own, so the settle
    phase is one uninterruptible step, which no client leaving or task cancelled can cut short."""

    name: str

    def settle(self, ctx: RequestContext) -> None: ...


@runtime_checkable
class Conditional(Protocol):
    """A stage that some policy sets leave with nothing to do for any request."""

    name: str

    def applies(self, policies: PolicySet) -> bool:
        """Whether any request may be this stage's under `policies` (asked once per policy set)."""
        ...


class Pipeline:
    def __init__(
        self,
        stages: Sequence[Stage],
        tracer: Tracer,
        metrics: Metrics,
        policies: Callable[[], PolicySet] | None = None,
    ) -> None:
        """`policies`: the policy set in force, for the `Conditional` stages (without it, every stage runs)."""
        self.stages = tuple(stages)
        self.settling: tuple[Settles, ...] = tuple(s for s in self.stages if isinstance(s, Settles))
        self._tracer = tracer
        stage_duration = metrics.tallies.histogram(metrics.stage_duration)
        self._timed = tuple((s, stage_duration(s.name)) for s in self.stages)
        self._policies = policies
        self._running: tuple[tuple[Stage, HistogramTally], ...] = self._timed  # under `_running_under`
        self._running_under: PolicySet | None = None

    async def run(self, ctx: RequestContext) -> None:
        """The request phase."""
        traced = ctx.span.is_recording()  # an unsampled request records nothing: skip the span bookkeeping
        if self._policies is not None and (policies := self._policies()) is not self._running_under:
            self._running = tuple(t for t in self._timed if not isinstance(t[0], Conditional) or t[0].applies(policies))
            self._running_under = policies
        for stage, duration in self._running:
            started = time.perf_counter()
            try:
                if traced:
                    await self._run_traced(stage, ctx)
                else:
                    await stage(ctx)
            finally:
                duration.observe(time.perf_counter() - started)
            if ctx.answered is not None:
                return

    def settle(self, ctx: RequestContext) -> None:
        """The settle phase, once the response has ended; one stage failing to settle spares the others."""
        for stage in self.settling:
            try:
                stage.settle(ctx)
            except Exception:
                log.exception("%s stage failed to settle request %s", stage.name, ctx.request_id)

    async def _run_traced(self, stage: Stage, ctx: RequestContext) -> None:
        with self._tracer.start_as_current_span(
            f"stage.{stage.name}", record_exception=False, set_status_on_exception=False
        ) as span:
            try:
                await stage(ctx)
            except GatewayError as err:
                span.set_status(Status(StatusCode.ERROR, err.message))
                span.set_attribute("portcullis.verdict", "reject")
                span.set_attribute("portcullis.reject.code", err.code or err.type)
                raise
