"""How log lines are written, by the gateway and by the bundled engine alike: one JSON object a line (the default,
for a collector) or `text` (for a person at a terminal).

One option for both: `--log-format` on `portcullis serve`, `portcullis up` and `portcullis engine serve`, else
$PORTCULLIS_LOG_FORMAT. The choice is put back in the environment, so the processes a command starts (a
supervisor's workers, `up`'s engines) write the same. Records may carry an event's fields as
`extra={"fields": {...}}` and access-log records theirs as `extra={"access": {...}}`; `process_fields` (a worker's
index) go on every line, so the lines of several processes sharing one stderr can be told apart.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import time
from collections.abc import Mapping
from typing import Any

import orjson

LOG_FORMAT_ENV = "PORTCULLIS_LOG_FORMAT"
LOG_FORMATS = ("json", "text")


def add_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        help=f"json (default) or text; else ${LOG_FORMAT_ENV}. Processes this one starts write the same",
    )


def chosen(given: str | None) -> str:
    """The format `--log-format` gave, else $PORTCULLIS_LOG_FORMAT's, else json; set in the environment for the
    processes this one starts."""
    kind = given or os.environ.get(LOG_FORMAT_ENV) or "json"
    if kind not in LOG_FORMATS:  # as a process that cannot start ends: one line, status 2
        print(f"portcullis: {LOG_FORMAT_ENV}={kind!r} is none of {', '.join(LOG_FORMATS)}", file=sys.stderr)
        raise SystemExit(2)
    os.environ[LOG_FORMAT_ENV] = kind
    return kind


class LineFormatter(logging.Formatter):
    """A record as one line; `fields_line` writes an access-log line given as its fields alone (no record)."""

    def __init__(self, process_fields: Mapping[str, object] | None = None) -> None:
        super().__init__()
        self.process_fields = dict(process_fields or {})

    def fields_line(self, fields: Mapping[str, Any]) -> str:
        raise NotImplementedError


class JsonLineFormatter(LineFormatter):
    def format(self, record: logging.LogRecord) -> str:
        payload = getattr(record, "access", None)
        if payload is None:
            payload = {"level": record.levelname.lower(), "logger": record.name, "message": record.getMessage()}
            payload.update(getattr(record, "fields", None) or {})
            if record.exc_info:
                payload["exception"] = self.formatException(record.exc_info)
        if self.process_fields:
            payload = {**payload, **self.process_fields}
        return json.dumps(payload, separators=(",", ":"), default=str)

    def fields_line(self, fields: Mapping[str, Any]) -> str:
        extra = self.process_fields
        return orjson.dumps({**fields, **extra} if extra else fields, default=str).decode()


class TextLineFormatter(LineFormatter):
    """`time level logger: message key=value ...`; an access-log line as `access key=value ...`.

    What a client sent (a path, a model name) reaches these lines, so a line cannot be forged: control characters
    are escaped, a value with a space, quote or `=` is quoted as JSON, and an exception's traceback lines start
    with `  | `, never with a time."""

    def format(self, record: logging.LogRecord) -> str:
        access = getattr(record, "access", None)
        if access is not None:
            return self.fields_line(access)
        fields = {**(getattr(record, "fields", None) or {}), **self.process_fields}
        message = _escaped(record.getMessage())
        line = f"{self.formatTime(record)} {record.levelname} {record.name}: {message}{_pairs(fields)}"
        if record.exc_info:
            line += "".join(f"\n  | {_escaped(part)}" for part in self.formatException(record.exc_info).splitlines())
        return line

    def fields_line(self, fields: Mapping[str, Any]) -> str:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(fields.get("ts") or time.time()))
        rest = {k: v for k, v in fields.items() if k != "ts" and v is not None}
        return f"{stamp} access{_pairs({**rest, **self.process_fields})}"


# C0 and C1 controls, DEL, and the Unicode line and paragraph separators: what would end or rewrite a line
_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))} | {0x2028: "\\u2028", 0x2029: "\\u2029"}
_PLAIN = re.compile(r"[^\s\"=\x00-\x1f\x7f-\x9f\u2028\u2029]+")


def _escaped(text: str) -> str:
    return text.translate(_CONTROLS)


def _pairs(fields: Mapping[str, Any]) -> str:
    return "".join(f" {key}={_value(value)}" for key, value in fields.items())


def _value(value: Any) -> str:
    """A string as it is where that is unambiguous, else quoted; anything else as its JSON."""
    if isinstance(value, str):
        return value if _PLAIN.fullmatch(value) else json.dumps(value)
    return _escaped(orjson.dumps(value, default=str).decode())  # JSON leaves U+2028 and U+2029 raw


def line_formatter(kind: str, process_fields: Mapping[str, object] | None = None) -> LineFormatter:
    return TextLineFormatter(process_fields) if kind == "text" else JsonLineFormatter(process_fields)
