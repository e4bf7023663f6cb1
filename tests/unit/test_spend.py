"""The spend ledger (over real SQLite files), exact amounts, and budget periods."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from datetime import UTC, datetime

import pytest

from gateway.policy.model import Budget
from gateway.spend.budgets import period
from gateway.spend.ledger import SpendLedger
from gateway.spend.redis_ledger import RedisSpendStore
from gateway.spend.sqlite_ledger import SqliteSpendStore
from gateway.spend.store import amount_text

DEC_3 = datetime(2026, 12, 3, 19, 30, tzinfo=UTC).timestamp()


def test_amounts_are_exact_decimal_text():
    assert amount_text(16_000) == "0.000016"
    assert amount_text(3_420_000_000) == "3.42"
    assert amount_text(7) == "0.000000007"
    assert amount_text(-1_500_000_000) == "-1.5"
    assert amount_text(0) == "0"


@pytest.mark.parametrize(
    ("period_name", "start", "end"),
    [
        ("day", datetime(2026, 12, 3, tzinfo=UTC), datetime(2026, 12, 4, tzinfo=UTC)),
        ("month", datetime(2026, 12, 1, tzinfo=UTC), datetime(2027, 1, 1, tzinfo=UTC)),
        ("12h", datetime(2026, 12, 3, 12, tzinfo=UTC), datetime(2026, 12, 4, tzinfo=UTC)),
    ],
)
def test_budget_periods(period_name, start, end):
    assert period(Budget(limit=1, period=period_name), DEC_3) == (start.timestamp(), end.timestamp())


def test_a_february_period_is_the_calendar_month():
    start, end = period(Budget(limit=1, period="month"), datetime(2028, 2, 29, 23, tzinfo=UTC).timestamp())
    assert end - start == 29 * 86400


def test_sub_hour_windows_are_refused_by_the_policy_model():
    with pytest.raises(ValueError):
        Budget(limit=1, period="30m")


def test_the_ledger_adds_up_across_instances_and_reports_by_group(tmp_path):
    async def run() -> None:
        clock = [DEC_3]
        one = SpendLedger(SqliteSpendStore(tmp_path / "l.db"), 60, clock=lambda: clock[0])
        two = SpendLedger(SqliteSpendStore(tmp_path / "l.db"), 60, clock=lambda: clock[0])
        one.record("k1", "acme", "m", 10, 4, 5, 1_000)
        two.record("k1", "acme", "m", 10, 0, 5, 2_000)
        two.record("k2", "beta", "m", 3, 0, 1, 7)
        one.record("k1", "acme", "m", 10, 0, 5, 0, served=False, cache_hit=True)  # the response cache answered it
        clock[0] += 86400  # the next day
        one.record("k1", "acme", "m", 1, 0, 1, 5)
        await one.flush()
        await two.flush()
        by_day = await one.report(int(DEC_3) - 86400, int(DEC_3) + 2 * 86400, ["tenant", "day"])
        assert [(r["tenant"], r["period"], r["cost_nanos"]) for r in by_day] == [
            ("acme", "2026-12-03", 3_000),
            ("beta", "2026-12-03", 7),
            ("acme", "2026-12-04", 5),
        ]
        acme = await two.report(0, int(clock[0]) + 3600, ["key"], tenant="acme")
        assert acme == [
            {
                "key_id": "k1",
                "requests": 3,
                "refused_requests": 0,
                "prompt_tokens": 17,
                "cached_tokens": 4,
                "completion_tokens": 11,
                "cost": 3_005 / 1e9,
                "cost_nanos": 3_005,
                "currency": "USD",
                "cache_hits": 1,  # apart from the requests served and their tokens
                "cache_hit_tokens": 15,
            }
        ]
        await one.aclose()
        await two.aclose()

    asyncio.run(run())


def test_what_a_flush_could_not_write_is_kept_for_the_next(tmp_path):
    async def run() -> None:
        ledger = SpendLedger(
            RedisSpendStore("redis://127.0.0.1:1/0", timeout=2.0), 60, clock=lambda: DEC_3
        )  # nothing listens
        ledger.record("k", "acme", "m", 5, 0, 5, 42)
        await ledger.flush()
        ledger.record("k", "acme", "m", 5, 0, 5, 8)
        await ledger.store.aclose()
        ledger.store = SqliteSpendStore(tmp_path / "l.db")  # the store is back
        await ledger.flush()
        [row] = await ledger.report(0, int(DEC_3) + 3600, ["tenant"])
        assert (row["requests"], row["cost_nanos"]) == (2, 50)
        await ledger.aclose()

    asyncio.run(run())


def test_a_ledger_file_without_refused_requests_gains_them_and_keeps_its_rows(tmp_path):
    """A file whose spend table has no column for refused requests or cache hits (made before they were counted
    apart): opened, it gets the columns, its rows are read as they were (nothing refused), and new rows count them
    apart."""
    path = tmp_path / "l.db"
    with contextlib.closing(sqlite3.connect(path)) as db, db:
        db.execute(
            "CREATE TABLE spend (hour INTEGER NOT NULL, key_id TEXT NOT NULL, tenant TEXT NOT NULL,"
            " model TEXT NOT NULL,"
            " requests INTEGER NOT NULL, prompt_tokens INTEGER NOT NULL, cached_tokens INTEGER NOT NULL,"
            " completion_tokens INTEGER NOT NULL, cost_nanos INTEGER NOT NULL,"
            " PRIMARY KEY (hour, key_id, tenant, model)) WITHOUT ROWID"
        )
        db.execute("INSERT INTO spend VALUES (?, 'k', 'acme', 'm', 4, 10, 0, 5, 900)", (int(DEC_3 - DEC_3 % 3600),))

    async def run() -> None:
        ledger = SpendLedger(SqliteSpendStore(path), 60, clock=lambda: DEC_3)
        ledger.record("k", "acme", "m", 2, 0, 1, 100)
        ledger.record("k", "acme", "m", 0, 0, 0, 0, served=False)
        ledger.record("k", "acme", "m", 3, 0, 2, 0, served=False, cache_hit=True)
        [row] = await ledger.report(0, int(DEC_3) + 3600, ["tenant"])
        assert (row["requests"], row["refused_requests"], row["cost_nanos"]) == (5, 1, 1_000)
        assert (row["cache_hits"], row["cache_hit_tokens"]) == (1, 5)
        await ledger.aclose()

    asyncio.run(run())
