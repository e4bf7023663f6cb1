"""Fixtures for the hostile tests: a misbehaving upstream (hostile_upstream.py) as a real process, and what it saw."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.conftest import Process, free_port, spawn

HOSTILE_UPSTREAM = Path(__file__).with_name("hostile_upstream.py")


@pytest.fixture
def hostile_upstream(processes: list[Process], tmp_path: Path) -> Callable[..., Process]:
    """Start a hostile upstream; requests pick its misbehaviour with a `hostile` object in their body."""

    def start(metrics: str | None = None) -> Process:
        """`metrics`: what its GET /metrics answers."""
        port = free_port()
        process = spawn(
            [sys.executable, str(HOSTILE_UPSTREAM), "--port", str(port), *(["--metrics", metrics] if metrics else [])],
            port,
            tmp_path / f"hostile-upstream-{port}.log",
            ready_path="/_stats",
        )
        processes.append(process)
        return process

    return start


def upstream_seen(upstream: Process, tag: str) -> dict | None:
    """What the hostile upstream recorded for the request tagged `tag` (None before it arrived)."""
    return httpx.get(upstream.url + "/_stats").json()["seen"].get(tag)


def wait_for(upstream: Process, tag: str, field: str, timeout: float) -> dict | None:
    """The record of `tag` once `field` is set in it, or None if that did not happen within `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        seen = upstream_seen(upstream, tag)
        if seen and seen.get(field) or time.monotonic() > deadline:
            return seen if seen and seen.get(field) else None
        time.sleep(0.05)
