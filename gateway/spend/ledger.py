"""The spend ledger: each finished request's tokens and cost, gathered in memory and written to the store about
once a second, so billing costs the request path a dictionary update and the store a write per second per instance.

What a flush could not write (the store is down) is kept and written with the next one; a stopping gateway writes
what it holds. A process killed outright loses at most its last `flush_interval` of spend.

A failed flush may have been written all the same (a Redis that stalled past its timeout runs the flush when it
wakes): it is kept as it was, under its batch number, and sent again before anything newer, so a store that has it
already knows it and does not add it twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime

from gateway.spend.store import HOUR, NANOS, GroupBy, SpendKey, SpendStore, SpendTotals

log = logging.getLogger(__name__)

_PERIOD_FORMATS = {"hour": "%Y-%m-%dT%H:00Z", "day": "%Y-%m-%d", "month": "%Y-%m"}


class SpendLedger:
    def __init__(
        self,
        store: SpendStore,
        flush_interval: float,
        currency: Callable[[], str] = lambda: "USD",
        clock: Callable[[], float] = time.time,
    ) -> None:
        """`currency`: the price table's, as the policy now has it (reports name it)."""
        self.store = store
        self._currency = currency
        self._flush_interval = flush_interval
        self._clock = clock
        self._pending: dict[SpendKey, SpendTotals] = {}
        self._batch = 0  # the number of the last batch sent to the store
        self._unconfirmed: dict[SpendKey, SpendTotals] = {}  # batch `_batch`, which failed: it may have been added
        self._flushing = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None

    def record(
        self,
        key_id: str,
        tenant: str,
        model: str,
        prompt: int,
        cached: int,
        completion: int,
        cost_nanos: int,
        served: bool = True,
        cache_hit: bool = False,
    ) -> None:
        """Count one finished request (`cached` of its `prompt` tokens came from a prefix cache), as served or, where
        no upstream answered it, as refused; one the response cache answered as a cache hit, its tokens apart."""
        now = int(self._clock())
        key = SpendKey(now - now % HOUR, key_id, tenant, model)
        totals = self._pending.get(key)
        if totals is None:
            totals = self._pending[key] = SpendTotals()
        totals.cost_nanos += cost_nanos
        if cache_hit:
            totals.cache_hits += 1
            totals.cache_hit_tokens += prompt + completion
            return
        if served:
            totals.requests += 1
        else:
            totals.refused_requests += 1
        totals.prompt_tokens += prompt - cached
        totals.cached_tokens += cached
        totals.completion_tokens += completion

    def start(self) -> None:
        self._task = asyncio.create_task(self._flush_forever())

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.flush()
        if self._pending or self._unconfirmed:
            log.error(
                "spend ledger: %d rows could not be written before stopping",
                len(self._pending) + len(self._unconfirmed),
            )
        await self.store.aclose()

    async def flush(self) -> None:
        """Write what was gathered; on failure keep it, as the batch it was, for the next flush."""
        async with self._flushing:
            if self._unconfirmed and not await self._send(self._unconfirmed, self._batch):
                return  # what was gathered since waits behind it: merged into it, it would be added twice
            self._unconfirmed = {}
            rows, self._pending = self._pending, {}
            if rows:
                self._batch += 1
                if not await self._send(rows, self._batch):
                    self._unconfirmed = rows

    async def _send(self, rows: dict[SpendKey, SpendTotals], batch: int) -> bool:
        try:
            await self.store.add(list(rows.items()), batch)
        except Exception as exc:  # the store's errors vary (sqlite3, redis, OSError): keep the rows whatever
            log.warning("spend ledger: %s store unavailable (%s); kept for the next flush", self.store.name, exc)
            return False
        return True

    async def _flush_forever(self) -> None:
        while True:
            await asyncio.sleep(self._flush_interval)
            await self.flush()

    async def report(
        self,
        start: int,
        end: int,
        group_by: Sequence[GroupBy],
        tenant: str | None = None,
        key_id: str | None = None,
    ) -> list[dict]:
        """Totals over [start, end) (Unix seconds; hours are counted whole), one row per group."""
        await self.flush()
        groups: dict[tuple, SpendTotals] = {}
        for key, totals in await self.store.rows(start, end):
            if (tenant is not None and key.tenant != tenant) or (key_id is not None and key.key_id != key_id):
                continue
            group = tuple(_group_value(key, part) for part in group_by)
            groups.setdefault(group, SpendTotals()).add(totals)
        currency = self._currency()
        report = [
            {
                **{_FIELD_NAMES[part]: value for part, value in zip(group_by, group)},
                "requests": totals.requests,
                "refused_requests": totals.refused_requests,
                "prompt_tokens": totals.prompt_tokens,
                "cached_tokens": totals.cached_tokens,
                "completion_tokens": totals.completion_tokens,
                "cost": totals.cost_nanos / NANOS,
                "cost_nanos": totals.cost_nanos,
                "currency": currency,
                "cache_hits": totals.cache_hits,
                "cache_hit_tokens": totals.cache_hit_tokens,
            }
            for group, totals in groups.items()
        ]
        report.sort(key=lambda row: (row.get("period", ""), -row["cost_nanos"]))
        return report


_FIELD_NAMES = {
    "key": "key_id",
    "tenant": "tenant",
    "model": "model",
    "hour": "period",
    "day": "period",
    "month": "period",
}


def _group_value(key: SpendKey, part: GroupBy) -> str:
    if part == "key":
        return key.key_id
    if part == "tenant":
        return key.tenant
    if part == "model":
        return key.model
    return datetime.fromtimestamp(key.hour, UTC).strftime(_PERIOD_FORMATS[part])
