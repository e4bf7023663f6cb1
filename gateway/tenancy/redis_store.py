"""Tenant-owned objects' records in Redis, shared by every gateway instance: one key per object
(`portcullis:object:<id>`), set only if absent and expiring with the record's TTL, so Redis bounds them itself."""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from typing import TypeVar

import orjson
from redis.exceptions import RedisError

from gateway.storage.redis_client import redis_client
from gateway.tenancy.records import Made, ObjectRecord, StoreUnavailable

KEY_PREFIX = "portcullis:object:"
_MGET_CHUNK = 1000  # ids per MGET: no one reply holds a whole long list's records

T = TypeVar("T")


class RedisObjectStore:
    name = "redis"

    def __init__(self, url: str, timeout: float) -> None:
        """`timeout` (`redis.timeout`) bounds each command: a stalled Redis fails the request that asked, with a 503,
        instead of holding it."""
        self._redis = redis_client(url, timeout)

    async def add(self, made: Sequence[Made], ttl: float) -> None:
        async with self._redis.pipeline(transaction=False) as pipe:
            for m in made:
                pipe.set(KEY_PREFIX + m.object_id, orjson.dumps(list(m.record)), nx=True, px=max(1, round(ttl * 1000)))
            await _answered(pipe.execute())

    async def find(self, object_ids: Sequence[str]) -> dict[str, ObjectRecord]:
        found: dict[str, ObjectRecord] = {}
        for start in range(0, len(object_ids), _MGET_CHUNK):
            chunk = object_ids[start : start + _MGET_CHUNK]
            values = await _answered(self._redis.mget([KEY_PREFIX + i for i in chunk]))
            for object_id, raw in zip(chunk, values):
                if raw is not None:
                    tenant, kind, created_at = orjson.loads(raw)
                    found[object_id] = ObjectRecord(tenant, kind, created_at)
        return found

    async def remove(self, object_id: str) -> None:
        await _answered(self._redis.delete(KEY_PREFIX + object_id))

    async def aclose(self) -> None:
        await self._redis.aclose()


async def _answered(call: Awaitable[T]) -> T:
    try:
        return await call
    except (RedisError, OSError, TimeoutError) as err:
        raise StoreUnavailable(f"redis: {type(err).__name__}: {err}") from err
