"""Opening the SQLite file that keys and spend share, in WAL mode, however many processes open it at once.

Switching a new file to WAL needs a moment's exclusive lock, and SQLite answers a second connection doing the same
with "database is locked" at once, without waiting out its busy timeout (it would deadlock otherwise). Two
processes (or a process's key store and spend ledger) starting together on a fresh file do just that, so the
switch is retried until the busy timeout has passed.

`WalFile` keeps a store's connection on the file its path names, should the file be moved or deleted while open.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path

from gateway.storage.file_identity import file_identity

log = logging.getLogger(__name__)

RETRY_SECONDS = 0.01
_opening = threading.Lock()  # one store of this process at a time opens a file that replaces a moved one


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


class WalFile:
    """A connection to the database at `path` that follows the path.

    A file renamed or deleted while open keeps taking writes that no restart will read (a restart opens a new, empty
    file: spend and keys lost). So each `connection()` (a flush, a poll or an admin call: never per request) compares
    the path's (st_dev, st_ino) with the file it opened, one stat; if they differ it logs an error, checkpoints what
    the old file's WAL holds into it, and opens the path afresh with `prepare` (the schema), as at start-up.
    """

    def __init__(
        self, path: Path, timeout: float, prepare: Callable[[sqlite3.Connection], object], **options: object
    ) -> None:
        self.path = path
        self._timeout = timeout
        self._prepare = prepare
        self._options = options
        self._db: sqlite3.Connection | None = None
        self._file: tuple[int, int] | None = None  # (st_dev, st_ino) of the file `_db` opened

    def connection(self) -> sqlite3.Connection:
        """The open connection: opened if none is, reopened if the path no longer names its file."""
        if self._db is not None and file_identity(self.path) != self._file:
            log.error("sqlite: %s was moved or deleted while open; writing to a new file at that path", self.path)
            try:
                self._db.execute("PRAGMA wal_checkpoint")  # the old file keeps what was written to it
            finally:
                self.close()
            with _opening:
                if not self.path.exists():  # its WAL and index are the old file's: a new one must not read them
                    for sidecar in ("-wal", "-shm"):
                        Path(f"{self.path}{sidecar}").unlink(missing_ok=True)
                return self._open()
        return self._db or self._open()

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    def _open(self) -> sqlite3.Connection:
        db = connect(self.path, self._timeout, **self._options)
        try:
            self._prepare(db)
        except BaseException:
            db.close()
            raise
        self._db, self._file = db, file_identity(self.path)
        return db
