"""Opening the SQLite file that keys and spend share, in WAL mode, however many processes open it at once.

Switching a new file to WAL needs a moment's exclusive lock, and SQLite answers a second connection doing the same
with "database is locked" at once, without waiting out its busy timeout (it would deadlock otherwise). Two
processes (or a process's key store and spend ledger) starting together on a fresh file do just that, so the
switch is retried until the busy timeout has passed.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

RETRY_SECONDS = 0.01


def connect(path: Path, timeout: float, **options: object) -> sqlite3.Connection:
    """A connection to `path` in WAL mode, busy timeout `timeout` seconds, autocommit (transactions explicit)."""
    db = sqlite3.connect(path, timeout=timeout, isolation_level=None, **options)  # type: ignore[call-overload]
    deadline = time.monotonic() + timeout
    while True:
        try:
            db.execute("PRAGMA journal_mode = WAL")
            return db
        except sqlite3.OperationalError as err:
            if "locked" not in str(err) or time.monotonic() > deadline:
                db.close()
                raise
            time.sleep(RETRY_SECONDS)
