"""Arize Phoenix, the trace UI of `make demo` and of the trace-UI test: it takes OTLP and reads `gen_ai.*` attributes.

Installed from PyPI into a virtualenv of its own, made on first use under `.phoenix/` in the repository (keyed by the
pinned version): its several hundred megabytes of dependencies would clash with the gateway's own. It runs on
loopback with nothing leaving the machine and its agent assistant, and that assistant's server-side tools, off.
"""

from __future__ import annotations

import fcntl
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

PHOENIX_VERSION = "20.26.1"
DEFAULT_HOME = Path(__file__).resolve().parents[2] / ".phoenix"
PROJECT = "default"  # where Phoenix files spans whose resource names no project: the gateway's and the engines'
START_TIMEOUT = 180.0  # its first start creates its database: half a minute on a busy 2-core machine


class PhoenixError(RuntimeError):
    """Phoenix could not be installed or started, or never received a trace."""


def install(home: Path = DEFAULT_HOME) -> Path:
    """The `phoenix` executable of the pinned version, its virtualenv made first if need be (minutes, from PyPI).

    A lock keeps two callers (the demo, a test) from making it at once; a virtualenv whose install did not finish
    (no marker file) is made again from scratch."""
    venv = home / f"venv-{PHOENIX_VERSION}"
    executable, marker = venv / "bin" / "phoenix", venv / ".installed"
    if marker.exists():
        return executable
    home.mkdir(parents=True, exist_ok=True)
    with (home / "install.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.exists():
            return executable
        print(
            f"installing arize-phoenix {PHOENIX_VERSION} into {venv} (once per machine: a few minutes)", file=sys.stderr
        )
        steps = [
            [sys.executable, "-m", "venv", "--clear", str(venv)],
            [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", f"arize-phoenix=={PHOENIX_VERSION}"],
        ]
        for step in steps:
            if subprocess.run(step).returncode != 0:
                raise PhoenixError(f"could not install arize-phoenix {PHOENIX_VERSION} into {venv}: {' '.join(step)}")
        marker.touch()
    return executable


def environment(port: int, grpc_port: int, working_dir: Path) -> dict[str, str]:
    """Phoenix's settings: its UI and OTLP/HTTP on `port`, OTLP/gRPC on `grpc_port`, its SQLite file in
    `working_dir`; loopback only, no analytics pixels or external fonts, no agent assistant (it would run shell
    commands on the server)."""
    return {
        "PHOENIX_HOST": "127.0.0.1",
        "PHOENIX_PORT": str(port),
        "PHOENIX_GRPC_PORT": str(grpc_port),
        "PHOENIX_WORKING_DIR": str(working_dir),
        "PHOENIX_TELEMETRY_ENABLED": "false",
        "PHOENIX_ALLOW_EXTERNAL_RESOURCES": "false",
        "PHOENIX_DISABLE_AGENT_ASSISTANT": "true",
        "PHOENIX_AGENTS_DISABLE_BASH": "true",
        "PHOENIX_AGENTS_DISABLE_WEB_ACCESS": "true",
    }


def trace_url(url: str, trace_id: str) -> str:
    """The page of one trace: Phoenix redirects it to the trace's view in its project."""
    return f"{url}/redirects/traces/{trace_id}"


def spans(url: str, trace_id: str) -> list[dict[str, Any]]:
    """The spans Phoenix holds of one trace, as its REST API gives them."""
    response = httpx.get(f"{url}/v1/projects/{PROJECT}/spans", params={"trace_id": trace_id, "limit": 1000})
    if response.status_code == 404:  # no span has reached the project yet
        return []
    response.raise_for_status()
    data: list[dict[str, Any]] = response.json()["data"]
    return data


def wait_for_spans(url: str, trace_id: str, names: set[str], timeout: float = 30.0) -> list[dict[str, Any]]:
    """The trace's spans once Phoenix holds every span named in `names` (exporters send spans in batches)."""
    deadline = time.monotonic() + timeout
    while True:
        received = spans(url, trace_id)
        missing = names - {span["name"] for span in received}
        if not missing:
            return received
        if time.monotonic() > deadline:
            raise PhoenixError(f"trace {trace_id}: Phoenix has no span named {sorted(missing)} after {timeout:.0f}s")
        time.sleep(0.25)
