"""The key store in one SQLite file: no service to run, shared by the gateway processes of one host.

WAL lets readers (every instance polls a few times a second) run beside a writer; a busy timeout makes a writer wait
for another process's transaction instead of failing. Each record is stored as its JSON with the store version of its
last change in an indexed column, so `changes(since)` is one range scan. The version lives in a meta row that every
put bumps in the same write transaction as the record, so readers never see one without the other. Another meta row
holds a random epoch drawn when the file is made: a file made anew where the old one was (the store follows its path)
counts its versions again from 1.

sqlite3 blocks, so every call runs on this store's one worker thread, which owns the connection.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from gateway.keystore.changes import Changes
from gateway.keystore.records import KeyRecord
from gateway.storage import sqlite_wal

BUSY_TIMEOUT_MS = 5000  # sqlite3.connect's timeout: the connection's busy_timeout
_VERSION = "api_keys.version"  # the meta rows' names
_EPOCH = "api_keys.epoch"
_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS api_keys (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    created_at REAL NOT NULL,
    version INTEGER NOT NULL,
    record TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS api_keys_version ON api_keys (version);
CREATE INDEX IF NOT EXISTS api_keys_tenant ON api_keys (tenant, created_at);
CREATE TABLE IF NOT EXISTS store_meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
INSERT OR IGNORE INTO store_meta (name, value) VALUES ('{_VERSION}', 0);
INSERT OR IGNORE INTO store_meta (name, value) VALUES ('{_EPOCH}', random());
"""

T = TypeVar("T")


class SqliteKeyStore:
    name = "sqlite"

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="keystore-sqlite")
        self._file = sqlite_wal.WalFile(self.path, BUSY_TIMEOUT_MS / 1000, _prepare)  # opened by the first call

    async def put(self, record: KeyRecord) -> None:
        await self._run(self._put, record)

    async def get(self, key_id: str) -> KeyRecord | None:
        rows = await self._run(self._select, "SELECT record FROM api_keys WHERE id = ?", (key_id,))
        return KeyRecord.model_validate_json(rows[0][0]) if rows else None

    async def records(self, tenant: str | None = None) -> list[KeyRecord]:
        if tenant is None:
            rows = await self._run(self._select, "SELECT record FROM api_keys ORDER BY created_at, id", ())
        else:
            query = "SELECT record FROM api_keys WHERE tenant = ? ORDER BY created_at, id"
            rows = await self._run(self._select, query, (tenant,))
        return [KeyRecord.model_validate_json(row[0]) for row in rows]

    async def changes(self, since: int) -> Changes:
        epoch, version, rows = await self._run(self._changes, since)
        return Changes(str(epoch), version, [KeyRecord.model_validate_json(row) for row in rows])

    async def aclose(self) -> None:
        await self._run(self._close)
        self._worker.shutdown()

    async def _run(self, call: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._worker, call, *args)

    # Below: on the worker thread only.

    def _connection(self) -> sqlite3.Connection:
        try:
            return self._file.connection()
        except sqlite3.Error as err:  # a missing directory, a file that is not a database: say which file
            raise sqlite3.OperationalError(f"key store {self.path}: {err}") from err

    def _put(self, record: KeyRecord) -> None:
        db = self._connection()
        db.execute("BEGIN IMMEDIATE")  # take the write lock first: no other process can bump the version meanwhile
        try:
            (version,) = db.execute(
                "UPDATE store_meta SET value = value + 1 WHERE name = ? RETURNING value", (_VERSION,)
            ).fetchone()
            db.execute(
                "INSERT OR REPLACE INTO api_keys (id, tenant, created_at, version, record) VALUES (?, ?, ?, ?, ?)",
                (record.id, record.tenant, record.created_at, version, record.model_dump_json()),
            )
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise

    def _select(self, query: str, params: tuple) -> list[tuple]:
        return self._connection().execute(query, params).fetchall()

    def _changes(self, since: int) -> tuple[int, int, list[str]]:
        db = self._connection()
        db.execute("BEGIN")  # one read snapshot: the epoch, the version and the rows it counts
        try:
            meta = dict(db.execute("SELECT name, value FROM store_meta WHERE name IN (?, ?)", (_EPOCH, _VERSION)))
            version = meta[_VERSION]
            rows = (
                db.execute("SELECT record FROM api_keys WHERE version > ? ORDER BY version", (since,)).fetchall()
                if version != since
                else []
            )
        finally:
            db.execute("COMMIT")
        return meta[_EPOCH], version, [row[0] for row in rows]

    def _close(self) -> None:
        self._file.close()


def _prepare(db: sqlite3.Connection) -> None:
    db.execute("PRAGMA synchronous = NORMAL")  # WAL's recommended setting: durable at each checkpoint
    db.executescript(f"BEGIN IMMEDIATE; {_SCHEMA} COMMIT;")
