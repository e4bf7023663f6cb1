"""The process's log lines, formatted and written by a thread of its own, as many as are waiting in one write.

The event loop only enqueues: a log record (through the root logger's QueueHandler), or an access-log line as the
dict of its fields (`log_access`), which skips building a LogRecord altogether: a record, its copy for the queue
and the stdlib's JSON encoder cost several times what the line itself does, and the access log writes one line per
request. Lines go to stderr as JSON, so one collector parses all of them; a burst of requests costs one write.
"""

from __future__ import annotations

import logging
import logging.handlers
import queue
import sys
import threading
from typing import Any, TextIO

import orjson

from gateway.telemetry import ACCESS_LOGGER, JsonLineFormatter

_BATCH = 1024  # lines per write at most
_STOP = object()


class LogWriter:
    def __init__(self, stream: TextIO, formatter: JsonLineFormatter) -> None:
        self.queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._stream = stream
        self._formatter = formatter
        self._extra = formatter.process_fields
        self._thread = threading.Thread(target=self._run, name="log-writer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Write what is queued, then end the thread."""
        if self._thread.is_alive():
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

    def _line(self, item: logging.LogRecord | dict[str, Any]) -> str:
        if isinstance(item, dict):  # an access-log line
            fields = {**item, **self._extra} if self._extra else item
            return orjson.dumps(fields, default=str).decode() + "\n"
        return self._formatter.format(item) + "\n"


_writer: LogWriter | None = None


def install(level: str, process_fields: dict[str, object] | None = None) -> LogWriter:
    """Route every log record, and the access log, through one writer thread to stderr."""
    global _writer
    writer = LogWriter(sys.stderr, JsonLineFormatter(process_fields))
    writer.start()
    root = logging.getLogger()
    root.handlers[:] = [logging.handlers.QueueHandler(writer.queue)]
    root.setLevel(level.upper())
    logging.getLogger(ACCESS_LOGGER).setLevel(logging.INFO)
    _writer = writer
    return writer


def log_access(fields: dict[str, Any]) -> None:
    """One access-log line: straight onto the writer's queue where one is installed (`portcullis serve`), else
    through the `portcullis.access` logger."""
    if _writer is not None:
        _writer.queue.put(fields)
    else:
        logging.getLogger(ACCESS_LOGGER).info("", extra={"access": fields})
