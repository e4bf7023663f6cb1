"""Instructions per request of the gateway app driven in-process over ASGI, counted by callgrind.

    .venv/bin/python -m bench.asgi_instructions_bench [--checkout DIR] [--requests 800] [--warm 150]

Prints the instructions per proxied chat request of two apps, one after the other, each under its own callgrind:
`static key` (the config's key, no policy) and `static key + budget` (the same, with prices and one budget rule per
tenant that no run spends). No HTTP server is involved: requests are ASGI calls, eight at a time, against
the harness's static nginx upstream, so the figure is the app's own work (pipeline, upstream client, metrics,
billing), steady to about 0.5 % between runs of one build, which a VM shared with other jobs cannot move.
Instrumentation is switched on (`callgrind_control -i on`) only once the start-up work running in the background
(tokenizers) has had `--warm` seconds under valgrind to finish. `--checkout` measures another tree (a `git
worktree` of an earlier commit) with this venv. Needs valgrind and nginx.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
APPS = ("static key", "static key + budget")
BATCH = 8  # requests in flight at once


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkout", type=Path, default=REPO, help="the tree to measure (default: this one)")
    parser.add_argument("--requests", type=int, default=800)
    parser.add_argument("--warm", type=float, default=150.0, help="seconds under valgrind before counting")
    parser.add_argument("--app", choices=APPS, help=argparse.SUPPRESS)  # one app, run under callgrind
    args = parser.parse_args()
    if args.app:
        import uvloop  # the loop `portcullis serve` runs on

        return uvloop.run(_drive(args.app, args.checkout, args.requests, args.warm))
    for app in APPS:
        print(f"{app}: {_count(app, args):,} instructions per request", flush=True)
    return 0


def _count(app: str, args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        argv = [sys.executable, str(Path(__file__).resolve()), "--app", app, "--checkout", str(args.checkout)]
        argv += ["--requests", str(args.requests), "--warm", str(args.warm)]
        run = subprocess.run(
            ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}", *argv],
            capture_output=True,
            text=True,
        )
        found = re.findall(r"Collected : (\d+)", run.stderr)
        if run.returncode != 0 or not found:
            raise RuntimeError(f"{app}: valgrind failed ({run.returncode}):\n{run.stderr[-3000:]}")
        return round(int(found[-1]) / args.requests)


async def _drive(app: str, checkout: Path, requests: int, warm: float) -> int:
    sys.path[:0] = [str(checkout), str(REPO)]
    from bench.harness.processes import Procs
    from bench.harness.upstream import API_KEY, start_static_upstream
    from bench.proxy.keys import BUDGETS_POLICY, NO_BUDGETS_POLICY
    from gateway.app import build_app
    from gateway.config import GatewayConfig

    tmp = Path(tempfile.mkdtemp(prefix="portcullis-asgi-bench-"))
    procs = Procs()
    try:
        upstream = start_static_upstream(procs, tmp)
        policy = BUDGETS_POLICY if app.endswith("budget") else NO_BUDGETS_POLICY
        (tmp / "policies").mkdir()
        (tmp / "policies" / "base.yaml").write_text(json.dumps(policy))
        config = GatewayConfig.model_validate(
            {
                "listen": {"host": "127.0.0.1", "port": 18080},
                "pools": [{"name": "static", "replicas": [{"url": f"http://127.0.0.1:{upstream.port}"}]}],
                "auth": {"keys": [{"tenant": "bench", "sha256": hashlib.sha256(API_KEY.encode()).hexdigest()}]},
                "policy_dir": str(tmp / "policies"),
                "telemetry": {"access_log": False},
                "store": {"backend": "sqlite", "sqlite_path": str(tmp / "store.db")},
            }
        )
        gateway = build_app(config)
        await _start(gateway)
        for _ in range(50):  # the first requests load tokenizers and fill caches
            await _request(gateway)
        await asyncio.sleep(warm)
        subprocess.run(["callgrind_control", "-i", "on", str(os.getpid())], capture_output=True, check=True)
        await asyncio.gather(*(_requests(gateway, requests // BATCH) for _ in range(BATCH)))
        subprocess.run(["callgrind_control", "-i", "off", str(os.getpid())], capture_output=True, check=True)
    finally:
        procs.stop_all()
    return 0


async def _start(app) -> None:
    """Run the app's lifespan start-up (and leave it running)."""
    inbox: asyncio.Queue = asyncio.Queue()
    outbox: asyncio.Queue = asyncio.Queue()
    await inbox.put({"type": "lifespan.startup"})
    scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}
    asyncio.get_running_loop().create_task(app(scope, inbox.get, outbox.put))
    started = await outbox.get()
    if started["type"] != "lifespan.startup.complete":
        raise RuntimeError(f"the app did not start: {started}")


async def _requests(app, count: int) -> None:
    for _ in range(count):
        await _request(app)


async def _request(app) -> None:
    from bench.harness.upstream import API_KEY, REQUEST

    body = json.dumps(REQUEST, separators=(",", ":")).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"127.0.0.1:18080"),
            (b"authorization", b"Bearer " + API_KEY.encode()),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ],
        "client": ("127.0.0.1", 40000),
        "server": ("127.0.0.1", 18080),
        "state": {},
    }
    sent, status = False, 0

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # the client stays until the answer is over
        return {}

    async def send(message: dict) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]

    await app(scope, receive, send)
    if status != 200:
        raise RuntimeError(f"the gateway answered {status}")


if __name__ == "__main__":
    sys.exit(main())
