"""The key store's interface: one for the embedded SQLite file and for Redis, so one instance needs no service and
many instances share one store.

Every change bumps the store's version; an instance asks for the records changed since the version it has seen
(`changes`), a few times a second, so a revocation reaches every instance within a second without a full reload.
A store that lost changes (a Redis restarted or wiped) answers with another epoch, and the instance reloads it whole.
Records are never deleted: a revoked key keeps its id for the audit log and spend reports.
"""

from __future__ import annotations

from typing import Protocol

from gateway.config import GatewayConfig
from gateway.keystore.changes import Changes
from gateway.keystore.records import KeyRecord
from gateway.keystore.redis_store import RedisKeyStore
from gateway.keystore.sqlite_store import SqliteKeyStore


class KeyStoreBackend(Protocol):
    name: str

    async def put(self, record: KeyRecord) -> None:
        """Create or replace the record with this id, and bump the version."""

    async def get(self, key_id: str) -> KeyRecord | None: ...

    async def records(self, tenant: str | None = None) -> list[KeyRecord]:
        """Every record (of one tenant), revoked ones included, oldest first."""

    async def changes(self, since: int) -> Changes:
        """The current epoch and version, and the records changed after version `since` (all of them for 0)."""

    async def aclose(self) -> None: ...


def build_key_store(config: GatewayConfig) -> KeyStoreBackend:
    """The key store the config names: the SQLite file, or Redis at `redis.url`."""
    if config.store.backend == "redis":
        assert config.redis.url is not None  # the config refuses a redis store without a URL
        return RedisKeyStore(config.redis.url, config.redis.timeout)
    return SqliteKeyStore(config.store.sqlite_path)
