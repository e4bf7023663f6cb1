"""The spend ledger in Redis, shared by every instance: a hash per hour whose fields count one measure of one
(key, tenant, model), added to with HINCRBY, so concurrent instances add up exactly."""

from __future__ import annotations

from collections.abc import Sequence

from gateway.redis_client import redis_client
from gateway.spend.store import HOUR, SpendKey, SpendTotals

KEY_PREFIX = "portcullis:spend:"
RETENTION = 400 * 86400  # seconds an hour's row is kept: a year of monthly reports, and some
_SEP = "\x1f"
_MEASURES = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "cost_nanos")


class RedisSpendStore:
    name = "redis"

    def __init__(self, url: str, timeout: float) -> None:
        """`timeout` (`redis.timeout`) bounds each command: a stalled Redis fails a flush (its rows are kept) or a
        report instead of hanging it."""
        self._redis = redis_client(url, timeout)

    async def add(self, rows: Sequence[tuple[SpendKey, SpendTotals]]) -> None:
        pipe = self._redis.pipeline(transaction=True)  # a flush is added whole or not at all
        hours = set()
        for key, totals in rows:
            who = _SEP.join((key.key_id, key.tenant, key.model))
            for measure in _MEASURES:
                amount = getattr(totals, measure)
                if amount:
                    pipe.hincrby(f"{KEY_PREFIX}{key.hour}", f"{who}{_SEP}{measure}", amount)
            hours.add(key.hour)
        for hour in hours:
            pipe.expireat(f"{KEY_PREFIX}{hour}", hour + RETENTION)
        await pipe.execute()

    async def rows(self, start: int, end: int) -> list[tuple[SpendKey, SpendTotals]]:
        hours = range(start - start % HOUR, end, HOUR)
        pipe = self._redis.pipeline(transaction=False)
        for hour in hours:
            pipe.hgetall(f"{KEY_PREFIX}{hour}")
        found: dict[SpendKey, SpendTotals] = {}
        for hour, fields in zip(hours, await pipe.execute()):
            if hour < start:
                continue
            for field, value in fields.items():
                key_id, tenant, model, measure = field.decode().split(_SEP)
                totals = found.setdefault(SpendKey(hour, key_id, tenant, model), SpendTotals())
                setattr(totals, measure, int(value))
        return list(found.items())

    async def aclose(self) -> None:
        await self._redis.aclose()
