"""Where the gateway records which tenant made which upstream object: beside the keys and the spend ledger
(`store.backend`), the SQLite file for the instances of one host or Redis for a fleet, so every instance agrees.

A record is written once, when the object's id first comes back from the upstream, and never given to another tenant
while it lives: adding an id that is recorded already changes nothing. Records are bounded in time
(`tenant_objects.ttl` from their making) and removed when their object is deleted through the gateway.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from gateway.config import GatewayConfig
from gateway.tenancy.records import Made, ObjectRecord
from gateway.tenancy.redis_store import RedisObjectStore
from gateway.tenancy.sqlite_store import SqliteObjectStore


class ObjectStore(Protocol):
    name: str

    async def add(self, made: Sequence[Made], ttl: float) -> None:
        """Record these objects for `ttl` seconds, each unless its id is recorded already; raises StoreUnavailable."""

    async def find(self, object_ids: Sequence[str]) -> dict[str, ObjectRecord]:
        """The live records of those of these ids that have one; raises StoreUnavailable."""

    async def remove(self, object_id: str) -> None:
        """Forget an object (deleted upstream); raises StoreUnavailable."""

    async def aclose(self) -> None: ...


def build_object_store(config: GatewayConfig) -> ObjectStore:
    """The store `store.backend` names: the SQLite file, or Redis at `redis.url`."""
    if config.store.backend == "redis":
        assert config.redis.url is not None  # the config refuses a redis store without a URL
        return RedisObjectStore(config.redis.url, config.redis.timeout)
    return SqliteObjectStore(config.store.sqlite_path)
