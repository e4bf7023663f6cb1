"""A bounded admission queue, fair across tenants by virtual token counters (VTC, "Fairness in Serving Large
Language Models", OSDI '24).

Each tenant's counter grows with the tokens it is served (input + 2 x output, reconciled with real usage). The
least-served backlogged tenant goes next, so a tenant flooding requests cannot starve a light one; a tenant that
returns from idle is lifted to the least backlogged counter, so idleness cannot be banked. Requests wait at most
their deadline; a full queue sheds the tenant holding more than its share (429) or, if none does, the newcomer (503).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.errors import GatewayError

OUTPUT_WEIGHT = 2.0


@dataclass(eq=False)
class Waiter:
    tenant: str
    cost: float
    take: Callable[[], bool]
    granted: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    enqueued: float = field(default_factory=time.monotonic)


class FairQueue:
    def __init__(self, max_queue: int) -> None:
        self.max_queue = max_queue
        self.counters: dict[str, float] = {}
        self._backlog: dict[str, deque[Waiter]] = {}

    def __len__(self) -> int:
        return sum(len(q) for q in self._backlog.values())

    def charge(self, tenant: str, prompt_tokens: int, output_tokens: int) -> None:
        self.counters[tenant] = self.counters.get(tenant, 0.0) + prompt_tokens + OUTPUT_WEIGHT * output_tokens

    async def admit(
        self, tenant: str, prompt_tokens: int, max_tokens: int, take: Callable[[], bool], timeout: float
    ) -> float:
        """Return once admitted (charging the tenant); the seconds spent waiting. Raises 429/503 when shed.

        `take()` checks for capacity and, if there is some, claims it in the same call: dispatch admits several
        waiters in one pass, so the claim cannot wait for the admitted request to run.
        """
        if not self._backlog and take():
            self.charge(tenant, prompt_tokens, max_tokens)
            return 0.0
        waiter = Waiter(tenant, prompt_tokens + OUTPUT_WEIGHT * max_tokens, take)
        self._enqueue(waiter)
        self.dispatch()
        try:
            await asyncio.wait_for(asyncio.shield(waiter.granted), timeout)
        except TimeoutError:
            self._discard(waiter)
            raise GatewayError(
                503,
                f"no capacity freed within the {timeout:g}s queue deadline",
                type="server_error",
                code="cluster_saturated",
                headers={"retry-after": str(max(1, round(timeout / 4)))},
            ) from None
        except asyncio.CancelledError:  # the client left while queued
            if not waiter.granted.done():
                self._discard(waiter)
            raise
        return time.monotonic() - waiter.enqueued

    def dispatch(self) -> None:
        """Admit queued requests, least-served tenant first, while the head request fits."""
        while self._backlog:
            tenant = min(self._backlog, key=lambda t: self.counters.get(t, 0.0))
            head = self._backlog[tenant][0]
            if not head.take():
                return
            self._backlog[tenant].popleft()
            if not self._backlog[tenant]:
                del self._backlog[tenant]
            self.counters[tenant] = self.counters.get(tenant, 0.0) + head.cost
            if not head.granted.done():
                head.granted.set_result(None)

    def _enqueue(self, waiter: Waiter) -> None:
        if len(self) >= self.max_queue:
            self._shed(waiter)
        if waiter.tenant not in self._backlog:
            floor = min((self.counters.get(t, 0.0) for t in self._backlog), default=None)
            if floor is not None:
                self.counters[waiter.tenant] = max(self.counters.get(waiter.tenant, 0.0), floor)
            self._backlog[waiter.tenant] = deque()
        self._backlog[waiter.tenant].append(waiter)

    def _shed(self, newcomer: Waiter) -> None:
        tenants = set(self._backlog) | {newcomer.tenant}
        share = self.max_queue / len(tenants)
        if len(self._backlog.get(newcomer.tenant, ())) >= share:
            raise GatewayError(
                429,
                f"tenant {newcomer.tenant!r} already holds its share of the admission queue",
                type="requests",
                code="tenant_queue_share_exceeded",
                headers={"retry-after": "1"},
            )
        # someone else is over their share: drop their newest waiter to make room
        hog = max(self._backlog, key=lambda t: len(self._backlog[t]))
        if len(self._backlog[hog]) > share:
            victim = self._backlog[hog].pop()
            if not self._backlog[hog]:
                del self._backlog[hog]
            victim.granted.set_exception(
                GatewayError(
                    429,
                    f"tenant {hog!r} exceeded its share of the admission queue",
                    type="requests",
                    code="tenant_queue_share_exceeded",
                    headers={"retry-after": "1"},
                )
            )
            return
        raise GatewayError(
            503, "admission queue full", type="server_error", code="cluster_saturated", headers={"retry-after": "1"}
        )

    def _discard(self, waiter: Waiter) -> None:
        queue = self._backlog.get(waiter.tenant)
        if queue and waiter in queue:
            queue.remove(waiter)
            if not queue:
                del self._backlog[waiter.tenant]
        self.dispatch()
