"""Tenant-owned objects' records in the embedded SQLite file (the key store's file by default), shared by the
gateway processes of one host. Each add also deletes a bounded number of expired records, so the table holds about
what lived within the TTL, without a sweeper of its own."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from gateway.storage import sqlite_wal
from gateway.tenancy.records import Made, ObjectRecord, StoreUnavailable

_SCHEMA = """
CREATE TABLE IF NOT EXISTS tenant_objects (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, kind TEXT NOT NULL, created_at REAL NOT NULL, expires_at REAL NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS tenant_objects_expiry ON tenant_objects (expires_at);
"""
# an id recorded already keeps its record, unless that one has expired
_ADD = """
INSERT INTO tenant_objects VALUES (?, ?, ?, ?, ?)
ON CONFLICT (id) DO UPDATE SET
    tenant = excluded.tenant, kind = excluded.kind, created_at = excluded.created_at, expires_at = excluded.expires_at
WHERE tenant_objects.expires_at <= excluded.created_at
"""
_PRUNE = "DELETE FROM tenant_objects WHERE id IN (SELECT id FROM tenant_objects WHERE expires_at <= ? LIMIT ?)"
PRUNE_BATCH = 256  # expired records deleted per add: more than one add makes, so the table cannot outgrow the TTL
_FIND_CHUNK = 500  # ids per SELECT: below SQLite's limit on bound parameters

T = TypeVar("T")


class SqliteObjectStore:
    name = "sqlite"

    def __init__(self, path: Path) -> None:
        # one connection, used by one worker thread at a time (the lock), never by the event loop
        self._file = sqlite_wal.WalFile(path, 5.0, _prepare, check_same_thread=False)
        self._file.connection()  # opened now: a file that cannot hold the table stops the start
        self._lock = asyncio.Lock()

    async def add(self, made: Sequence[Made], ttl: float) -> None:
        rows = [(m.object_id, *m.record, m.record.created_at + ttl) for m in made]
        await self._run(self._add, rows)

    async def find(self, object_ids: Sequence[str]) -> dict[str, ObjectRecord]:
        return await self._run(self._find, list(object_ids))

    async def remove(self, object_id: str) -> None:
        await self._run(self._remove, object_id)

    async def aclose(self) -> None:
        async with self._lock:
            self._file.close()

    async def _run(self, call: Callable[..., T], *args: object) -> T:
        try:
            async with self._lock:
                return await asyncio.to_thread(call, *args)
        except sqlite3.Error as err:
            raise StoreUnavailable(f"sqlite {self._file.path}: {err}") from err

    # Below: on a worker thread, under the lock.

    def _add(self, rows: list[tuple[str, str, str, float, float]]) -> None:
        db = self._file.connection()
        with db:  # one transaction
            db.execute("BEGIN IMMEDIATE")
            db.executemany(_ADD, rows)
            db.execute(_PRUNE, (time.time(), PRUNE_BATCH))

    def _find(self, object_ids: list[str]) -> dict[str, ObjectRecord]:
        db, now, found = self._file.connection(), time.time(), {}
        for start in range(0, len(object_ids), _FIND_CHUNK):
            chunk = object_ids[start : start + _FIND_CHUNK]
            query = (
                "SELECT id, tenant, kind, created_at FROM tenant_objects "
                f"WHERE expires_at > ? AND id IN ({', '.join('?' * len(chunk))})"
            )
            for object_id, tenant, kind, created_at in db.execute(query, (now, *chunk)):
                found[object_id] = ObjectRecord(tenant, kind, created_at)
        return found

    def _remove(self, object_id: str) -> None:
        db = self._file.connection()
        with db:
            db.execute("DELETE FROM tenant_objects WHERE id = ?", (object_id,))


def _prepare(db: sqlite3.Connection) -> None:
    db.executescript(f"BEGIN IMMEDIATE; {_SCHEMA} COMMIT;")
