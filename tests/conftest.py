"""Shared fixtures: real processes on free loopback ports (fake upstreams, the gateway), started and reaped."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Container, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared"
STATE_ENV = "XDG_STATE_HOME"  # where a gateway without admin.token_env keeps its generated admin token


def free_port(avoid: Container[int] = ()) -> int:
    """A loopback port free now and not in `avoid`: the kernel may hand out again a port it has just given."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in avoid:
            return port


@dataclass
class Process:
    url: str
    proc: subprocess.Popen
    log: Path
    admin_url: str = ""  # a gateway's admin plane (metrics, detailed readiness, policy status)
    admin_token: str = ""  # the bearer token its admin plane requires
    _terminated: bool = False
    _admin: httpx.Client | None = None

    @property
    def admin(self) -> httpx.Client:
        """A client of the admin plane that sends its token, as an operator's tools do: `gw.admin.get("/metrics")`.
        It keeps no connection open between calls, so a test that stops the gateway waits for none to go idle."""
        if self._admin is None:
            headers = {"authorization": f"Bearer {self.admin_token}"}
            no_keepalive = httpx.Limits(max_keepalive_connections=0)
            self._admin = httpx.Client(base_url=self.admin_url, headers=headers, timeout=10, limits=no_keepalive)
        return self._admin

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def access_log(self, request_id: str) -> dict:
        """A gateway's access-log line for one request (it is written once the response has ended)."""
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            for line in self.output().splitlines():
                if request_id in line and '"trace_id"' in line:
                    return json.loads(line)
            time.sleep(0.05)
        raise AssertionError(f"no access-log line for {request_id}")

    def terminate(self) -> None:
        """Ask it to stop (SIGTERM), once; `stop` waits for it."""
        if self.proc.poll() is None and not self._terminated:
            self.proc.terminate()
            self._terminated = True

    def stop(self) -> None:
        if self._admin is not None:
            self._admin.close()
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def generated_token_file(env: dict[str, str]) -> Path:
    """Where a gateway started with `env` added to the environment (and no admin.token_env) keeps its admin token."""
    full = {**os.environ, **env}
    state_home = Path(full[STATE_ENV]) if full.get(STATE_ENV) else Path(full["HOME"]) / ".local" / "state"
    return state_home / "portcullis" / "admin-token"


def generated_admin_token(state_home: Path) -> str:
    """The admin token a gateway started with `$XDG_STATE_HOME` = `state_home` (and no admin.token_env) generated."""
    return generated_token_file({STATE_ENV: str(state_home)}).read_text().strip()


def admin_token_of(admin: dict, env: dict[str, str]) -> str:
    """The admin token of a gateway started with config `admin:` and `env` added to the environment; "" with none."""
    if not admin.get("enabled", True):
        return ""
    if admin.get("token_env"):
        return {**os.environ, **env}[admin["token_env"]]
    if admin.get("token_file"):
        return Path(admin["token_file"]).read_text().strip()
    return generated_token_file(env).read_text().strip()


def spawn(
    cmd: list[str],
    port: int,
    log: Path,
    ready_path: str = "/healthz",
    timeout: float = 60.0,
    env: dict[str, str] | None = None,
) -> Process:
    """Start `cmd` and wait until GET ready_path answers; fail with its output if it dies or never answers."""
    out = log.open("wb")
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    process = Process(url, proc, log)
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=1.0) as client:  # one client: each new one builds a TLS context, 10-60 ms of CPU
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{cmd} exited with {proc.returncode}:\n{process.output()}")
            with contextlib.suppress(httpx.HTTPError):
                if client.get(url + ready_path).status_code < 500:
                    return process
            time.sleep(0.05)
    process.stop()
    raise RuntimeError(f"{cmd} did not become ready in {timeout}s:\n{process.output()}")


class Launcher:
    """Starts real processes on free loopback ports, logging into one directory, and stops them all at teardown.

    `launcher` gives each test its own; `module_launcher` shares one by a test module, for the tests that can use the
    same gateway configuration: each process costs a second or two of CPU to start, and a suite that started one per
    test spent most of its time doing so. A test that changes a shared process's state (kills it, fills a limit,
    counts what its upstream saw) takes its own."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.started: list[Process] = []

    def spawn(self, cmd: Callable[[int], list[str]], name: str, avoid: Container[int] = (), **options) -> Process:
        """`cmd(port)` on a free port not in `avoid`, retried on another if that port was taken meanwhile (parallel
        test workers draw from the same ports)."""
        for attempt in range(3):
            port = free_port(avoid)
            try:
                process = spawn(cmd(port), port, self.directory / f"{name}-{port}.log", **options)
            except RuntimeError as e:
                if "address already in use" not in str(e).lower() or attempt == 2:
                    raise
                continue
            self.started.append(process)
            return process
        raise AssertionError("unreachable")

    def fake_upstream(self, name: str = "fake", fail_status: int | None = None) -> Process:
        """A fake OpenAI-compatible upstream (tests/fake_upstream.py)."""

        def cmd(port: int) -> list[str]:
            args = [sys.executable, str(ROOT / "tests" / "fake_upstream.py"), "--port", str(port), "--name", name]
            return args + (["--fail-status", str(fail_status)] if fail_status else [])

        return self.spawn(cmd, f"upstream-{name}", ready_path="/_stats")

    def gateway(self, config: dict, env: dict[str, str] | None = None) -> Process:
        """`portcullis serve` with `config` (listen and admin ports and the key store's file filled in). Without
        `admin.token_env` it generates its admin token in this launcher's directory, never in the user's own."""
        admin_port = free_port()
        env = {STATE_ENV: str(self.directory / "state"), **(env or {})}

        def cmd(port: int) -> list[str]:
            full = {
                **config,
                "listen": {"host": "127.0.0.1", "port": port},
                "admin": {"port": admin_port, **config.get("admin", {})},
                "store": {"sqlite_path": str(self.directory / f"portcullis-{port}.db"), **config.get("store", {})},
            }
            path = self.directory / f"portcullis-{port}.yaml"
            path.write_text(yaml.safe_dump(full))
            return [sys.executable, "-m", "gateway.cli", "serve", "--config", str(path)]

        process = self.spawn(cmd, "gateway", avoid={admin_port}, env=env)
        process.admin_url = f"http://127.0.0.1:{admin_port}"
        process.admin_token = admin_token_of(config.get("admin", {}), env)
        return process

    def stop_all(self) -> None:
        """Stop them all at once (a gateway's shutdown takes a second or more), the last started asked first."""
        for process in reversed(self.started):
            process.terminate()
        for process in reversed(self.started):
            process.stop()
        self.started.clear()


@pytest.fixture
def launcher(tmp_path: Path) -> Iterator[Launcher]:
    started = Launcher(tmp_path)
    yield started
    started.stop_all()


@pytest.fixture(scope="module")
def module_launcher(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launcher]:
    started = Launcher(tmp_path_factory.mktemp("module"))
    yield started
    started.stop_all()


@pytest.fixture
def processes(launcher: Launcher) -> list[Process]:
    """The processes this test started; they are stopped when it ends, and so is anything appended here."""
    return launcher.started


@pytest.fixture
def fake_upstream(launcher: Launcher) -> Callable[..., Process]:
    """Start a fake OpenAI-compatible upstream for this test: fake_upstream(name="a", fail_status=None)."""
    return launcher.fake_upstream


@pytest.fixture
def gateway(launcher: Launcher) -> Callable[..., Process]:
    """Start `portcullis serve` for this test with a config dict: gateway(config, env={...})."""
    return launcher.gateway


def pool(name: str, *urls: str, **options) -> dict:
    """A pool entry for a gateway config."""
    return {"name": name, "replicas": [{"url": u} for u in urls], **options}


def chat_body(**extra) -> dict:
    return {"model": "test-model", "messages": [{"role": "user", "content": "hello"}], **extra}


@dataclass
class RedisServer:
    """A real redis-server on a free loopback port; `kill` and `restart` for fault tests."""

    port: int
    directory: Path
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.directory),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                return
            time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def client(self):
        import redis

        return redis.Redis.from_url(self.url)


class Partition:
    """A TCP relay to a loopback port, for one client to reach a server through: `cut` drops every connection through
    it and refuses new ones (a network partition between that client and the server, which others still reach),
    `heal` lets connections through again on the same port."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self._listener: socket.socket | None = None
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.heal()

    def heal(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, args=(self._listener,), daemon=True).start()

    def cut(self) -> None:
        assert self._listener is not None
        with contextlib.suppress(OSError):  # cut already
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
        self._listener.close()
        with self._lock:
            for conn in self._connections:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
            self._connections.clear()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
                server = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                return
            with self._lock:
                self._connections.update((client, server))
            threading.Thread(target=self._pipe, args=(client, server), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        for conn in (source, sink):
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed: `make test` installs it (apt-get install redis-server)")
    server = RedisServer(free_port(), tmp_path)
    server.start()
    yield server
    server.kill()


@pytest.fixture(scope="module")
def module_redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One redis-server for a test module, for tests that keep to keys of their own (a tenant, a rule id); a test that
    kills or restarts Redis, or empties it, takes `redis_server`."""
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed: `make test` installs it (apt-get install redis-server)")
    server = RedisServer(free_port(), tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.kill()


def policy_dir(tmp_path: Path, rate_limits: list[dict], overlays: dict[str, list[dict]] | None = None) -> str:
    """Write a policy directory with a base policy (and tenant overlays); returns its path for the config."""
    directory = tmp_path / "policies"
    (directory / "tenants").mkdir(parents=True, exist_ok=True)
    base = {
        "apiVersion": "portcullis.dev/v1",
        "kind": "Policy",
        "metadata": {"name": "test"},
        "spec": {"rate_limits": rate_limits},
    }
    (directory / "base.yaml").write_text(yaml.safe_dump(base))
    for tenant, rules in (overlays or {}).items():
        overlay = {
            "apiVersion": "portcullis.dev/v1",
            "kind": "TenantPolicy",
            "metadata": {"name": tenant},
            "tenant": tenant,
            "spec": {"rate_limits": rules},
        }
        (directory / "tenants" / f"{tenant}.yaml").write_text(yaml.safe_dump(overlay))
    return str(directory)
