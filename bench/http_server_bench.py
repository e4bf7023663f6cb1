"""The gateway's app under each HTTP server worth a look, CPU per proxied request: where the HTTP layer is the cost.

    .venv/bin/python -m bench.http_server_bench --rounds 5 --duration 5          # CPU µs a request, alternating
    .venv/bin/python -m bench.http_server_bench --instructions --seconds 20     # instructions a request (callgrind)

Every server runs the same config and app (auth on, the repository's policies, access log off) before
proxy_bench.py's static nginx upstream, one worker process: `portcullis` is `portcullis serve` (uvicorn's httptools
protocol behind gateway/edge/http_server.py's bounds); the others run bench/proxy/asgi_app.py's factory with no bound of
their own set (`uvicorn-httptools`, `uvicorn-h11`, `granian`, `hypercorn`). nginx as a reverse proxy before the
same upstream is the floor.

CPU: every target starts at once; each round measures each one, in an order that rotates between rounds, under
`wrk -c32`, as the user+system CPU of its process tree over the requests completed; reported are the median and the
range over rounds. On a VM shared with other jobs the rounds spread by a third; the instruction count does not:
each target, one at a time, runs under `valgrind --tool=callgrind --trace-children=yes` (a server's worker
processes included; nginx is not counted) with instrumentation off until it has warmed up, then on for `--seconds`
of `wrk -c4`, less what it does idle over as long (bench/instructions_bench.py). Needs nginx and wrk; valgrind.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench.harness.gateways import start_portcullis
from bench.harness.processes import Procs, Service, tree_cpu_seconds, tree_pids, wait_http, wait_tree_idle
from bench.harness.report import machine
from bench.harness.upstream import API_KEY, check_chat, start_nginx, start_static_upstream
from bench.harness.wrk import run_wrk, write_wrk_script
from bench.instructions_bench import wrk

FACTORY = "bench.proxy.asgi_app:app"
PY = sys.executable


def _uvicorn(http: str) -> Callable[[int], list[str]]:
    def argv(port: int) -> list[str]:
        return [PY, "-m", "uvicorn", "--factory", FACTORY, "--host", "127.0.0.1", "--port", str(port)] + [
            *("--loop", "uvloop", "--http", http, "--ws", "none", "--lifespan", "on"),
            *("--no-access-log", "--no-proxy-headers", "--log-level", "warning"),
        ]

    return argv


def _granian(*options: str) -> Callable[[int], list[str]]:
    def argv(port: int) -> list[str]:
        return [PY, "-m", "granian", "--interface", "asgi", "--factory", "--host", "127.0.0.1", "--port", str(port)] + [
            *("--workers", "1", "--runtime-threads", "1", "--loop", "uvloop", "--no-ws", "--no-access-log"),
            *("--log-level", "warning", *options, FACTORY),
        ]

    return argv


def _hypercorn(port: int) -> list[str]:
    """In the process it starts (0 workers): its worker processes are daemonic, and the gateway starts its own."""
    return [PY, "-m", "hypercorn", "--worker-class", "uvloop", "--workers", "0", "--bind", f"127.0.0.1:{port}"] + [
        f"{FACTORY}()"
    ]


# name -> the command serving the gateway's app on a port; None: `portcullis serve`
SERVERS: dict[str, Callable[[int], list[str]] | None] = {
    "portcullis": None,
    "uvicorn-httptools": _uvicorn("httptools"),
    "uvicorn-h11": _uvicorn("h11"),
    "granian": _granian(),
    "granian-rust-tasks": _granian("--task-impl", "rust"),  # its own task implementation in place of asyncio's
    "socketify": lambda port: (
        [PY, "-m", "socketify", "bench.proxy.asgi_app:served", "--port", str(port)]
        + ["--interface", "asgi", "--ws", "none", "--lifespan", "on", "--disable-listen-log", "true"]
    ),
    "hypercorn": _hypercorn,
}
NGINX = "nginx_proxy"


def start_target(procs: Procs, tmp: Path, name: str, upstream: Service) -> Service:
    """`name` (a server, or nginx as a reverse proxy) before the static upstream, answering a chat request."""
    if name == NGINX:
        target = start_nginx(procs, tmp, NGINX, "proxy.conf.tmpl", UPSTREAM_PORT=upstream.port)
        wait_http(target, "/v1/models", 60)
        return target
    target = start_portcullis(procs, tmp, name, upstream.port, False, served_by=SERVERS[name])
    wait_http(target, "/healthz", 900)
    check_chat(target.port)
    return target


def cpu_rounds(names: list[str], rounds: int, duration: float, warmup: float) -> dict[str, dict]:
    """Median and range over `rounds` of each target's RPS and CPU µs a request at 32 connections."""
    tmp = Path(tempfile.mkdtemp(prefix="portcullis-http-servers-"))
    tmp.chmod(0o755)
    procs = Procs()
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    try:
        lua = write_wrk_script(tmp / "chat.lua", API_KEY)
        static = start_static_upstream(procs, tmp)
        targets = {name: start_target(procs, tmp, name, static) for name in names}
        for target in targets.values():
            wait_tree_idle(target.proc.pid)
        for round_ in range(rounds):
            for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
                port, pid = targets[name].port, targets[name].proc.pid
                run_wrk(port, lua, 32, warmup)
                cpu0 = tree_cpu_seconds(pid)
                result = run_wrk(port, lua, 32, duration)
                cpu = tree_cpu_seconds(pid) - cpu0
                if result["errors"] or not result["requests"]:
                    raise RuntimeError(f"{name}: {result['errors']} failed requests of {result['requests']}")
                samples[name].append((result["rps"], cpu / result["requests"] * 1e6))
                print(f"round {round_ + 1} {name}: {samples[name][-1][0]:,.0f} RPS, {samples[name][-1][1]:.1f} µs")
    finally:
        procs.stop_all()
    return {
        name: {
            "rps": round(statistics.median(r for r, _ in runs)),
            "rps_range": [round(min(r for r, _ in runs)), round(max(r for r, _ in runs))],
            "cpu_us": round(statistics.median(c for _, c in runs), 1),
            "cpu_us_range": [round(min(c for _, c in runs), 1), round(max(c for _, c in runs), 1)],
        }
        for name, runs in samples.items()
    }


def instructions(name: str, seconds: int) -> dict:
    """Instructions a request of `name`'s whole process tree under callgrind (bench/instructions_bench.py)."""
    tmp = Path(tempfile.mkdtemp(prefix=f"portcullis-http-servers-{name}-"))
    tmp.chmod(0o755)
    procs = Procs()
    start = Procs.start

    def under_valgrind(self: Procs, label: str, argv: list[str], *args: object, **kwargs: object) -> Service:
        if label == name:
            out = tmp / f"{name}.%p.callgrind"
            argv = ["valgrind", "--tool=callgrind", "--trace-children=yes", "--instr-atstart=no"] + [
                f"--callgrind-out-file={out}",
                *argv,
            ]
        return start(self, label, argv, *args, **kwargs)

    Procs.start = under_valgrind  # type: ignore[method-assign]
    try:
        lua = write_wrk_script(tmp / "chat.lua", API_KEY)
        static = start_static_upstream(procs, tmp, "static-upstream")
        target = start_target(procs, tmp, name, static)
        wrk(target.port, lua, 1, 30, counted=False)  # what is lazy loads; then the steady state
        wrk(target.port, lua, 4, 15, counted=False)
        pids = [str(pid) for pid in tree_pids(target.proc.pid)]
        for action in ("--instr=on", "--zero"):
            for pid in pids:
                control(action, pid)
        requests = wrk(target.port, lua, 4, seconds)
        counted = dumped(tmp, name, pids)
        time.sleep(seconds)
        idle = dumped(tmp, name, pids)
        return {
            "requests": requests,
            "per_request": round(counted / requests),
            "per_request_less_idle": round((counted - idle) / requests),
        }
    finally:
        Procs.start = start  # type: ignore[method-assign]
        procs.stop_all()


def control(action: str, pid: str) -> None:
    """`callgrind_control` on one process of the tree. Not every one runs under valgrind (a tracker), and one that
    sleeps in a signal wait (nginx's master) never answers: it runs no request's code, so it is given up on."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        subprocess.run(["callgrind_control", action, pid], capture_output=True, timeout=15)


def dumped(tmp: Path, name: str, pids: list[str]) -> int:
    """The instructions the tree's processes ran since their last dump (or zeroing), summed."""
    before = set(tmp.glob(f"{name}.*.callgrind*"))
    for pid in pids:
        control("--dump", pid)
    time.sleep(2)
    total = 0
    for dump in set(tmp.glob(f"{name}.*.callgrind*")) - before:
        with contextlib.suppress(ValueError):
            total += max(
                int(line.split()[1])
                for line in dump.read_text(errors="replace").splitlines()
                if line.startswith(("summary:", "totals:"))
            )
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=[*SERVERS, NGINX], help="these targets (default: all)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--duration", type=float, default=5.0, help="seconds of counted load a round")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds of load before each counted one")
    parser.add_argument("--instructions", action="store_true", help="instructions a request, under callgrind")
    parser.add_argument("--seconds", type=int, default=20, help="--instructions: seconds of counted load")
    args = parser.parse_args()
    names = args.only or [*SERVERS, NGINX]
    if args.instructions:
        names = [name for name in names if name != NGINX]  # its master and worker under valgrind served nothing
        counts = {}
        for name in names:
            counts[name] = row = instructions(name, args.seconds)
            print(
                f"{name:18} {row['per_request_less_idle']:>10,} instructions a request less idle, "
                f"{row['per_request']:>10,} in all ({row['requests']} requests)",
                flush=True,
            )
        print(json.dumps({"machine": machine(), "instructions": counts}))
        return 0
    rows = cpu_rounds(names, args.rounds, args.duration, args.warmup)
    for name, row in rows.items():
        print(
            f"{name:18} {row['cpu_us']:>7} µs a request ({row['cpu_us_range'][0]}–{row['cpu_us_range'][1]}), "
            f"{row['rps']:>7,} RPS ({row['rps_range'][0]:,}–{row['rps_range'][1]:,})"
        )
    print(json.dumps({"machine": machine(), "cpu": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
