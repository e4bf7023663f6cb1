"""`listen.workers: 2`: real worker processes sharing one port under a real supervisor, with a real Redis."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml

from tests.conftest import (
    ROOT,
    STATE_ENV,
    Process,
    chat_body,
    free_port,
    generated_admin_token,
    policy_dir,
    pool,
    spawn,
)

KEY = "sk-workers"
AUTH = {"keys": [{"tenant": "t1", "sha256": hashlib.sha256(KEY.encode()).hexdigest()}]}

# A bare httpx.post or httpx.Client() builds a TLS context (the CA bundle, tens of milliseconds of CPU) per call. The
# upstream's stats are asked through one client (the admin plane through the gateway's own); chat requests through
# one that keeps no connection alive, so each still goes on a connection of its own.
http = httpx.Client()
fresh_connections = httpx.Client(timeout=30, limits=httpx.Limits(max_keepalive_connections=0))


@pytest.fixture(scope="module")
def upstream(module_launcher):
    """The module's upstream (no test here stops it); a test counts what reached it as a difference."""
    return module_launcher.fake_upstream()


def start_workers(processes: list[Process], tmp_path: Path, config: dict, workers: int = 2) -> Process:
    """`portcullis serve` with `listen.workers`, returned once every worker serves."""
    port, admin_port = free_port(), free_port()
    config = {
        **config,
        "listen": {"host": "127.0.0.1", "port": port, "workers": workers},
        "admin": {"port": admin_port},
        "store": {"sqlite_path": str(tmp_path / "portcullis.db")},
    }
    path = tmp_path / "portcullis.yaml"
    path.write_text(yaml.safe_dump(config))
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--config", str(path)]
    gateway = spawn(cmd, port, tmp_path / "gateway.log", env={STATE_ENV: str(tmp_path / "state")})
    gateway.admin_url = f"http://127.0.0.1:{admin_port}"
    gateway.admin_token = generated_admin_token(tmp_path / "state")  # the supervisor made it before any worker
    processes.append(gateway)
    wait_for(lambda: f"all {workers} workers serving" in gateway.output(), what="every worker serving")
    return gateway


def wait_for(condition, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not seen within {timeout:.0f}s: {what}")
        time.sleep(0.1)


def children(pid: int) -> list[int]:
    """Live (not zombie) processes whose parent is `pid`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            state, ppid = stat.rsplit(")", 1)[1].split()[:2]
            if int(ppid) == pid and state != "Z":
                found.append(int(entry.name))
    return sorted(found)


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_text().split("\0")


def supervisor_directory(worker: int) -> Path:
    """The supervisor's own directory (the workers' config and metrics), from a worker's command line."""
    args = cmdline(worker)
    return Path(args[args.index("--config") + 1]).parent


def worker_pids(gateway: Process) -> dict[int, int]:
    """The supervisor's live workers, by index."""
    found = {}
    for pid in children(gateway.proc.pid):
        args = cmdline(pid)
        found[int(args[args.index("--worker-index") + 1])] = pid
    return found


def access_lines(gateway: Process, since: int = 0) -> list[dict]:
    lines = gateway.output()[since:].splitlines()
    return [json.loads(line) for line in lines if '"trace_id"' in line]


def fresh_connection_posts(gateway: Process, count: int, **fields) -> list[int]:
    """`count` chat requests, each on a connection of its own (so the kernel spreads them over the workers)."""
    body = chat_body(**fields)

    def one(_: int) -> int:
        return fresh_connections.post(
            gateway.url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {KEY}"}
        ).status_code

    with ThreadPoolExecutor(8) as threads:
        return list(threads.map(one, range(count)))


def metric(gateway: Process, name: str, **labels: str) -> float:
    total = 0.0
    for line in gateway.admin.get("/metrics").text.splitlines():
        match = re.match(rf"^{name}\{{(.*)\}} (\S+)$", line)
        if match and all(f'{k}="{v}"' in match.group(1) for k, v in labels.items()):
            total += float(match.group(2))
    return total


def test_a_redis_rate_limit_is_exact_across_workers_and_metrics_count_every_worker(
    processes, upstream, redis_server, tmp_path
):
    before = http.get(upstream.url + "/_stats").json()["requests"]
    # an hour's window: no request comes back into the limit while the test runs on a slow machine
    rules = [{"id": "tenant-20", "key": ["tenant"], "requests": {"limit": 20, "per": "1h"}}]
    gateway = start_workers(
        processes,
        tmp_path,
        {
            "pools": [pool("main", upstream.url)],
            "auth": AUTH,
            "policy_dir": policy_dir(tmp_path, rules),
            "redis": {"url": redis_server.url, "timeout": 5.0, "on_failure": "fail_closed"},
        },
    )
    statuses = fresh_connection_posts(gateway, 60)
    assert statuses.count(200) == 20 and statuses.count(429) == 40
    served_by = {line["worker"] for line in access_lines(gateway)}
    assert served_by == {0, 1}, "both workers took connections"
    assert http.get(upstream.url + "/_stats").json()["requests"] - before == 20
    # worker 0 serves /metrics and counts what worker 1 served too
    assert metric(gateway, "portcullis_ratelimit_decisions_total", result="allowed", backend="redis") == 20
    # per-request tallies (requests, durations, billing) are published by each worker every second, so the scrape
    # that worker 0 answers sees worker 1's within a second or two
    assert eventually(gateway, "portcullis_requests_total", 60, route="chat") == 60
    assert eventually(gateway, "portcullis_request_duration_seconds_count", 60, route="chat") == 60
    assert eventually(gateway, "portcullis_billed_requests_total", 60) == 60


def eventually(gateway: Process, name: str, expected: float, **labels: str) -> float:
    """The metric once it reaches `expected`, or as it stands after twenty seconds."""
    deadline = time.monotonic() + 20
    while (value := metric(gateway, name, **labels)) < expected and time.monotonic() < deadline:
        time.sleep(0.2)
    return value


def test_a_budget_in_the_sqlite_store_is_exact_across_workers(processes, upstream, tmp_path):
    """docs/keys-and-spend.md, budgets without Redis: the workers reserve on the one SQLite file, so what they admit
    never sums past the limit. A budget of exactly 100 requests' cost (10 output tokens each, answered with 10) and
    300 requests spread over two workers: exactly 100 are served, and the spend report records exactly the limit."""
    directory = tmp_path / "budget-policies"
    directory.mkdir()
    spec = {
        "prices": {"models": {"test-model": {"input": 0.0, "output": 1.0}}},  # 10,000 nanos a request
        "budgets": [{"id": "team-spend", "key": "tenant", "limit": 0.001, "period": "day"}],
    }
    policy = {"apiVersion": "portcullis.dev/v1", "kind": "Policy", "metadata": {"name": "b"}, "spec": spec}
    (directory / "base.yaml").write_text(yaml.safe_dump(policy))
    config = {
        "pools": [pool("main", upstream.url)],
        "auth": AUTH,
        "models": [{"name": "test-model"}],
        "policy_dir": str(directory),
        "telemetry": {"access_log": True},
    }
    gateway = start_workers(processes, tmp_path, config)
    statuses = fresh_connection_posts(gateway, 300, max_tokens=10, fake={"chunks": 10})
    assert {line["worker"] for line in access_lines(gateway)} == {0, 1}, "both workers took connections"
    assert statuses.count(200) == 100 and statuses.count(429) == 200
    deadline = time.monotonic() + 20  # each worker writes its spend within a second
    while True:
        [row] = gateway.admin.get("/admin/spend", params={"group_by": "tenant"}).json()["data"]
        if row["cost_nanos"] >= 1_000_000 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert (row["cost_nanos"], row["completion_tokens"]) == (1_000_000, 1000)


def test_a_killed_worker_is_restarted_while_the_port_keeps_answering(processes, upstream, tmp_path):
    gateway = start_workers(processes, tmp_path, {"pools": [pool("main", upstream.url)], "auth": AUTH})
    before = worker_pids(gateway)
    os.kill(before[1], signal.SIGKILL)
    # reaped by the supervisor: every thread of it gone, its listener closed
    wait_for(lambda: "worker 1 exited with status -9: restarting" in gateway.output(), what="the restart logged")
    restarted_at = len(gateway.output())
    # worker 0 alone holds the port meanwhile; the new worker 1 takes connections only once it has started
    assert fresh_connection_posts(gateway, 20) == [200] * 20

    def both_serve() -> bool:
        fresh_connection_posts(gateway, 4)
        return {line["worker"] for line in access_lines(gateway, restarted_at)} == {0, 1}

    wait_for(both_serve, what="the new worker 1 taking connections")
    after = worker_pids(gateway)
    assert after[0] == before[0] and after[1] != before[1]


def test_sigterm_to_the_supervisor_ends_every_worker_and_removes_its_files(processes, upstream, tmp_path):
    gateway = start_workers(processes, tmp_path, {"pools": [pool("main", upstream.url)], "auth": AUTH})
    workers = list(worker_pids(gateway).values())
    directory = supervisor_directory(workers[0])
    assert directory.is_dir() and any((directory / "metrics").iterdir())
    gateway.proc.send_signal(signal.SIGTERM)
    assert gateway.proc.wait(timeout=30) == 0
    assert not any(alive(pid) for pid in workers)
    assert not directory.exists()
    with pytest.raises(httpx.ConnectError):
        httpx.get(gateway.url + "/healthz")


def test_workers_do_not_outlive_a_killed_supervisor(processes, upstream, tmp_path):
    gateway = start_workers(processes, tmp_path, {"pools": [pool("main", upstream.url)], "auth": AUTH})
    workers = list(worker_pids(gateway).values())
    assert len(workers) == 2
    directory = supervisor_directory(workers[0])
    gateway.proc.kill()
    gateway.proc.wait()
    wait_for(lambda: not any(alive(pid) for pid in workers), what="every worker gone", timeout=30)
    shutil.rmtree(directory)  # what a killed supervisor cannot remove


def test_a_public_port_in_use_fails_at_once(tmp_path, upstream):
    taken = socket.create_server(("127.0.0.1", 0))
    config = {
        "listen": {"host": "127.0.0.1", "port": taken.getsockname()[1], "workers": 2},
        "pools": [pool("main", upstream.url)],
    }
    with taken:
        done = run_serve(config, tmp_path)
    assert done.returncode == 2 and "cannot listen" in done.stderr and "Address already in use" in done.stderr
    assert "worker 0 started" not in done.stderr


def test_a_worker_that_cannot_start_stops_the_supervisor_with_status_2(tmp_path, upstream):
    taken = socket.create_server(("127.0.0.1", 0))  # worker 0 binds the admin port: it cannot
    config = {
        "listen": {"host": "127.0.0.1", "port": free_port(), "workers": 2},
        "admin": {"port": taken.getsockname()[1]},
        "store": {"sqlite_path": str(tmp_path / "portcullis.db")},
        "pools": [pool("main", upstream.url)],
    }
    with taken:
        done = run_serve(config, tmp_path)
    assert done.returncode == 2
    assert "worker 0 exited with status 2 before serving: stopping" in done.stderr
    worker_pids = [int(pid) for pid in re.findall(r"worker \d started \(pid (\d+)\)", done.stderr)]
    assert len(worker_pids) == 2 and not any(alive(pid) for pid in worker_pids)


def run_serve(config: dict, tmp_path: Path) -> subprocess.CompletedProcess:
    """`portcullis serve` run to its end (one that cannot start)."""
    path = tmp_path / "portcullis.yaml"
    path.write_text(yaml.safe_dump(config))
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--config", str(path)]
    env = {**os.environ, STATE_ENV: str(tmp_path / "state")}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_an_mcp_session_opened_on_one_worker_is_the_callers_on_every_worker(processes, tmp_path):
    """docs/mcp.md, sessions: the supervisor makes the secret session ids are bound with before any worker starts, so
    a session a client opened through one worker is accepted, for its key, by the others."""
    description = tmp_path / "description.txt"
    description.write_text("Current weather conditions for a city.")
    server_port = free_port()
    server_cmd = [sys.executable, str(ROOT / "tests" / "mcp_server.py"), "--port", str(server_port)]
    server = spawn([*server_cmd, "--description-file", str(description)], server_port, tmp_path / "mcp.log", "/healthz")
    processes.append(server)
    policies = tmp_path / "policies"
    policies.mkdir()
    base = {"pin": "learn", "servers": {"test": {"tools": ["*"]}}}
    (policies / "base.yaml").write_text(
        yaml.safe_dump(
            {"apiVersion": "portcullis.dev/v1", "kind": "Policy", "metadata": {"name": "m"}, "spec": {"mcp": base}}
        )
    )
    gateway = start_workers(
        processes,
        tmp_path,
        {
            "pools": [pool("main", "http://127.0.0.1:9")],
            "auth": AUTH,
            "policy_dir": str(policies),
            "mcp_servers": [{"name": "test", "url": f"{server.url}/mcp"}],
        },
    )
    headers = {"authorization": f"Bearer {KEY}", "accept": "application/json, text/event-stream"}
    hello = {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "tests", "version": "0"}}
    opened = fresh_connections.post(
        gateway.url + "/mcp/test",
        json={"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": hello},
        headers=headers,
    )
    assert opened.status_code == 200, opened.text
    session = {**headers, "mcp-session-id": opened.headers["mcp-session-id"], "mcp-protocol-version": "2025-11-25"}
    initialized = {"jsonrpc": "2.0", "method": "notifications/initialized"}
    assert fresh_connections.post(gateway.url + "/mcp/test", json=initialized, headers=session).status_code == 202
    since = len(gateway.output())

    def listed(i: int) -> int:
        body = {"jsonrpc": "2.0", "id": 10 + i, "method": "tools/list"}
        return fresh_connections.post(gateway.url + "/mcp/test", json=body, headers=session).status_code

    with ThreadPoolExecutor(4) as threads:
        assert list(threads.map(listed, range(24))) == [200] * 24
    served = {line["worker"] for line in access_lines(gateway, since) if line["path"] == "/mcp/test"}
    assert served == {0, 1}, "both workers took the session's requests"
