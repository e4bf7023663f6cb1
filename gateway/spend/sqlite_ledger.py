"""The spend ledger in the embedded SQLite file (the key store's file by default): one row per hour, key, tenant and
model, added to by upsert, so several processes of one host can share it."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path

from gateway.spend.store import SpendKey, SpendTotals
from gateway.storage import sqlite_wal

_SCHEMA = """
CREATE TABLE IF NOT EXISTS spend (
    hour INTEGER NOT NULL, key_id TEXT NOT NULL, tenant TEXT NOT NULL, model TEXT NOT NULL,
    requests INTEGER NOT NULL, prompt_tokens INTEGER NOT NULL, cached_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL, cost_nanos INTEGER NOT NULL, refused_requests INTEGER NOT NULL DEFAULT 0,
    cache_hits INTEGER NOT NULL DEFAULT 0, cache_hit_tokens INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (hour, key_id, tenant, model)
) WITHOUT ROWID
"""
# a file made before a measure was counted: its column is added, its past rows at 0
_LATER_COLUMNS = ("refused_requests", "cache_hits", "cache_hit_tokens")
_COLUMNS = ", ".join((*SpendKey._fields, *(measure.name for measure in fields(SpendTotals))))  # as the row reads
_ADD = f"""
INSERT INTO spend ({_COLUMNS}) VALUES ({", ".join("?" * (len(SpendKey._fields) + len(fields(SpendTotals))))})
ON CONFLICT (hour, key_id, tenant, model) DO UPDATE SET
    requests = requests + excluded.requests, prompt_tokens = prompt_tokens + excluded.prompt_tokens,
    cached_tokens = cached_tokens + excluded.cached_tokens,
    completion_tokens = completion_tokens + excluded.completion_tokens, cost_nanos = cost_nanos + excluded.cost_nanos,
    refused_requests = refused_requests + excluded.refused_requests,
    cache_hits = cache_hits + excluded.cache_hits, cache_hit_tokens = cache_hit_tokens + excluded.cache_hit_tokens
"""


def prepare(db: sqlite3.Connection) -> None:
    """The spend table, made or brought up to date; in one transaction, so processes opening the file together
    do not both add a column."""
    with db:
        db.execute("BEGIN IMMEDIATE")
        db.execute(_SCHEMA)
        present = {row[1] for row in db.execute("PRAGMA table_info(spend)")}
        for column in _LATER_COLUMNS:
            if column not in present:
                db.execute(f"ALTER TABLE spend ADD COLUMN {column} INTEGER NOT NULL DEFAULT 0")


class SqliteSpendStore:
    name = "sqlite"

    def __init__(self, path: Path) -> None:
        # one connection, used by one worker thread at a time (the lock), never by the event loop; opened now, so a
        # path that cannot hold the ledger stops the start
        self._file = sqlite_wal.WalFile(path, 5.0, prepare, check_same_thread=False)
        self._file.connection()
        self._lock = asyncio.Lock()

    async def add(self, rows: Sequence[tuple[SpendKey, SpendTotals]], batch: int) -> None:
        """`batch` is not needed here: a transaction that raised was not committed."""
        values = [
            (k.hour, k.key_id, k.tenant, k.model, t.requests, t.prompt_tokens, t.cached_tokens,
             t.completion_tokens, t.cost_nanos, t.refused_requests, t.cache_hits, t.cache_hit_tokens)
            for k, t in rows
        ]  # fmt: skip
        async with self._lock:
            await asyncio.to_thread(self._add, values)

    def _add(self, values: list[tuple]) -> None:
        db = self._file.connection()
        with db:  # one transaction: a flush is added whole or not at all
            db.execute("BEGIN IMMEDIATE")
            db.executemany(_ADD, values)

    async def rows(self, start: int, end: int) -> list[tuple[SpendKey, SpendTotals]]:
        async with self._lock:
            found = await asyncio.to_thread(self._select, start, end)
        return [(SpendKey(*row[:4]), SpendTotals(*row[4:])) for row in found]

    def _select(self, start: int, end: int) -> list[tuple]:
        return (
            self._file.connection()
            .execute(f"SELECT {_COLUMNS} FROM spend WHERE hour >= ? AND hour < ?", (start, end))
            .fetchall()
        )

    async def aclose(self) -> None:
        async with self._lock:
            self._file.close()
