"""The gateways measured and the services beside them: `portcullis serve` (this checkout's or an earlier commit's),
a local redis-server, and the LiteLLM proxy from its own venv."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from bench.harness.processes import Procs, Service, free_port, tail
from bench.harness.upstream import API_KEY, MODEL

REPO = Path(__file__).resolve().parents[2]
LITELLM_VENV = REPO / ".bench" / "litellm-venv"


def start_portcullis(
    procs: Procs,
    tmp: Path,
    name: str,
    upstream_port: int,
    access_log: bool,
    redis_url: str | None = None,
    policy: dict | None = None,
    store: str = "sqlite",
    static_key: bool = True,
    checkout: Path | None = None,
    workers: int = 1,
    response_cache: dict | None = None,
    served_by: Callable[[int], list[str]] | None = None,
) -> Service:
    """One gateway worker with the repo's policies, or `policy` alone; with `redis_url`, limits (and a `store` of
    'redis': keys and spend) in Redis. Its SQLite key store is a file of its own in `tmp` (see `sqlite_path`);
    `static_key`: the config's key (API_KEY) works, besides any stored one.

    `workers`: listen.workers (--workers-compare). `response_cache`: its config section (--cache).

    `checkout` runs an earlier commit's gateway (a `git worktree` of it) with this venv, for a side-by-side row; it
    gets the same config, less the admin listener.

    `served_by`: the command (given the port) of another ASGI server running the same app from $PORTCULLIS_CONFIG
    (bench/http_server_bench.py), in place of `portcullis serve`.
    """
    port = free_port()
    policy_dir = (checkout or REPO) / "policies"
    if policy is not None:
        policy_dir = tmp / f"{name}-policies"
        policy_dir.mkdir()
        (policy_dir / "base.yaml").write_text(json.dumps(policy))
    config: dict = {
        "listen": {"host": "127.0.0.1", "port": port},
        "pools": [{"name": "static", "replicas": [{"url": f"http://127.0.0.1:{upstream_port}"}]}],
        "auth": {"keys": [{"tenant": "bench", "sha256": hashlib.sha256(API_KEY.encode()).hexdigest()}]}
        if static_key
        else {},
        "policy_dir": str(policy_dir),
        "telemetry": {"access_log": access_log},
    }
    if workers != 1:
        config["listen"]["workers"] = workers
    admin_port = free_port()
    config["admin"] = {"port": admin_port, "token_file": str(tmp / f"{name}-admin-token")}  # not in $HOME
    config["store"] = {"backend": store, "sqlite_path": str(sqlite_path(tmp, name))}
    if checkout is not None:  # a gateway of before the admin token file, whose admin plane nothing here reads
        config["admin"] = {"enabled": False}
    if redis_url:
        config["redis"] = {"url": redis_url, "on_failure": "fail_closed", "timeout": 2.0}
    if response_cache is not None:
        config["response_cache"] = response_cache
    path = tmp / f"{name}.yaml"
    path.write_text(json.dumps(config, indent=2))  # JSON is YAML
    exe = Path(sys.prefix) / "bin" / "portcullis"
    if not exe.exists():
        exe = REPO / ".venv" / "bin" / "portcullis"
    # this checkout's code (or `checkout`'s) before the venv's editable install, which may be another checkout's
    env = {**os.environ, "PYTHONUNBUFFERED": "0", "PYTHONPATH": str(checkout or REPO)}
    argv = [str(exe), "serve", "--config", str(path)]
    if checkout is not None:
        argv = [sys.executable, "-P", "-m", "gateway.cli", "serve", "--config", str(path)]  # -P: not the cwd
    if served_by is not None:
        argv = served_by(port)
        env["PORTCULLIS_CONFIG"] = str(path)
    # stdout/stderr to a file, as a collector would take them: the access log is JSON lines on stderr.
    service = procs.start(name, argv, port, tmp / f"{name}.log", env=env)
    service.admin_port = admin_port
    return service


def sqlite_path(tmp: Path, name: str) -> Path:
    """The gateway `name`'s SQLite key store and spend ledger: one per gateway, none left in the working directory."""
    return tmp / f"{name}.db"


def start_redis(procs: Procs, tmp: Path) -> Service:
    """A local redis-server that keeps nothing on disk, ready for commands."""
    port = free_port()
    argv = [shutil.which("redis-server") or "redis-server", "--port", str(port), "--save", "", "--appendonly", "no"]
    redis = procs.start("redis", [*argv, "--dir", str(tmp)], port, tmp / "redis.log")
    deadline = time.monotonic() + 15
    while True:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1) as conn:
            conn.sendall(b"PING\r\n")
            if conn.recv(64).startswith(b"+PONG"):
                return redis
        if redis.proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"redis-server not ready on :{port}; see {redis.log_path}:\n{tail(redis.log_path)}")
        time.sleep(0.1)


def start_litellm(procs: Procs, tmp: Path, upstream_port: int) -> Service | None:
    exe = LITELLM_VENV / "bin" / "litellm"
    if not exe.exists():
        print(
            f"note: {exe} not found; LiteLLM row skipped (python -m venv .bench/litellm-venv && "
            f".bench/litellm-venv/bin/pip install 'litellm[proxy]')",
            file=sys.stderr,
        )
        return None
    port = free_port()
    config = {
        "model_list": [
            {
                "model_name": MODEL,
                "litellm_params": {
                    "model": f"openai/{MODEL}",
                    "api_base": f"http://127.0.0.1:{upstream_port}/v1",
                    "api_key": "dummy",
                },
            }
        ],
        "general_settings": {"master_key": API_KEY},
        "litellm_settings": {"telemetry": False, "set_verbose": False, "json_logs": False},
    }
    path = tmp / "litellm.yaml"
    path.write_text(json.dumps(config, indent=2))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHON"))}
    env.update(
        {
            "LITELLM_LOG": "ERROR",
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # do not fetch the model cost map from GitHub
            "LITELLM_TELEMETRY": "False",
            "DISABLE_ADMIN_UI": "True",
            "NO_DOCS": "True",
            "HOME": str(tmp),  # keep any caches it writes out of the real home
            "PATH": f"{LITELLM_VENV / 'bin'}:{os.environ.get('PATH', '')}",
        }
    )
    env.pop("DATABASE_URL", None)
    argv = [
        str(exe),
        "--config",
        str(path),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--num_workers",
        "1",
        "--telemetry",
        "False",
    ]
    return procs.start("litellm", argv, port, tmp / "litellm.log", env=env)


def litellm_version() -> str | None:
    python = LITELLM_VENV / "bin" / "python"
    if not python.exists():
        return None
    out = subprocess.run(
        [str(python), "-c", "from importlib.metadata import version; print(version('litellm'))"],
        capture_output=True,
        text=True,
    )
    return out.stdout.strip() or None
