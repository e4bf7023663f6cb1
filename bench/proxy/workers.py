"""`--workers-compare` and `--with-workers`: one gateway process against two (`listen.workers`), wrk and the static
upstream pinned to the same cores in both runs."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
from pathlib import Path

from bench.harness.gateways import start_portcullis
from bench.harness.processes import (
    Procs,
    tree_cpu_seconds,
    tree_pids,
    wait_http,
    wait_serving,
    wait_tree_idle,
)
from bench.harness.report import machine
from bench.harness.upstream import API_KEY, check_chat, start_static_upstream
from bench.harness.wrk import run_wrk, write_wrk_script

COMPARED_WORKERS = (1, 2)


def workers_compare(args: argparse.Namespace) -> int:
    """`--workers-compare`: the workers rows alone."""
    rows = measure_workers(args)
    print(f"\nmachine: {machine()}\n{workers_table(rows, args)}")
    if args.out:
        report = {"machine": machine(), "load_cpus": args.load_cpus, "duration_s": args.duration, "workers": rows}
        args.out.write_text(json.dumps(report, indent=2))
    return 0


def measure_workers(args: argparse.Namespace) -> list[dict]:
    """The gateway (auth on, access log off) with listen.workers 1, then 2, one at a time in front of the static
    upstream. wrk and the upstream run pinned to --load-cpus in both runs, so the cores the gateway may take are the
    only difference; on a 2-core machine the second worker shares the load generator's core. Reported: RPS and
    latency at 32 connections, and the CPU per request of the gateway's whole process tree (supervisor included)."""
    tmp = Path(tempfile.mkdtemp(prefix="portcullis-workers-bench-"))
    tmp.chmod(0o755)
    procs = Procs()
    rows: list[dict] = []
    try:
        lua = write_wrk_script(tmp / "chat.lua", API_KEY)
        static = start_static_upstream(procs, tmp)
        for pid in tree_pids(static.proc.pid):
            subprocess.run(["taskset", "-a", "-p", "-c", args.load_cpus, str(pid)], check=True, capture_output=True)
        for workers in COMPARED_WORKERS:
            svc = start_portcullis(procs, tmp, f"portcullis_workers_{workers}", static.port, False, workers=workers)
            wait_http(svc, "/healthz", 60)
            wait_serving(svc, workers)
            wait_tree_idle(svc.proc.pid)
            check_chat(svc.port)
            if args.warmup > 0:
                run_wrk(svc.port, lua, 32, args.warmup, cpus=args.load_cpus)
            cpu0 = tree_cpu_seconds(svc.proc.pid)
            c32 = run_wrk(svc.port, lua, 32, args.duration, cpus=args.load_cpus)
            cpu = tree_cpu_seconds(svc.proc.pid) - cpu0
            rows.append(
                {
                    "workers": workers,
                    "processes": len(tree_pids(svc.proc.pid)),
                    "rps": round(c32["rps"]),
                    "errors": c32["errors"],
                    "p50_ms": c32["p50_us"] / 1000,
                    "p99_ms": c32["p99_us"] / 1000,
                    "cpu_us_per_request": round(cpu / c32["requests"] * 1e6, 1) if c32["requests"] else None,
                    "cpu_util": round(cpu / (c32["duration_us"] / 1e6), 3),
                }
            )
            procs.stop(svc)  # one gateway at a time: an idle one still takes a little CPU
    finally:
        procs.stop_all()
        shutil.rmtree(tmp, ignore_errors=True)
    return rows


def workers_table(rows: list[dict], args: argparse.Namespace) -> str:
    lines = [
        f"wrk -t1 -c32 and the static upstream pinned to cores {args.load_cpus}, {args.duration:g}s",
        f"{'workers':>7} {'processes':>9} {'RPS c32':>9} {'err':>5} {'p50 ms':>8} {'p99 ms':>8} "
        f"{'CPU us/req':>10} {'CPU util':>8}",
    ]
    for r in rows:
        lines.append(
            f"{r['workers']:>7} {r['processes']:>9} {r['rps']:>9} {r['errors']:>5} {r['p50_ms']:>8.3f} "
            f"{r['p99_ms']:>8.3f} {r['cpu_us_per_request']:>10} {r['cpu_util']:>8}"
        )
    return "\n".join(lines)
