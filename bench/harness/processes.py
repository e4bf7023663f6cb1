"""The processes a benchmark starts (each leads a process group of its own, stopped on exit, errors included), and
what they cost: readiness, CPU seconds of a process group or tree, waiting for a started process to go idle."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Service:
    name: str
    proc: subprocess.Popen
    port: int
    log_path: Path
    admin_port: int | None = None  # a gateway's admin listener (/metrics)


@dataclass
class Procs:
    services: list[Service] = field(default_factory=list)

    def start(
        self,
        name: str,
        argv: list[str],
        port: int,
        log_path: Path,
        env: dict | None = None,
        stderr_path: Path | None = None,
    ) -> Service:
        out = open(log_path, "ab")
        err = open(stderr_path, "ab") if stderr_path else subprocess.STDOUT
        proc = subprocess.Popen(argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        service = Service(name, proc, port, log_path)
        self.services.append(service)
        return service

    def stop(self, service: Service) -> None:
        """SIGTERM the service's own process group (it leads one: start_new_session), then SIGKILL if it lingers."""
        proc = service.proc
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)
        else:  # the leader is gone; make sure nothing it forked is left in its group
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        if service in self.services:
            self.services.remove(service)

    def stop_all(self) -> None:
        for service in reversed(list(self.services)):
            try:
                self.stop(service)
            except Exception as exc:  # keep cleaning up the rest
                print(f"warning: stopping {service.name}: {exc}", file=sys.stderr)


def wait_http(service: Service, path: str, timeout: float, method: str = "GET", **kwargs) -> None:
    import httpx

    url = f"http://127.0.0.1:{service.port}{path}"
    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        if service.proc.poll() is not None:
            raise RuntimeError(
                f"{service.name} exited with {service.proc.returncode} before it was ready; "
                f"see {service.log_path}:\n{tail(service.log_path)}"
            )
        try:
            response = httpx.request(method, url, timeout=2.0, **kwargs)
            if response.status_code < 500:
                return
            last = f"HTTP {response.status_code}"
        except Exception as exc:  # noqa: BLE001 - anything means "not yet"
            last = f"{type(exc).__name__}: {exc}"
        time.sleep(0.25)
    raise RuntimeError(
        f"{service.name} not ready after {timeout:.0f}s ({last}); see {service.log_path}:\n{tail(service.log_path)}"
    )


def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def group_cpu_seconds(pgid: int) -> float:
    """User+system CPU of every live process in a process group (a service and the workers it forked)."""
    ticks = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid:  # fields[0] is field 3 (state): pgrp is field 5, utime 14, stime 15
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def wait_idle(services: list[Service], timeout: float = 60.0) -> None:
    """Wait until just-started gateways stop using CPU: each warms its tokenizer in a background thread for seconds,
    which would otherwise steal CPU from (or be counted in) the first runs."""
    deadline = time.monotonic() + timeout
    before = [group_cpu_seconds(s.proc.pid) for s in services]
    while time.monotonic() < deadline:
        time.sleep(0.5)
        after = [group_cpu_seconds(s.proc.pid) for s in services]
        if all(b - a < 0.05 for a, b in zip(before, after)):
            return
        before = after


def wait_serving(service: Service, workers: int, timeout: float = 60.0) -> None:
    """Until every worker serves (the supervisor logs it), not just the first to answer /healthz."""
    deadline = time.monotonic() + timeout
    while workers > 1 and f"all {workers} workers serving".encode() not in service.log_path.read_bytes():
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{service.name}: not every worker serving after {timeout:g}s:\n{tail(service.log_path)}"
            )
        time.sleep(0.2)


def wait_tree_idle(root: int, timeout: float = 60.0) -> None:
    """`wait_idle` for a process tree: each worker warms its tokenizer in the background after it serves."""
    deadline = time.monotonic() + timeout
    before = tree_cpu_seconds(root)
    while time.monotonic() < deadline:
        time.sleep(0.5)
        after = tree_cpu_seconds(root)
        if after - before < 0.05:
            return
        before = after


def tree_pids(root: int) -> list[int]:
    """`root` and every live process below it (workers run in process groups of their own)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                stat = (entry / "stat").read_text()
                parents[int(entry.name)] = int(stat[stat.rindex(")") + 2 :].split()[1])
    tree = [root]
    for pid in tree:
        tree += [child for child, parent in parents.items() if parent == pid]
    return tree


def tree_cpu_seconds(root: int) -> float:
    """User+system CPU of `root` and the live processes below it."""
    ticks = 0
    for pid in tree_pids(root):
        with contextlib.suppress(OSError):
            stat = Path(f"/proc/{pid}/stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")
