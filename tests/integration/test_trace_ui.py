"""A trace you can see: `make demo`'s stack (Arize Phoenix, an engine, the gateway) run as `make demo` runs it, and
headless Chromium reading Phoenix's trace pages: what the UI renders is one trace from the edge's stages to the
engine's prefill and decode.

Phoenix comes from PyPI into a virtualenv of its own (`make phoenix`, or the first run here: minutes, once per
machine); Chromium is Debian's package (`make chromium`). A missing one is no reason to skip: the test fails naming it.
"""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gateway.demo import browser, phoenix
from gateway.ops.up import DEFAULT_MODEL
from tests.conftest import ROOT, STATE_ENV

# A row of the demo's table: label, status, the trace's page.
ROW = re.compile(
    r"^  (?P<label>\S.*?)\s+(?P<status>\d{3})\s+(?P<url>http://\S+/redirects/traces/(?P<trace>[0-9a-f]{32}))$"
)
CHAT_SPAN = f"chat {DEFAULT_MODEL}"
EDGE_STAGES = ["stage.parse", "stage.waf", "stage.auth", "stage.authority", "stage.guard", "stage.route"]
ENGINE_SPANS = ["engine.request", "engine.prefill", "engine.decode"]
# The first test's setup starts the whole stack (minutes on a busy machine) after Phoenix's install on a machine that
# has never made it (`make test` makes it beforehand): more than the suite's 300 s per test.
pytestmark = pytest.mark.timeout(900)


def port_outside_ephemeral_range() -> int:
    """A port free on every address, below the kernel's ephemeral range. The demo's servers bind theirs a minute or
    more after it is chosen (Phoenix's gRPC port on [::]), while the processes starting meanwhile open many outgoing
    connections: a port from the ephemeral range, as binding port 0 gives, can be taken by one of them first."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for port in random.sample(range(10_000, low), 200):
        try:
            for family, address in ((socket.AF_INET6, "::"), (socket.AF_INET, "127.0.0.1")):
                with socket.socket(family) as sock:
                    sock.bind((address, port))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port below the ephemeral range")


@dataclass
class Demo:
    process: subprocess.Popen[bytes]
    phoenix_url: str
    ports: dict[str, int]  # by the demo's flag
    traces: dict[str, tuple[int, str, str]]  # label -> (status, page url, trace id)
    screenshot: Path


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Demo]:
    phoenix.install()  # a no-op once made; a failed install fails here with pip's own message
    workdir = tmp_path_factory.mktemp("demo")
    ports = {
        flag: port_outside_ephemeral_range()
        for flag in ("--phoenix-port", "--phoenix-grpc-port", "--port", "--admin-port", "--engine-port")
    }
    output, screenshot = workdir / "demo.out", workdir / "trace.png"
    command = [sys.executable, "-m", "gateway.demo", "--replicas", "1", "--workdir", str(workdir)]
    command += ["--screenshot", str(screenshot), *(str(part) for flag_port in ports.items() for part in flag_port)]
    env = {**os.environ, STATE_ENV: str(workdir / "state")}  # the admin token: not in $HOME
    with output.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    try:
        deadline = time.monotonic() + 400  # model, guard, Phoenix's database, 4 requests: 3 min on a busy 2-core box
        while "Stop: Ctrl-C" not in output.read_text(errors="replace"):
            assert process.poll() is None, f"the demo exited with {process.returncode}:\n{_logs(workdir)}"
            assert time.monotonic() < deadline, f"the demo did not finish starting:\n{_logs(workdir)}"
            time.sleep(0.5)
        rows = [ROW.match(line) for line in output.read_text().splitlines()]
        traces = {m["label"]: (int(m["status"]), m["url"], m["trace"]) for m in rows if m}
        yield Demo(process, f"http://127.0.0.1:{ports['--phoenix-port']}", ports, traces, screenshot)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _logs(workdir: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(workdir.glob("*.*")))


def _shown(url: str, **options) -> list[str]:
    """The text nodes Phoenix's page at `url` shows once rendered in headless Chromium."""
    return browser.visible_text(browser.render(url, **options)).splitlines()


def test_the_trace_page_shows_one_trace_from_the_edge_to_the_engines_decode(demo: Demo) -> None:
    status, url, trace_id = demo.traces["chat, streamed"]
    assert status == 200
    shown = _shown(url)
    assert trace_id in shown, "the page is not this trace's"
    missing = [
        name for name in ["POST /v1/chat/completions", *EDGE_STAGES, CHAT_SPAN, *ENGINE_SPANS] if name not in shown
    ]
    assert not missing, f"the trace view shows no {missing}; it shows {shown}"


def test_a_blocked_request_shows_the_stage_that_stopped_it_and_no_engine(demo: Demo) -> None:
    status, url, trace_id = demo.traces["guard blocks"]
    assert status == 400
    shown = _shown(url)
    assert trace_id in shown and "stage.guard" in shown, shown
    assert not {CHAT_SPAN, *ENGINE_SPANS} & set(shown), "a refused request reached no upstream"


def test_phoenix_holds_the_engines_spans_under_the_gateways_upstream_call(demo: Demo) -> None:
    """The trace is one because the engine continued the traceparent the gateway sent: parent ids, by the API."""
    _, _, trace_id = demo.traces["chat"]
    spans = {s["name"]: s for s in phoenix.spans(demo.phoenix_url, trace_id)}
    root = spans["POST /v1/chat/completions"]
    assert root["parent_id"] is None
    assert spans[CHAT_SPAN]["parent_id"] == root["context"]["span_id"]
    assert spans["engine.request"]["parent_id"] == spans[CHAT_SPAN]["context"]["span_id"]
    assert spans["engine.decode"]["parent_id"] == spans["engine.request"]["context"]["span_id"]
    assert spans[CHAT_SPAN]["attributes"]["gen_ai.usage.output_tokens"] > 0


def test_the_demo_screenshots_the_first_trace_and_names_every_request(demo: Demo) -> None:
    assert {label: status for label, (status, _, _) in demo.traces.items()} == {
        "chat": 200,
        "chat, streamed": 200,
        "guard blocks": 400,
        "WAF blocks": 403,
    }
    png = demo.screenshot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", png[16:24]) == browser.WINDOW


def test_ctrl_c_stops_phoenix_the_engine_and_the_gateway(demo: Demo) -> None:
    demo.process.send_signal(signal.SIGINT)
    assert demo.process.wait(timeout=60) == 128 + signal.SIGINT
    for flag in ("--phoenix-port", "--port", "--engine-port"):
        with pytest.raises(OSError), socket.create_connection(("127.0.0.1", demo.ports[flag]), timeout=2):
            pass
