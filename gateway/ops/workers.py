"""`listen.workers` above 1: `portcullis serve` becomes a supervisor of that many gateway processes on one port.

A gateway process is one event loop on one core. Each worker is `portcullis serve` again, in a fresh interpreter,
binding the public port with SO_REUSEPORT so the kernel spreads new connections over the workers. Worker 0 alone
binds the admin listener; every worker writes its metrics into a directory the supervisor owns
(PROMETHEUS_MULTIPROC_DIR, see gateway/observability/telemetry.py), so worker 0's /metrics counts all of them.

The supervisor:
- makes the secret MCP session ids are bound with (gateway/mcp/sessions.py) before any worker starts, so each
  worker, restarted ones too, accepts the sessions any other opened;
- makes (or reads) the admin token before any worker starts, so a generated one is printed once, by the supervisor,
  and worker 0, restarted ones too, reads the same file (gateway/admin/token.py);
- reserves the public port before any worker starts (bound, never listening, so it is given no connections): a
  port in use fails at once, and port 0 becomes one port that every worker shares;
- hands the workers the config it validated, written to a file of its own, so every worker (restarted ones too)
  runs the same config; on SIGHUP, or when the operator's file changes (looked at each pass), it validates the file
  again as a reload does (gateway/reload/config.py), rewrites the workers' file in one rename, and passes SIGHUP on,
  so every worker reloads the same config; a file it refuses leaves them all on the last good one;
- ends with status 2, stopping the others, when a worker exits before it ever served during start-up (a policy that
  does not load, the admin port in use): restarting cannot fix that;
- restarts a worker that dies later, waiting longer after each death soon after a start, so a crash loop does not
  spin;
- passes SIGTERM/SIGINT on to every worker, each of which drains as a single gateway does, kills any still running
  after STOP_TIMEOUT, removes its directory and ends with status 0.

Workers never outlive it: each asks the kernel for SIGTERM when its parent dies (prctl PR_SET_PDEATHSIG), SIGKILL
of the supervisor included. Workers run in a process group of their own, so a terminal's Ctrl-C reaches them once,
through the supervisor, and their drain is not cut short by a second SIGINT.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from prometheus_client import multiprocess

from gateway.admin.token import admin_token
from gateway.config import ConfigError, GatewayConfig, load_config
from gateway.mcp.sessions import process_secret
from gateway.observability.telemetry import MULTIPROCESS_DIR_ENV
from gateway.ops import child_processes
from gateway.reload.config import ConfigSource, needing_restart

log = logging.getLogger(__name__)

START_FAILED = 2  # the status `portcullis serve` ends with when it cannot start
STOP_TIMEOUT = 15.0  # after passing on SIGTERM: uvicorn's 10 s drain, then the lifespan's shutdown
STABLE_AFTER = 10.0  # a worker that ran this long before dying is restarted at once
FIRST_BACKOFF = 0.5  # seconds before restarting a worker that died soon after its start, doubled per such death
MAX_BACKOFF = 30.0
POLL_INTERVAL = 0.2
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


@dataclass
class Worker:
    """One worker process slot: restarts keep the slot (and its index), with a new process."""

    index: int
    proc: subprocess.Popen | None = None
    ready_pipe: int | None = None  # read end; the worker writes one byte once it serves, EOF when it exits
    started_at: float = 0.0
    serving: bool = False  # this process has served
    quick_deaths: int = 0  # deaths in a row within STABLE_AFTER of a start
    restart_at: float = 0.0

    def backoff(self, now: float) -> float:
        """Seconds to wait before the next start, after this process died at `now`."""
        self.quick_deaths = self.quick_deaths + 1 if now - self.started_at < STABLE_AFTER else 0
        return 0.0 if self.quick_deaths == 0 else min(MAX_BACKOFF, FIRST_BACKOFF * 2 ** (self.quick_deaths - 1))


class Supervisor:
    """Runs `config.listen.worker_count()` workers on `config.listen`'s port until SIGTERM/SIGINT."""

    def __init__(self, config: GatewayConfig, log_level: str, source: ConfigSource | None = None) -> None:
        self.config = config
        self.source = source  # the operator's file, reloaded on SIGHUP and when it changes
        self._source_seen = _signature(source.path) if source else None
        self._hung_up = False
        self.port = 0
        self.count = config.listen.worker_count()
        self.log_level = log_level
        self.workers = [Worker(i) for i in range(self.count)]
        self.stop_signal: int | None = None
        self.directory = Path()  # made in `run`: the workers' config file and metrics

    def run(self) -> int:
        host = self.config.listen.host
        process_secret()  # before any worker starts: every worker binds MCP sessions with the same secret
        if self.config.admin.enabled:
            try:
                admin_token(self.config.admin)
            except ConfigError as exc:
                print(f"portcullis: {exc}", file=sys.stderr)
                return START_FAILED
        try:
            reservation = _reserve(host, self.config.listen.port)
        except OSError as exc:
            print(f"portcullis: cannot listen: {exc}", file=sys.stderr)
            return START_FAILED
        port = reservation.getsockname()[1]
        self.directory = Path(tempfile.mkdtemp(prefix="portcullis-workers-"))
        previous = {s: signal.signal(s, self._on_stop_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, self._on_hangup)
        try:
            (self.directory / "metrics").mkdir()
            self.port = port
            self._write_config()
            log.info("starting %d workers on %s:%d", self.count, host, port)
            return self._supervise()
        finally:
            self._stop_workers()
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            shutil.rmtree(self.directory, ignore_errors=True)
            reservation.close()

    def _on_stop_signal(self, signum: int, frame: FrameType | None) -> None:
        self.stop_signal = signum

    def _on_hangup(self, signum: int, frame: FrameType | None) -> None:
        self._hung_up = True

    def _write_config(self) -> None:
        """The config as validated, with the port resolved: a worker re-reading the operator's file could find it
        edited since, and port 0 would give each worker a port of its own. Renamed into place: a worker reloading
        reads the old file or the new one, whole."""
        data = self.config.model_dump(mode="json", exclude_unset=True)
        data["listen"] = {**data.get("listen", {}), "host": self.config.listen.host, "port": self.port}
        written = self.directory / "portcullis.json.new"
        written.write_text(json.dumps(data))  # JSON is YAML
        os.replace(written, self.directory / "portcullis.json")

    def _reload_if_asked(self) -> None:
        """On SIGHUP or a change to the operator's file: validate it, then hand it to every worker."""
        if self.source is None:
            return
        seen = _signature(self.source.path)
        if not self._hung_up and seen == self._source_seen:
            return
        self._hung_up, self._source_seen = False, seen
        try:
            loaded = self.source.prepare(load_config(self.source.path))
            if restart := needing_restart(self.config, loaded):
                raise ConfigError(f"{self.source.path}: {', '.join(restart)}: changed, restart the gateway to apply")
        except ConfigError as exc:
            log.error("config reload refused, the workers serve on the last good config: %s", exc)
            return
        if loaded != self.config:
            self.config = loaded
            self._write_config()
        for worker in self.workers:
            if worker.proc is not None:
                with contextlib.suppress(ProcessLookupError):
                    worker.proc.send_signal(signal.SIGHUP)

    def _supervise(self) -> int:
        """Start every worker, then keep them running; returns when stopped, or when start-up failed."""
        all_served = False
        for worker in self.workers:
            self._launch(worker)
        while self.stop_signal is None:
            self._read_ready_pipes()
            self._reload_if_asked()
            now = time.monotonic()
            for worker in self.workers:
                if worker.proc is None:
                    if now >= worker.restart_at:
                        self._launch(worker)
                    continue
                status = worker.proc.poll()
                if status is None:
                    continue
                served = worker.serving or self._reported_serving(worker)
                self._reap(worker)
                if not all_served and not served:
                    log.error("worker %d exited with status %d before serving: stopping", worker.index, status)
                    return START_FAILED
                delay = worker.backoff(now)
                log.error("worker %d exited with status %d: restarting in %.1fs", worker.index, status, delay)
                worker.restart_at = now + delay
            if not all_served and all(w.serving for w in self.workers):
                all_served = True
                log.info("all %d workers serving", self.count)
        return 0

    def _launch(self, worker: Worker) -> None:
        read_end, write_end = os.pipe()
        command = [
            *(sys.executable, "-m", "gateway.cli", "serve", "--log-level", self.log_level),
            *("--config", str(self.directory / "portcullis.json")),
            *("--worker-index", str(worker.index), "--ready-fd", str(write_end)),
            *("--supervisor-pid", str(os.getpid())),
        ]
        env = {**os.environ, MULTIPROCESS_DIR_ENV: str(self.directory / "metrics")}
        try:
            worker.proc = subprocess.Popen(command, env=env, pass_fds=(write_end,), process_group=0)
        finally:
            os.close(write_end)  # the worker's copy is the only one: its exit reads as EOF
        worker.ready_pipe, worker.started_at, worker.serving = read_end, time.monotonic(), False
        log.info("worker %d started (pid %d)", worker.index, worker.proc.pid)

    def _read_ready_pipes(self) -> None:
        """Wait up to POLL_INTERVAL for a worker to report that it serves (or to exit)."""
        pipes = {w.ready_pipe: w for w in self.workers if w.ready_pipe is not None}
        if not pipes:
            time.sleep(POLL_INTERVAL)
            return
        readable, _, _ = select.select(list(pipes), [], [], POLL_INTERVAL)
        for fd in readable:
            worker = pipes[fd]
            worker.serving = os.read(fd, 1) != b""
            self._close_ready_pipe(worker)

    def _reported_serving(self, worker: Worker) -> bool:
        """Whether an exited worker's report that it served still waits, unread, in its pipe."""
        if worker.ready_pipe is None:
            return False
        readable, _, _ = select.select([worker.ready_pipe], [], [], 0)
        return bool(readable) and os.read(worker.ready_pipe, 1) != b""

    def _close_ready_pipe(self, worker: Worker) -> None:
        if worker.ready_pipe is not None:
            os.close(worker.ready_pipe)
            worker.ready_pipe = None

    def _reap(self, worker: Worker) -> None:
        """Forget an exited worker: its live gauges leave the metrics; its counters stay, as counters must."""
        assert worker.proc is not None
        multiprocess.mark_process_dead(worker.proc.pid, str(self.directory / "metrics"))
        self._close_ready_pipe(worker)
        worker.proc, worker.serving = None, False

    def _stop_workers(self) -> None:
        """Pass the stop signal on (SIGTERM if none came), then kill what is left after STOP_TIMEOUT."""
        started = [w.proc for w in self.workers if w.proc is not None]
        child_processes.stop(started, "worker", STOP_TIMEOUT, self.stop_signal or signal.SIGTERM)
        for worker in self.workers:
            if worker.proc is not None:
                self._reap(worker)


def _signature(path: Path) -> tuple[object, ...] | None:
    """What tells an edit of the file apart (a ConfigMap's swap makes it another file)."""
    try:
        found = path.stat()
    except OSError:
        return None
    return found.st_dev, found.st_ino, found.st_mtime_ns, found.st_size


def _reserve(host: str, port: int) -> socket.socket:
    """Hold the public port for the workers: bound with SO_REUSEPORT but not listening, so the kernel gives it no
    connections, while a process without SO_REUSEPORT (or of another user) cannot take the port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def follow_supervisor(supervisor_pid: int) -> None:
    """Be sent SIGTERM when the supervisor dies, however it dies (Linux); exit now if it died already."""
    if sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != supervisor_pid:  # it died before the request above took effect
        raise SystemExit(START_FAILED)


def without_admin(config: GatewayConfig) -> GatewayConfig:
    """A worker's config other than worker 0's: the admin listener is worker 0's alone."""
    return config.model_copy(update={"admin": config.admin.model_copy(update={"enabled": False})})


def report_serving(ready_fd: int) -> Callable[[], None]:
    """What a worker calls once it serves: one byte on the pipe its supervisor reads."""

    def report() -> None:
        with contextlib.suppress(OSError):  # a supervisor gone meanwhile: its death signal is on its way
            os.write(ready_fd, b".")
        os.close(ready_fd)

    return report
