"""Redis backend: limits shared exactly across gateway instances, many requests' decisions per round trip.

Admissions and settlements from concurrent requests are coalesced (gateway/ratelimit/coalesce.py) and sent as one
EVALSHA of `lua/batch.lua`, which decides each admission atomically (all of its limits or none) and applies
settlements in arrival order; the script is reloaded on NOSCRIPT after a Redis restart. It reads Redis's own clock,
so gateway clocks never disagree about a window. One connection carries every batch: the client does little more
per batch than pack a command and read its reply. Settlements go through an outbox (gateway/ratelimit/outbox.py)
that keeps them until Redis has them, so an outage cannot leave slots held and tokens charged.

A batch names keys of many limits, so it needs one Redis node (or a primary and its replicas): on Redis Cluster the
counters' hash tags (`portcullis:rl:{rule:digest}`) would let batches be split per slot.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hiredis import pack_command
from redis import exceptions as redis_errors
from redis.asyncio.connection import AbstractConnection, Connection

from gateway.ratelimit.checks import BackendError, BudgetCheck, Check, RateCheck, Settlement
from gateway.ratelimit.coalesce import Coalescer
from gateway.ratelimit.gcra import Outcome
from gateway.ratelimit.outbox import SettlementOutbox
from gateway.storage.redis_client import connection_options

_SCRIPT = (Path(__file__).parent / "lua" / "batch.lua").read_text()
_SHA = hashlib.sha1(_SCRIPT.encode()).hexdigest()
_US = 1_000_000

Operation = list[Check] | Settlement  # an admission's checks, or a settlement
Arg = str | int | float


class RedisBackend:
    name = "redis"

    def __init__(
        self,
        url: str,
        timeout: float,
        max_pending_settlements: int = 100_000,
        clock: Callable[[], int] | None = None,
    ) -> None:
        """`clock`: µs since the epoch to decide at instead of Redis's own clock, which every gateway shares; for
        tests that hold two backends to one clock (it must not run behind real time: keys expire at its instants)."""
        options = connection_options(url, timeout)
        connection_class: type[AbstractConnection] = options.pop("connection_class", Connection)
        # no per-read timeout: the whole round trip runs under `timeout` (see _send)
        self._connection = connection_class(**{**options, "socket_timeout": None})
        self._timeout = timeout
        self._clock = clock
        self._batches: Coalescer[Operation, list[Outcome] | None] = Coalescer(self._send, _unsent)
        self.settlements = SettlementOutbox(lambda s: self._batches.submit(s, can_wait=True), max_pending_settlements)
        self._maybe_ran = False  # the batch in flight was sent whole: a failure now leaves unknown whether it ran

    async def acquire(self, checks: list[Check]) -> list[Outcome]:
        outcomes = await self._batches.submit(checks)
        assert outcomes is not None  # an admission answers its outcomes; only settlements answer None
        return outcomes

    def settle(self, settlement: Settlement) -> None:
        """Handed to the outbox, not awaited: the response has ended, and the outbox delivers it whenever it can."""
        if settlement.adjustments or settlement.releases or settlement.spend:
            self.settlements.add(settlement)

    async def aclose(self) -> None:
        await self.settlements.aclose()
        await self._batches.aclose()
        await self._connection.disconnect()

    async def _send(self, operations: Sequence[Operation]) -> list[list[Outcome] | None]:
        keys, args = _encode(operations, None if self._clock is None else self._clock())
        self._maybe_ran = False
        try:
            async with asyncio.timeout(self._timeout):
                replies = await self._evalsha(keys, args)
            return _decode(operations, replies)
        except Exception as exc:  # down, stalled (TimeoutError), or not Redis: replies of a type nothing expects
            # a reply still on its way must not be read as the answer to the next batch
            await self._connection.disconnect(nowait=True)
            raise BackendError(f"redis: {type(exc).__name__}: {exc}", maybe_applied=self._maybe_ran) from exc

    async def _evalsha(self, keys: list[str], args: list[Arg]) -> list[int]:
        """Run the batch script; if Redis forgot it (restart, SCRIPT FLUSH), load it and run it again."""
        try:
            return await self._run_script(keys, args)
        except redis_errors.NoScriptError:
            await self._call("SCRIPT", "LOAD", _SCRIPT)
            return await self._run_script(keys, args)

    async def _run_script(self, keys: list[str], args: list[Arg]) -> list[int]:
        await self._connection.send_packed_command(
            _pack(("EVALSHA", _SHA, len(keys), *keys, *args)), check_health=False
        )
        self._maybe_ran = True
        try:
            replies: list[int] = await self._connection.read_response()
            return replies
        except redis_errors.NoScriptError:  # an answer: Redis ran nothing
            self._maybe_ran = False
            raise

    async def _call(self, *command: Arg) -> Any:
        await self._connection.send_packed_command(_pack(command), check_health=False)
        return await self._connection.read_response()


def _unsent(error: Exception) -> BackendError:
    """What an operation queued behind a failed batch fails with: it was never sent, so Redis applied none of it."""
    return BackendError(f"{error} (queued behind the batch that met it: not sent)")


def _pack(command: tuple[Arg, ...]) -> bytes:
    """RESP for one command, by hiredis: redis-py's own packer costs ~1 µs an argument, and a batch has hundreds."""
    packed: bytes = pack_command(command)  # type: ignore[arg-type]  # its stub declares a tuple of one element
    return packed


def _encode(operations: Sequence[Operation], now: int | None) -> tuple[list[str], list[Arg]]:
    """KEYS and ARGV for lua/batch.lua; `now` (µs since the epoch) overrides Redis's clock."""
    keys: list[str] = []
    args: list[Arg] = [] if now is None else ["T", now]
    for operation in operations:
        if isinstance(operation, Settlement):
            for rate, delta in operation.adjustments:
                keys.append(rate.key)
                args += ("J", rate.interval * _US, delta)
            for slot in operation.releases:
                keys.append(slot.key)
                args += ("Z", slot.member)
            for budget, cost in operation.spend:
                keys.append(budget.key)
                args += ("K", budget.member, cost)
            continue
        args += ("A", len(operation))
        for check in operation:
            keys.append(check.key)
            if isinstance(check, RateCheck):
                args += ("R", check.interval * _US, check.tolerance * _US, check.cost)
            elif isinstance(check, BudgetCheck):
                args += ("B", check.limit, check.cost, math.ceil(check.resets_at * 1000), check.member)
            else:
                args += ("S", check.limit, round(check.lease * 1000), check.member)
    return keys, args


def _decode(operations: Sequence[Operation], replies: list[int]) -> list[list[Outcome] | None]:
    """Four numbers per check of each admission; settlements answer nothing."""
    results: list[list[Outcome] | None] = []
    at = 0
    for operation in operations:
        if isinstance(operation, Settlement):
            results.append(None)
            continue
        outcomes = []
        for _ in operation:
            allowed, remaining, retry_after, reset = replies[at : at + 4]
            outcomes.append(Outcome(bool(allowed), remaining, retry_after / _US, reset / _US))
            at += 4
        results.append(outcomes)
    return results
