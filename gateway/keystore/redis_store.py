"""The key store in Redis, shared by every gateway instance.

Records are JSON in one hash (`portcullis:keys`, by id); a counter holds the store's version, and a sorted set maps
each id to the version of its last change, so `changes(since)` is a ZRANGEBYSCORE and an HMGET. A put bumps the
counter, writes the record and scores it in one Lua script, so no reader sees one without the others.

The counter goes back when Redis loses data, and may climb past a reader's version before that reader looks again,
so the epoch that tells a reader its version means nothing here any more is made of two parts: the server's
`run_id` (new at each start, whatever snapshot it loaded) and a random token the first put after a wipe stores
beside the counter (`FLUSHALL` or eviction leave the server running).

The keys share no hash tag: the store needs one Redis node (or a primary and its replicas), as the rate limits
do.
"""

from __future__ import annotations

import secrets

from gateway.keystore.changes import Changes
from gateway.keystore.records import KeyRecord
from gateway.storage.redis_client import redis_client

RECORDS = "portcullis:keys"
VERSION = "portcullis:keys:version"
CHANGED = "portcullis:keys:changed"
EPOCH = "portcullis:keys:epoch"
HMGET_CHUNK = 1000  # ids per HMGET on a full load: no one reply holds every record

_PUT = """
local version = redis.call('INCR', KEYS[2])
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[3], version, ARGV[1])
redis.call('SET', KEYS[4], ARGV[3], 'NX')
return version
"""


class RedisKeyStore:
    name = "redis"

    def __init__(self, url: str, timeout: float) -> None:
        """`timeout` (`redis.timeout`) bounds each command, so a stalled Redis fails a poll or an admin call instead
        of hanging it."""
        self._redis = redis_client(url, timeout)
        self._put = self._redis.register_script(_PUT)  # EVALSHA, loaded again after a Redis restart

    async def put(self, record: KeyRecord) -> None:
        await self._put(
            keys=[RECORDS, VERSION, CHANGED, EPOCH], args=[record.id, record.model_dump_json(), secrets.token_hex(8)]
        )

    async def get(self, key_id: str) -> KeyRecord | None:
        raw = await self._redis.hget(RECORDS, key_id)
        return KeyRecord.model_validate_json(raw) if raw is not None else None

    async def records(self, tenant: str | None = None) -> list[KeyRecord]:
        found = [KeyRecord.model_validate_json(raw) for raw in await self._redis.hvals(RECORDS)]
        return sorted((r for r in found if tenant is None or r.tenant == tenant), key=lambda r: (r.created_at, r.id))

    async def changes(self, since: int) -> Changes:
        async with self._redis.pipeline(transaction=True) as pipe:  # the epoch, the version and its ids, at once
            pipe.info("server")
            pipe.get(EPOCH)
            pipe.get(VERSION)
            pipe.zrangebyscore(CHANGED, f"({since}", "+inf")
            server, token, raw_version, ids = await pipe.execute()
        records: list[KeyRecord] = []
        for start in range(0, len(ids), HMGET_CHUNK):
            # a record changed since the snapshot reads newer than `version`: harmless, its change comes again
            chunk = await self._redis.hmget(RECORDS, ids[start : start + HMGET_CHUNK])
            records.extend(KeyRecord.model_validate_json(raw) for raw in chunk if raw is not None)
        epoch = f"{server.get('run_id', '')}/{token.decode() if token else ''}"  # a server may not report run_id
        return Changes(epoch, int(raw_version or 0), records)

    async def aclose(self) -> None:
        await self._redis.aclose()
