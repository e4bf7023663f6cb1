"""Keep deciding when the shared store is down: a circuit breaker, then fail open (local limits) or fail closed."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from gateway.errors import GatewayError
from gateway.observability.telemetry import Metrics
from gateway.ratelimit.checks import Backend, BackendError, BudgetCheck, Check, Settlement, SlotCheck
from gateway.ratelimit.gcra import Outcome
from gateway.ratelimit.memory import MemoryBackend

log = logging.getLogger(__name__)


class CircuitBreaker:
    """Open after `failures` errors in a row; while open, callers skip the store until `cooldown` has passed.
    `store`: what it guards, for the log."""

    def __init__(
        self,
        failures: int,
        cooldown: float,
        clock: Callable[[], float] = time.monotonic,
        store: str = "rate limit store",
    ) -> None:
        self.failures = failures
        self.store = store
        self.cooldown = cooldown
        self._clock = clock
        self._errors = 0
        self._opened_at: float | None = None

    @property
    def is_open(self) -> bool:
        return self._opened_at is not None and self._clock() - self._opened_at < self.cooldown

    def record(self, ok: bool) -> None:
        if ok:
            self._errors, self._opened_at = 0, None
            return
        self._errors += 1
        if self._errors >= self.failures:
            if self._opened_at is None:
                log.error("%s failing: circuit open for %.1fs", self.store, self.cooldown)
            self._opened_at = self._clock()


class FailoverBackend:
    """The shared backend when it answers; otherwise the local fallback (fail open) or a 503 (fail closed)."""

    def __init__(
        self, primary: Backend, fallback: Backend, fail_open: bool, breaker: CircuitBreaker, metrics: Metrics
    ) -> None:
        self.primary = primary
        self.fallback = fallback
        self.fail_open = fail_open
        self.breaker = breaker
        self._errors = metrics.ratelimit_backend_errors.labels(backend=primary.name)

    @property
    def local(self) -> MemoryBackend | None:
        """The backend itself when it is this process's memory (no shared store: nothing to fail over from), which
        the rate limiter then calls without a coroutine."""
        return self.primary if isinstance(self.primary, MemoryBackend) else None

    async def acquire(self, checks: list[Check]) -> tuple[list[Outcome], Backend]:
        """Outcomes and the backend that produced them (settle against the same one)."""
        if not self.breaker.is_open:
            try:
                outcomes = await self.primary.acquire(checks)
                self.breaker.record(True)
                return outcomes, self.primary
            except asyncio.CancelledError:  # its caller left (a client gone) while the store decided
                self._give_back(checks)  # what it may have granted would stay held until its period ends
                raise
            except BackendError as exc:
                self._errors.inc()
                self.breaker.record(False)
                log.warning(
                    "rate limit store error (%s): %s", "failing open" if self.fail_open else "failing closed", exc
                )
                if exc.maybe_applied:  # the store may have granted slots or budget this request never learned of
                    self._give_back(checks)
        if not self.fail_open:
            raise GatewayError(
                503,
                "rate limiting is unavailable; request refused (fail_closed)",
                type="server_error",
                code="rate_limiter_unavailable",
                headers={"retry-after": str(max(1, round(self.breaker.cooldown)))},
            )
        return await self.fallback.acquire(checks), self.fallback

    def _give_back(self, checks: list[Check]) -> None:
        """Release (once the store answers again) what a lost admission may have taken: slots, and budget
        reservations settled at no cost. Both apply once at most, so giving back what was never taken is harmless;
        refunding tokens that were never charged would grant extra, so those are left."""
        slots = tuple(check for check in checks if isinstance(check, SlotCheck))
        spend = tuple((check, 0) for check in checks if isinstance(check, BudgetCheck))
        if slots or spend:
            self.primary.settle(Settlement(releases=slots, spend=spend))
