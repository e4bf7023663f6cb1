"""Text log lines carry what clients send (paths, model names) without letting it forge a line."""

from __future__ import annotations

import logging
import sys

from gateway.observability.log_format import TextLineFormatter


def test_an_access_line_with_a_newline_in_its_path_stays_one_line() -> None:
    forged = "/v1/chat\n2026-01-01 00:00:00 access status=200 tenant=admin\u2028x"
    line = TextLineFormatter({"worker": 1}).fields_line(
        {"ts": 0.0, "path": forged, "status": 403, "model": "a b", "finish_reasons": ["stop"], "cost": None}
    )
    assert "\n" not in line and "\u2028" not in line
    assert line.endswith(' model="a b" finish_reasons=["stop"] worker=1')
    assert " status=403 " in line and "cost" not in line


def test_a_message_and_its_traceback_cannot_start_a_line_of_their_own() -> None:
    try:
        raise ValueError("bad\n2026-01-01 00:00:00 INFO forged: line")
    except ValueError:
        raised = sys.exc_info()
    record = logging.LogRecord("gw", logging.ERROR, "f", 1, "saw %s", ("x\r\ny",), raised)
    lines = TextLineFormatter().format(record).split("\n")
    assert "saw x\\x0d\\x0ay" in lines[0]
    assert all(line.startswith("  | ") for line in lines[1:])
