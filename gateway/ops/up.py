"""`portcullis up`: the whole stack on one machine — bundled engine replicas plus the gateway in front of them.

This is what `make run` starts: no config file, no Redis, no other service. Engines run as child processes on
consecutive loopback ports; the gateway runs in this process (with `--workers`, this process supervises gateway
workers: gateway/ops/workers.py) and stops them whenever it exits: SIGTERM, SIGINT, a gateway that fails to start or
stops, an engine that never becomes healthy. An engine that dies while the
gateway runs is logged at once (its pool goes on with the other replicas). Only SIGKILL leaves them running.

`--otlp-endpoint` sends the gateway's spans and the engines' to one OTLP/HTTP collector, so that a request's trace
runs from the gateway's stages to the engine's decode (`make demo` points it at Arize Phoenix: gateway/demo/).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Literal

from gateway.admin.cli import DEFAULT_URL as DEFAULT_ADMIN_URL
from gateway.admin.token import token_file
from gateway.config import (
    AdminConfig,
    ConfigError,
    GatewayConfig,
    ListenConfig,
    OtlpConfig,
    PoolConfig,
    ReplicaConfig,
    TelemetryConfig,
)
from gateway.observability import log_format
from gateway.ops import child_processes

ENGINE_START_TIMEOUT = 300.0
ENGINE_STOP_TIMEOUT = 10.0  # after SIGTERM, then SIGKILL
log = logging.getLogger(__name__)
DEFAULT_MODEL = "SmolLM2-135M-Instruct"


def add_subcommand(commands: argparse._SubParsersAction) -> None:
    up = commands.add_parser("up", help="start engine replicas and the gateway in front of them (make run)")
    up.add_argument("--replicas", type=int, default=2, help="bundled engine replicas to start")
    up.add_argument("--engine-port", type=int, default=8001, help="first engine port; replicas count up from it")
    up.add_argument("--port", type=int, default=8080, help="gateway port")
    up.add_argument("--admin-port", type=int, default=9901, help="admin plane port (metrics, readiness, policy)")
    up.add_argument(
        "--workers",
        type=_workers,
        default=1,
        help="gateway processes on the port (listen.workers): a number or 'auto'; the engines need cores too",
    )
    up.add_argument(
        "--policy-dir", type=Path, default=Path("policies"), help="the policy directory (policy_dir; default: policies)"
    )
    up.add_argument(
        "--otlp-endpoint",
        metavar="URL",
        help="export traces over OTLP/HTTP to this collector (e.g. http://127.0.0.1:4318), the gateway's and the "
        "engines' spans alike, so one trace runs from the edge to the engine's decode; default: tracing off",
    )
    up.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    log_format.add_argument(up)  # the engines' lines too
    up.set_defaults(func=run_up)


def run_up(args: argparse.Namespace) -> int:
    from gateway.app import build_app
    from gateway.edge.http_server import serve
    from gateway.observability.log_writer import configure_logging
    from gateway.ops.workers import START_FAILED, Supervisor

    configure_logging(args.log_level, args.log_format)
    ports = [args.engine_port + i for i in range(args.replicas)]
    engines: list[subprocess.Popen] = []
    stopping = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _exit_on_signal)
    try:
        for port in ports:
            engines.append(_start_engine(port, args.otlp_endpoint))
        for port, engine in zip(ports, engines):
            _wait_healthy(port, engine)
        for port, engine in zip(ports, engines):
            _report_exit(port, engine, stopping)
        config = GatewayConfig(
            listen=ListenConfig(port=args.port, workers=args.workers),
            admin=AdminConfig(port=args.admin_port),
            policy_dir=args.policy_dir,
            telemetry=_telemetry(args.otlp_endpoint),
            pools=[
                PoolConfig(
                    name="engine",
                    routing="kv_events",
                    replicas=[ReplicaConfig(url=f"http://127.0.0.1:{p}") for p in ports],
                )
            ],
        )
        banner = _banner(args.port, args.admin_port, ports, token_file(config.admin), args.otlp_endpoint)
        print(banner, file=sys.stderr, flush=True)
        if config.listen.worker_count() > 1:
            return Supervisor(config, args.log_level).run()
        serve(build_app(config), config, config.listen.host, args.port)
    except ConfigError as exc:  # the admin token's file cannot be read or made
        print(f"portcullis up: {exc}", file=sys.stderr)
        return START_FAILED
    finally:
        stopping.set()
        _stop_engines(engines)
    return 0


def _workers(text: str) -> int | Literal["auto"]:
    try:
        return ListenConfig(workers="auto" if text == "auto" else int(text)).workers
    except ValueError:  # pydantic's ValidationError is one
        raise argparse.ArgumentTypeError(f"a whole number of processes (1 or more) or 'auto', not {text!r}") from None


def _exit_on_signal(signum: int, frame: object) -> None:
    """Leave through `run_up`'s `finally`. SIGTERM's default action ends the process on the spot, engines left
    running; and once the gateway has shut down, uvicorn raises the signal it caught again, which lands here."""
    raise SystemExit(128 + signum)


def _stop_engines(engines: list[subprocess.Popen]) -> None:
    """SIGTERM every engine, then SIGKILL those not gone within ENGINE_STOP_TIMEOUT. A second Ctrl-C or SIGTERM
    meanwhile is ignored, so it cannot cut this short."""
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_IGN)
    child_processes.stop(engines, "engine", ENGINE_STOP_TIMEOUT)


def _report_exit(port: int, engine: subprocess.Popen, stopping: threading.Event) -> None:
    """Log an engine's death as it happens, not when someone wonders why half the requests fail."""

    def watch() -> None:
        status = engine.wait()
        if not stopping.is_set():
            log.error(
                "engine on port %d (pid %d) exited with status %d; the gateway goes on without it",
                port,
                engine.pid,
                status,
            )

    threading.Thread(target=watch, name=f"engine-{port}", daemon=True).start()


def _telemetry(otlp_endpoint: str | None) -> TelemetryConfig:
    if otlp_endpoint is None:
        return TelemetryConfig()
    return TelemetryConfig(otlp=OtlpConfig(enabled=True, endpoint=otlp_endpoint, protocol="http/protobuf"))


def _start_engine(port: int, otlp_endpoint: str | None) -> subprocess.Popen:
    """An engine replica; with an OTLP endpoint it exports its spans there too (the engine reads the standard
    OpenTelemetry variable), continuing the gateway's traceparent."""
    cmd = [sys.executable, "-m", "gateway.cli", "engine", "serve", "--host", "127.0.0.1", "--port", str(port)]
    env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": otlp_endpoint} if otlp_endpoint else None
    return subprocess.Popen(cmd, env=env)


def _wait_healthy(port: int, engine: subprocess.Popen) -> None:
    try:
        child_processes.wait_ready(
            f"http://127.0.0.1:{port}/health", engine, f"engine on port {port}", ENGINE_START_TIMEOUT
        )
    except child_processes.NotReady as exc:
        raise SystemExit(f"portcullis up: {exc}") from None


def _banner(
    port: int, admin_port: int, engine_ports: list[int], admin_token_file: Path, otlp_endpoint: str | None
) -> str:
    base = f"http://127.0.0.1:{port}"
    traces = f"Traces (gateway and engines): OTLP/HTTP to {otlp_endpoint}\n\n" if otlp_endpoint else ""
    admin = f"http://127.0.0.1:{admin_port}"
    keys = "portcullis keys list" + ("" if admin == DEFAULT_ADMIN_URL else f" --admin-url {admin}")
    return f"""
Portcullis is up: gateway {base} -> engines {", ".join(f"127.0.0.1:{p}" for p in engine_ports)}

  curl {base}/v1/chat/completions -H 'content-type: application/json' \\
    -d '{{"model": "{DEFAULT_MODEL}", "messages": [{{"role": "user", "content": "Say hello"}}], "max_tokens": 32}}'

  python -c 'from openai import OpenAI
c = OpenAI(base_url="{base}/v1", api_key="unused")
for ch in c.chat.completions.create(model="{DEFAULT_MODEL}", stream=True, max_tokens=32,
        messages=[{{"role": "user", "content": "Say hello"}}]):
    print(ch.choices[0].delta.content or "", end="", flush=True) if ch.choices else None'

  Also served: {base}/v1/responses (Responses, typed stream events), {base}/v1/embeddings,
  {base}/v1/messages (Anthropic's Messages API: anthropic.Anthropic(base_url="{base}", api_key="unused"))

Admin plane (loopback only, with the admin token kept in {admin_token_file}):
  {keys}        (finds the token itself)
  curl -H "authorization: Bearer $(cat {admin_token_file})" {admin}/metrics     also /readyz, /admin/policy

{traces}Stop: Ctrl-C
"""
