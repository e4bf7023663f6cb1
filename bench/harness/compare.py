"""Policy variants side by side through the proxy (a stage off and on, or an earlier commit's gateway): the WAF's and
the guard's `--proxy` mode."""

from __future__ import annotations

import collections
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

from bench.harness.processes import Procs, free_port, wait_http, wait_idle
from bench.harness.report import loadavg, machine
from bench.harness.upstream import API_KEY, REQUEST, check_chat, start_static_upstream
from bench.harness.wrk import VARY_LUA, WRK_LUA, measure, pick_median


def compare_policies(
    name: str,
    specs: dict[str, dict],
    duration: float,
    repeat: int,
    request: dict | None = None,
    headers: dict[str, str] | None = None,
    checkouts: dict[str, Path] | None = None,
) -> int:
    """One static upstream and one gateway per policy `spec` variant (e.g. a stage off and on), measured side by side
    with wrk like the proxy benchmark; used by the WAF and guard benchmarks' --proxy mode. A variant named in
    `checkouts` runs that earlier commit's gateway (a `git worktree` of it) with this venv."""
    request = request or REQUEST
    tmp = Path(tempfile.mkdtemp(prefix=f"portcullis-{name}-bench-"))
    tmp.chmod(0o755)
    procs = Procs()
    try:
        lua = tmp / "chat.lua"
        body = json.dumps(request, separators=(",", ":"))
        script = WRK_LUA.replace("@BODY@", body).replace("@KEY@", API_KEY) + (VARY_LUA if "@N@" in body else "")
        for header, value in (headers or {}).items():
            script = script.replace('wrk.method = "POST"', f'wrk.method = "POST"\nwrk.headers["{header}"] = "{value}"')
        lua.write_text(script)
        static = start_static_upstream(procs, tmp)
        targets = {}
        for variant, spec in specs.items():
            policies = tmp / f"{variant}-policies"
            policies.mkdir()
            (policies / "base.yaml").write_text(
                json.dumps(
                    {"apiVersion": "portcullis.dev/v1", "kind": "Policy", "metadata": {"name": variant}, "spec": spec}
                )
            )
            port = free_port()
            config = {
                "listen": {"host": "127.0.0.1", "port": port},
                "pools": [{"name": "static", "replicas": [{"url": f"http://127.0.0.1:{static.port}"}]}],
                "auth": {"keys": [{"tenant": "bench", "sha256": hashlib.sha256(API_KEY.encode()).hexdigest()}]},
                "policy_dir": str(policies),
                "telemetry": {"access_log": False},
                "admin": {"enabled": False},  # one admin port for all variants would clash; nothing here reads it
            }
            path = tmp / f"{variant}.yaml"
            path.write_text(json.dumps(config))
            argv = [str(Path(sys.prefix) / "bin" / "portcullis"), "serve", "--config", str(path)]
            env = dict(os.environ)
            if variant in (checkouts or {}):
                argv = [sys.executable, "-P", "-m", "gateway.cli", "serve", "--config", str(path)]  # -P: not the cwd
                env["PYTHONPATH"] = str((checkouts or {})[variant])
            svc = procs.start(variant, argv, port, tmp / f"{variant}.log", env=env)
            wait_http(svc, "/healthz", 60)
            check_chat(svc.port, request=request)
            targets[variant] = svc
        wait_idle(list(targets.values()))
        runs = collections.defaultdict(list)
        for round_no in range(repeat):
            for variant, svc in targets.items():
                runs[variant].append(measure(variant, svc, lua, duration, 2.0 if round_no == 0 else 0))
        print(f"machine: {machine()}  load: {loadavg()}")
        for variant in targets:
            best = pick_median(runs[variant])
            print(
                f"{variant:26} c32 {best['c32']['rps']:8.0f} rps  cpu {best['c32']['cpu_us_per_request']} us/req  "
                f"c1 p50 {best['c1']['p50_us']} us  p99 {best['c1']['p99_us']} us  "
                f"errors {best['c32']['errors'] + best['c1']['errors']}"
            )
    finally:
        procs.stop_all()
    return 0
