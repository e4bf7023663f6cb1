"""The process's log lines, formatted and written by a thread of its own, as many as are waiting in one write.

The event loop only enqueues: a log record (through the root logger's QueueHandler), or an access-log line as the
dict of its fields (`log_access`), which skips building a LogRecord altogether: a record, its copy for the queue
and the stdlib's JSON encoder cost several times what the line itself does, and the access log writes one line per
request. Access-log lines are handed over together, `ACCESS_FLUSH_DELAY` after the first of them: waking the writer
thread once per line costs a thread switch per request. Lines go to stderr as JSON (so one collector parses all of
them) or text (gateway/observability/log_format.py); a burst of requests costs one write.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import logging.handlers
import queue
import sys
import threading
from typing import Any, TextIO

from gateway.observability.log_format import LineFormatter, chosen, line_formatter
from gateway.observability.telemetry import ACCESS_LOGGER

_BATCH = 1024  # queued items per write at most
ACCESS_FLUSH_DELAY = 0.01  # seconds an access-log line may wait for others to go with it
_STOP = object()


class LogWriter:
    def __init__(self, stream: TextIO, formatter: LineFormatter) -> None:
        self.queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._stream = stream
        self._formatter = formatter
        self._thread = threading.Thread(target=self._run, name="log-writer", daemon=True)
        self._access: list[dict[str, Any]] = []  # access-log lines not handed over yet
        self._access_flush: asyncio.TimerHandle | None = None

    def put_access(self, fields: dict[str, Any]) -> None:
        """Queue one access-log line; called on the event loop."""
        self._access.append(fields)
        if self._access_flush is None:
            self._access_flush = asyncio.get_running_loop().call_later(ACCESS_FLUSH_DELAY, self._hand_over_access)

    def _hand_over_access(self) -> None:
        self._access_flush = None
        lines, self._access = self._access, []
        self.queue.put(lines)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Write what is queued, then end the thread."""
        if self._thread.is_alive():
            if self._access:
                self.queue.put(self._access)
            self.queue.put(_STOP)
            self._thread.join()

    def _run(self) -> None:
        while True:
            batch = [self.queue.get()]
            while len(batch) < _BATCH:
                try:
                    batch.append(self.queue.get_nowait())
                except queue.Empty:
                    break
            lines = [self._line(item) for item in batch if item is not _STOP]
            if lines:
                try:
                    self._stream.write("".join(lines))
                    self._stream.flush()
                except (OSError, ValueError):  # stderr closed or gone: nothing to tell it to
                    pass
            if _STOP in batch:
                return

    def _line(self, item: logging.LogRecord | list[dict[str, Any]]) -> str:
        if isinstance(item, list):  # access-log lines
            return "".join(self._formatter.fields_line(fields) + "\n" for fields in item)
        return self._formatter.format(item) + "\n"


_writer: LogWriter | None = None


def install(level: str, kind: str, process_fields: dict[str, object] | None = None) -> LogWriter:
    """Route every log record, and the access log, through one writer thread to stderr, as `kind` lines
    (gateway/observability/log_format.py)."""
    global _writer
    writer = LogWriter(sys.stderr, line_formatter(kind, process_fields))
    writer.start()
    root = logging.getLogger()
    root.handlers[:] = [logging.handlers.QueueHandler(writer.queue)]
    root.setLevel(level.upper())
    logging.getLogger(ACCESS_LOGGER).setLevel(logging.INFO)
    _writer = writer
    return writer


def configure_logging(level: str, kind: str | None, process_fields: dict[str, object] | None = None) -> None:
    """Everything to stderr as JSON lines (or text: `kind`, else $PORTCULLIS_LOG_FORMAT;
    gateway/observability/log_format.py), the access log included, so one collector parses all of it; what is queued
    is written at exit.

    Lines are formatted and written by the writer thread: the event loop only enqueues them (formatting and a write
    per access-log line on the loop cost ~150 µs a request in the proxy benchmark). `process_fields` go on every line
    (a worker's index).
    """
    atexit.register(install(level, chosen(kind), process_fields).stop)


def drain() -> None:
    """Write every queued line now and end the writer thread: for a process about to end without running its
    atexit handlers (ended by the signal that stopped its server)."""
    if _writer is not None:
        _writer.stop()


def log_access(fields: dict[str, Any]) -> None:
    """One access-log line: straight onto the writer's queue where one is installed (`portcullis serve`), else
    through the `portcullis.access` logger."""
    if _writer is not None:
        _writer.put_access(fields)
    else:
        logging.getLogger(ACCESS_LOGGER).info("", extra={"access": fields})
