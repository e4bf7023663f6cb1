"""The spend ledger in Redis, shared by every instance: a hash per hour whose fields count one measure of one
(key, tenant, model), added to with HINCRBY, so concurrent instances add up exactly.

A flush that times out may still be applied: it was sent whole, and a stalled Redis runs it when it wakes. The
ledger then sends the same batch again, so each store remembers, under a writer id of its own, the last batch Redis
applied (`portcullis:spend-writer:<id>`), and the script adds a batch only if it is newer: once, however often it
is sent. The mark outlives an outage of up to WRITER_TTL.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

from gateway.spend.store import HOUR, SpendKey, SpendTotals
from gateway.storage.redis_client import redis_client

KEY_PREFIX = "portcullis:spend:"
RETENTION = 400 * 86400  # seconds an hour's row is kept: a year of monthly reports, and some
_SEP = "\x1f"
_MEASURES = (
    "requests",
    "refused_requests",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "cost_nanos",
    "cache_hits",
    "cache_hit_tokens",
)
WRITER_PREFIX = "portcullis:spend-writer:"  # apart from the hours, which share KEY_PREFIX alone
WRITER_TTL = 7 * 86400  # seconds a writer's last batch is remembered after its last flush

# KEYS: the writer's mark, then the hours' hashes. ARGV: the batch, the mark's TTL, each hash's expiry (Unix
# seconds), then (hash index, field, amount) per measure.
_ADD = """
if tonumber(redis.call('GET', KEYS[1]) or '0') >= tonumber(ARGV[1]) then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
local a = #KEYS + 2
while a <= #ARGV do
  redis.call('HINCRBY', KEYS[tonumber(ARGV[a]) + 1], ARGV[a + 1], ARGV[a + 2])
  a = a + 3
end
for i = 2, #KEYS do redis.call('EXPIREAT', KEYS[i], ARGV[i + 1]) end
return 1
"""


class RedisSpendStore:
    name = "redis"

    def __init__(self, url: str, timeout: float) -> None:
        """`timeout` (`redis.timeout`) bounds each command: a stalled Redis fails a flush (its rows are kept) or a
        report instead of hanging it."""
        self._redis = redis_client(url, timeout)
        self._add = self._redis.register_script(_ADD)  # EVALSHA, loaded again after a Redis restart
        self._writer = f"{WRITER_PREFIX}{secrets.token_hex(8)}"

    async def add(self, rows: Sequence[tuple[SpendKey, SpendTotals]], batch: int) -> None:
        """Added whole or not at all, and once per `batch` (see the module docstring)."""
        hours: dict[int, int] = {}  # hour → its hash's index in KEYS
        amounts: list[str | int] = []
        for key, totals in rows:
            who = _SEP.join((key.key_id, key.tenant, key.model))
            index = hours.setdefault(key.hour, len(hours) + 1)
            for measure in _MEASURES:
                amount = getattr(totals, measure)
                if amount:
                    amounts += (index, f"{who}{_SEP}{measure}", amount)
        keys = [self._writer, *(f"{KEY_PREFIX}{hour}" for hour in hours)]
        await self._add(keys=keys, args=[batch, WRITER_TTL, *(hour + RETENTION for hour in hours), *amounts])

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
