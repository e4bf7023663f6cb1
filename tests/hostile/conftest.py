"""Fixtures for the hostile tests: a misbehaving upstream (hostile_upstream.py) as a real process, and what it saw."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.conftest import Launcher, Process

HOSTILE_UPSTREAM = Path(__file__).with_name("hostile_upstream.py")


def start_hostile_upstream(launcher: Launcher, metrics: str | None = None) -> Process:
    """A hostile upstream started by `launcher`; `metrics`: what its GET /metrics answers."""

    def cmd(port: int) -> list[str]:
        return [
            sys.executable,
            str(HOSTILE_UPSTREAM),
            "--port",
            str(port),
            *(["--metrics", metrics] if metrics else []),
        ]

    return launcher.spawn(cmd, "hostile-upstream", ready_path="/_stats")


@pytest.fixture
def hostile_upstream(launcher: Launcher) -> Callable[..., Process]:
    """Start a hostile upstream for this test; requests pick its misbehaviour with a `hostile` object in their body.
    `hostile_upstream(metrics=None)`."""
    return lambda metrics=None: start_hostile_upstream(launcher, metrics)


@pytest.fixture(scope="module")
def module_hostile_upstream(module_launcher: Launcher) -> Callable[..., Process]:
    """The same, started once for the test module (stopped after its last test): for tests that tag their requests
    and read only their own tags' records, or a count's change over the test."""
    return lambda metrics=None: start_hostile_upstream(module_launcher, metrics)


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


def log_mark(process: Process, quiet: float = 0.3, timeout: float = 10.0) -> int:
    """Where `process`'s log ends once nothing has been added to it for `quiet` seconds: what a test sharing the
    process reads after this mark is its own (log lines, access-log lines, written a moment after a response)."""
    deadline = time.monotonic() + timeout
    size = len(process.output())
    while True:
        time.sleep(quiet)
        now = len(process.output())
        if now == size or time.monotonic() > deadline:
            return now
        size = now
