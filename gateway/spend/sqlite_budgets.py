"""Budgets in the embedded SQLite file, where there is no Redis: every process that opens the file (the workers of
one gateway, or several gateways on one host) reserves on the same counters, so what they admit never sums past the
limit.

The file holds a row per budget period (`budget`: nanos spent in it, the reservations still held included, and when
it ends) and a row per reservation held (`budget_held`). A check and a settlement do what Redis's batch script does
for budgets (gateway/ratelimit/lua/batch.lua), so the two stores decide alike: a reservation is allowed while spent +
cost <= limit, all of one admission's or none; a settlement replaces a held reservation by its final cost, once (a
repeated one finds nothing held). The rate limiter reserves on slices of a budget (gateway/spend/leases.py), so far
from the limit a transaction covers many requests; near it, one each.

Operations from concurrent requests are coalesced (gateway/ratelimit/coalesce.py) and each batch is one transaction
that takes the file's write lock first (`BEGIN IMMEDIATE`): two processes never decide on the same spend, the later
waits (up to BUSY_TIMEOUT) for the earlier to commit. The transactions run on this store's one worker thread, never
on the event loop. Settlements go through an outbox (gateway/ratelimit/outbox.py) that keeps them while the file
cannot be written (locked past the timeout, a full disk). Commits are `synchronous = NORMAL`: a process that dies
loses nothing it committed; a power cut may lose the last commits before a checkpoint, which holds back (a
reservation kept) or hands out (one lost) at most what those last transactions moved.

A budget period's row is opened at what the spend ledger, in the same file, has for its payer since the period
began (`expect`), so a gateway that starts on a file whose budgets an older version kept in its process does not
hand the period's budget out again. Rows of ended periods are deleted when a new period opens.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from gateway.ratelimit.checks import BackendError, BudgetCheck, Check, Settlement
from gateway.ratelimit.coalesce import Coalescer
from gateway.ratelimit.gcra import Outcome
from gateway.ratelimit.outbox import SettlementOutbox
from gateway.spend import sqlite_ledger
from gateway.storage import sqlite_wal

if TYPE_CHECKING:
    from gateway.spend.budgets import AppliedBudget

BUSY_TIMEOUT = 5.0  # seconds a transaction waits for another process's to commit (the spend ledger's, too)
_MAX_PAYERS = 65536
_SCHEMA = """
CREATE TABLE IF NOT EXISTS budget (key TEXT PRIMARY KEY, used INTEGER NOT NULL, ends REAL NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS budget_held (
    key TEXT NOT NULL, member TEXT NOT NULL, cost INTEGER NOT NULL, PRIMARY KEY (key, member)
) WITHOUT ROWID;
"""
# a period's row, opened at its payer's spend in the ledger since the period began (a row already there is kept)
_OPEN = {
    scope: f"""
INSERT OR IGNORE INTO budget (key, used, ends)
SELECT ?, COALESCE(SUM(cost_nanos), 0), ? FROM spend WHERE hour >= ? AND {column} = ?
"""
    for scope, column in (("tenant", "tenant"), ("api_key", "key_id"))
}


Operation = list[Check] | Settlement  # an admission's budget checks, or a settlement
Payer = tuple[str, str, int]  # whose spend a budget period bounds: scope ("tenant" | "api_key"), who, period start


class SqliteBudgets:
    name = "sqlite"

    def __init__(self, path: Path, max_pending_settlements: int = 100_000) -> None:
        """Opens the file now: a path that cannot hold it stops the start."""
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="budgets-sqlite")
        self._file = sqlite_wal.WalFile(path, BUSY_TIMEOUT, _prepare)
        self._worker.submit(self._file.connection).result()
        self._payers: dict[str, Payer] = {}  # period key → whose spend it bounds, until its row is opened
        self._batches: Coalescer[Operation, list[Outcome] | None] = Coalescer(self._send, _unsent)
        self.settlements = SettlementOutbox(lambda s: self._batches.submit(s, can_wait=True), max_pending_settlements)

    def expect(self, key: str, budget: AppliedBudget) -> None:
        """The budget's period `key` (its current one), which this process is about to reserve on: if the file has
        no row for it yet, the row is opened at its payer's spend in the ledger, in the transaction of its first
        reservation."""
        if key not in self._payers:
            if len(self._payers) >= _MAX_PAYERS:  # periods asked for and never reserved on (their requests left)
                self._payers.clear()
            self._payers[key] = budget.scope, budget.who, int(budget.counter.start)

    async def acquire(self, checks: list[Check]) -> list[Outcome]:
        outcomes = await self._batches.submit(checks)
        assert outcomes is not None  # an admission answers its outcomes; only settlements answer None
        return outcomes

    def settle(self, settlement: Settlement) -> None:
        """Handed to the outbox, not awaited: the response has ended, and the outbox delivers it whenever it can."""
        if settlement.spend:
            self.settlements.add(settlement)

    async def aclose(self) -> None:
        await self.settlements.aclose()
        await self._batches.aclose()
        await asyncio.get_running_loop().run_in_executor(self._worker, self._file.close)
        self._worker.shutdown()

    async def _send(self, operations: Sequence[Operation]) -> list[list[Outcome] | None]:
        try:
            results, read = await asyncio.get_running_loop().run_in_executor(
                self._worker, self._transaction, operations, dict(self._payers), time.time()
            )
        except sqlite3.Error as exc:  # rolled back: nothing of the batch was applied
            raise BackendError(f"sqlite: {type(exc).__name__}: {exc}") from exc
        for key in read:  # these periods have their rows now
            self._payers.pop(key, None)
        return results

    def _transaction(
        self, operations: Sequence[Operation], payers: dict[str, Payer], now: float
    ) -> tuple[list[list[Outcome] | None], dict[str, int | None]]:
        """One batch, committed whole or rolled back: each admission's outcomes (settlements answer None), and the
        spend of each period it read."""
        db = self._file.connection()
        spent: dict[str, int | None] = {}  # period key → its row's spend as this batch leaves it (None: no row)
        results: list[list[Outcome] | None] = []
        with db:
            db.execute("BEGIN IMMEDIATE")
            for operation in operations:
                if isinstance(operation, Settlement):
                    for check, cost in operation.spend:
                        _settle(db, check, cost, spent)
                    results.append(None)
                else:
                    results.append(_admit(db, operation, payers, spent, now))
        return results, spent


def _prepare(db: sqlite3.Connection) -> None:
    db.execute("PRAGMA synchronous = NORMAL")
    sqlite_ledger.prepare(db)  # the ledger's table, which a period's row is opened from
    db.executescript(_SCHEMA)


def _spent(
    db: sqlite3.Connection,
    check: BudgetCheck,
    payers: dict[str, Payer],
    spent: dict[str, int | None],
    now: float,
) -> int:
    """What the check's period has spent, its row opened first (from the ledger) if it has none and its payer is
    known."""
    key = check.key
    if key not in spent:
        row = db.execute("SELECT used FROM budget WHERE key = ?", (key,)).fetchone()
        if row is None and (payer := payers.get(key)) is not None:
            db.execute("DELETE FROM budget_held WHERE key IN (SELECT key FROM budget WHERE ends <= ?)", (now,))
            db.execute("DELETE FROM budget WHERE ends <= ?", (now,))
            scope, who, start = payer
            db.execute(_OPEN[scope], (key, check.resets_at, start, who))
            row = db.execute("SELECT used FROM budget WHERE key = ?", (key,)).fetchone()
        spent[key] = None if row is None else row[0]
    return spent[key] or 0


def _admit(
    db: sqlite3.Connection,
    checks: Sequence[Check],
    payers: dict[str, Payer],
    spent: dict[str, int | None],
    now: float,
) -> list[Outcome]:
    """Each check's outcome; the reservations are made only if every check allows."""
    outcomes = []
    for check in checks:
        assert isinstance(check, BudgetCheck)  # rate limits and slots are kept in Redis or in memory, never here
        used = _spent(db, check, payers, spent, now)
        reset = max(check.resets_at - now, 0.0)
        left = check.limit - used
        allowed = check.cost <= left
        outcomes.append(
            Outcome(True, left - check.cost, 0.0, reset) if allowed else Outcome(False, max(left, 0), reset, reset)
        )
    if all(outcome.allowed for outcome in outcomes):
        for check in checks:
            assert isinstance(check, BudgetCheck)
            db.execute(
                "INSERT INTO budget (key, used, ends) VALUES (?, ?, ?) ON CONFLICT (key) DO UPDATE SET used = used + ?",
                (check.key, check.cost, check.resets_at, check.cost),
            )
            db.execute(
                "INSERT OR REPLACE INTO budget_held (key, member, cost) VALUES (?, ?, ?)",
                (check.key, check.member, check.cost),
            )
            spent[check.key] = (spent[check.key] or 0) + check.cost
    return outcomes


def _settle(db: sqlite3.Connection, check: BudgetCheck, cost: int, spent: dict[str, int | None]) -> None:
    """The reservation `check.member` holds is replaced by `cost`, once."""
    held = db.execute(
        "DELETE FROM budget_held WHERE key = ? AND member = ? RETURNING cost", (check.key, check.member)
    ).fetchone()
    if held is not None and cost != held[0]:
        db.execute("UPDATE budget SET used = used + ? WHERE key = ?", (cost - held[0], check.key))
        if spent.get(check.key) is not None:
            spent[check.key] = spent[check.key] + cost - held[0]  # type: ignore[operator]


def _unsent(error: Exception) -> BackendError:
    """What an operation queued behind a failed batch fails with: never sent, so none of it was applied."""
    return BackendError(f"{error} (queued behind the batch that met it: not sent)")
