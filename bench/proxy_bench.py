#!/usr/bin/env python
"""Gateway proxy overhead benchmark: Portcullis vs nginx vs LiteLLM in front of the same static upstream.

    python -m bench.proxy_bench [--duration 10] [--out results.json] [--profile-dir DIR] [--keys [--keys-pairs N]]

One run, all on 127.0.0.1 free ports:

* a static upstream: nginx (1 worker) answering POST /v1/chat/completions with a fixed chat.completion (with usage),
* nginx (1 worker) as a reverse proxy in front of it (keepalive upstream connections),
* the Portcullis gateway (`portcullis serve`, 1 process), auth on, twice: access log on (the default, written to a
  file) and access log off,
* the LiteLLM proxy (1 worker, master key so auth is on) from a separate venv at .bench/litellm-venv
  (`pip install 'litellm[proxy]'` there; skipped with a note if it is missing),

then wrk against each: `-t1 -c32` for throughput and `-t1 -c1 --latency` for p50/p99, POSTing a small non-streaming
chat request with an Authorization header. "Added" latency is a target's p50/p99 minus the direct upstream's.

With --keys, three more rows, access log off: the config's static key ("Portcullis, static key", the baseline), and
a key made in the key store before the gateway starts (SQLite, then Redis on a local redis-server) with a priced
policy and a budget rule (per tenant) no run spends; wrk sends each row's own key. Before and after the runs, a
request priced past the limit must be refused for the budget, saying what is left. --keys-pairs N alternates short
c32 runs of each key-store row and the static-key row (A B B A ...) and reports the median RPS and CPU-per-request
ratios with their quartiles.

With --cache, two more rows, access log off: the repo's base policy with the response cache on (`spec.cache`: wrk's
request is a deterministic one, temperature 0), its answers in memory, then in Redis (a local redis-server): every
request but the first is a hit, answered without the upstream. Read against "Portcullis (access log off)", the same
policy without the cache, where every request is proxied: what a hit costs beside the gateway's own overhead.

With --profile-dir, py-spy (from .bench/tools-venv, or $PY_SPY) records the access-log-on gateway during an extra
32-connection run and the script prints a self-time summary grouped by package.

With --workers-compare, only this: the gateway with listen.workers 1, then 2, wrk and the static upstream pinned
(taskset) to --load-cpus in both runs; RPS, latency and CPU per request of the gateway's whole process tree.
--with-workers adds those rows after the others, so one run gives the whole gateway table.

This module is the run: which targets start, in what order they are measured, what is printed. What it shares with
the other benchmarks through the API is in bench/harness/ (processes, the static upstream, gateways, wrk, the
report); each option's rows are in bench/proxy/ (keys.py: --keys and --limits; cache.py; client_floor.py; profile.py;
workers.py). It needs nginx, wrk and minutes of wall time.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.harness.gateways import start_litellm, start_portcullis, start_redis
from bench.harness.processes import Procs, Service, wait_http, wait_idle
from bench.harness.report import add_latency_deltas, loadavg, machine, table
from bench.harness.upstream import API_KEY, check_chat, start_nginx, start_static_upstream
from bench.harness.wrk import ab_pairs, measure, pick_median, write_wrk_script
from bench.proxy.cache import CACHE_ROWS, cache_policy
from bench.proxy.client_floor import client_floor
from bench.proxy.keys import (
    BUDGETS_POLICY,
    CONTROL_ROW,
    KEY_STORE_ROWS,
    LIMITS_POLICY,
    NO_BUDGETS_POLICY,
    STATIC_KEY_ROW,
    budget_left,
    keys_table,
    store_key,
)
from bench.proxy.profile import profile_gateway
from bench.proxy.workers import measure_workers, workers_compare, workers_table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per wrk run (default 10)")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds of c32 load before measuring (default 2)")
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="rounds over all targets, interleaved; the median round is reported (default 1)",
    )
    parser.add_argument("--out", type=Path, help="write results as JSON here")
    parser.add_argument("--skip-litellm", action="store_true", help="leave out the LiteLLM row")
    parser.add_argument("--profile-dir", type=Path, help="py-spy the gateway (access log on) and write stacks here")
    parser.add_argument(
        "--no-client-floor",
        action="store_true",
        help="skip the upstream-client micro-benchmark (httpx vs aiohttp vs raw asyncio)",
    )
    parser.add_argument("--keep-tmp", action="store_true", help="keep the temp dir with configs and logs")
    parser.add_argument(
        "--baseline", type=Path, help="a checkout of an earlier commit (git worktree): its gateway as one more row"
    )
    parser.add_argument(
        "--ab-pairs",
        type=int,
        default=0,
        help="with --baseline: this many alternating 5 s c32 pairs of it and this checkout (log on)",
    )
    parser.add_argument(
        "--limits",
        action="store_true",
        help="add rows with rate limits on (memory and a local redis-server), access log off",
    )
    parser.add_argument(
        "--cache",
        action="store_true",
        help="add rows, access log off: every request a response cache hit (memory, a local redis-server)",
    )
    parser.add_argument(
        "--keys",
        action="store_true",
        help="add rows, access log off: the static key, and a stored key (SQLite, Redis) with a budget rule on",
    )
    parser.add_argument(
        "--keys-pairs",
        type=int,
        default=0,
        help="with --keys: this many alternating 5 s c32 pairs of each key-store row and the static-key row",
    )
    parser.add_argument(
        "--workers-compare",
        action="store_true",
        help="only this: the gateway with listen.workers 1, then 2, wrk and the upstream pinned to --load-cpus",
    )
    parser.add_argument(
        "--with-workers",
        action="store_true",
        help="after the other rows, in the same run: the --workers-compare rows (the whole gateway table in one run)",
    )
    parser.add_argument(
        "--load-cpus",
        default=str(max(os.sched_getaffinity(0))),
        help="with --workers-compare or --with-workers: the cores (taskset list) of wrk and the static upstream "
        "(default: the last)",
    )
    args = parser.parse_args(argv)

    for tool in ("nginx", "wrk"):
        if not shutil.which(tool) and not Path(f"/usr/sbin/{tool}").exists():
            print(f"error: {tool} not found (apt-get install -y nginx-light wrk)", file=sys.stderr)
            return 2
    if args.workers_compare:
        return workers_compare(args)

    tmp = Path(tempfile.mkdtemp(prefix="portcullis-proxy-bench-"))
    tmp.chmod(0o755)
    procs = Procs()
    results: list[dict] = []
    report: dict = {
        "machine": machine(),
        "loadavg_start": loadavg(),
        "duration_s": args.duration,
        "warmup_s": args.warmup,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    try:
        lua = write_wrk_script(tmp / "chat.lua", API_KEY)

        static = start_static_upstream(procs, tmp)
        proxy = start_nginx(procs, tmp, "nginx-proxy", "proxy.conf.tmpl", UPSTREAM_PORT=static.port)
        wait_http(proxy, "/v1/models", 15)

        targets: list[tuple[str, str, Service, bool]] = [
            ("direct", "direct (static nginx)", static, False),
            ("nginx_proxy", "nginx reverse proxy", proxy, False),
        ]
        for key, label, access_log in (
            ("portcullis_access_log_on", "Portcullis (access log on)", True),
            ("portcullis_access_log_off", "Portcullis (access log off)", False),
        ):
            svc = start_portcullis(procs, tmp, key, static.port, access_log)
            wait_http(svc, "/healthz", 60)
            targets.append((key, label, svc, True))
        if args.baseline:
            commit = subprocess.run(
                ["git", "-C", str(args.baseline), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
            ).stdout.strip()
            svc = start_portcullis(procs, tmp, "portcullis_baseline", static.port, True, checkout=args.baseline)
            wait_http(svc, "/healthz", 60)
            targets.append(("portcullis_baseline", f"Portcullis at {commit} (access log on)", svc, True))
        stores: dict[str, Service] = {}  # target -> the store whose CPU its requests cost too
        bearer: dict[str, str] = {}  # target -> the key it takes, where not API_KEY
        scripts: dict[str, Path] = {}  # target -> its wrk script, where not `lua`
        redis = start_redis(procs, tmp) if args.limits or args.keys or args.cache else None
        if args.limits:
            assert redis is not None
            stores["portcullis_limits_redis"] = redis
            for key, label, url in (
                ("portcullis_limits_memory", "Portcullis + limits in memory", None),
                ("portcullis_limits_redis", "Portcullis + limits in Redis", f"redis://127.0.0.1:{redis.port}/0"),
            ):
                svc = start_portcullis(procs, tmp, key, static.port, False, redis_url=url, policy=LIMITS_POLICY)
                wait_http(svc, "/healthz", 60)
                targets.append((key, label, svc, True))
        if args.keys:
            assert redis is not None
            for key, label in (
                (STATIC_KEY_ROW, "Portcullis, static key"),
                (CONTROL_ROW, "Portcullis, static key again"),
            ):
                svc = start_portcullis(procs, tmp, key, static.port, False, policy=NO_BUDGETS_POLICY)
                wait_http(svc, "/healthz", 60)
                targets.append((key, label, svc, True))
            for key, label, store in KEY_STORE_ROWS:
                url = f"redis://127.0.0.1:{redis.port}/1" if store == "redis" else None  # apart from --limits' db
                bearer[key] = store_key(store, tmp, key, url)
                scripts[key] = write_wrk_script(tmp / f"{key}.lua", bearer[key])
                svc = start_portcullis(
                    procs, tmp, key, static.port, False, url, policy=BUDGETS_POLICY, store=store, static_key=False
                )
                wait_http(svc, "/healthz", 60)
                targets.append((key, label, svc, True))
                if url:
                    stores[key] = redis
        if args.cache:
            assert redis is not None
            for key, label, store in CACHE_ROWS:
                url = f"redis://127.0.0.1:{redis.port}/2" if store == "redis" else None  # apart from the others' dbs
                svc = start_portcullis(
                    procs, tmp, key, static.port, False, url, policy=cache_policy(), response_cache={"store": store}
                )
                wait_http(svc, "/healthz", 60)
                targets.append((key, label, svc, True))
                if url:
                    stores[key] = redis
        if not args.skip_litellm:
            litellm = start_litellm(procs, tmp, static.port)
            if litellm is not None:
                wait_http(litellm, "/health/liveliness", 180)
                targets.append(("litellm", "LiteLLM proxy (1 worker)", litellm, True))

        wait_idle([svc for key, _, svc, _ in targets if key.startswith("portcullis")])
        checks = {}
        for key, label, svc, auth in targets:
            check = check_chat(svc.port, bearer.get(key, API_KEY))
            # LiteLLM without a database answers an unknown key with 400 ("No connected db"), not 401.
            if auth and not 400 <= check["wrong_key_status"] < 500:
                raise RuntimeError(f"{label}: a wrong key got {check['wrong_key_status']}; auth is not on")
            check["auth_on"] = auth
            checks[key] = check
            if key in {row for row, _, _ in CACHE_ROWS} and check_chat(svc.port)["cache"] != "hit":
                raise RuntimeError(f"{label}: a repeated request was not a cache hit")
        budgeted = {key: svc for key, _, svc, _ in targets if key in {row for row, _, _ in KEY_STORE_ROWS}}
        budget_before = {key: budget_left(svc, bearer[key]) for key, svc in budgeted.items()}
        # Rounds interleave the targets, so a burst of outside load lands on all of them rather than on one.
        runs: dict[str, list[dict]] = collections.defaultdict(list)
        for round_no in range(args.repeat):
            for key, _label, svc, _auth in targets:
                script = scripts.get(key, lua)
                warmup = args.warmup if round_no == 0 else 0
                runs[key].append(measure(key, svc, script, args.duration, warmup, stores.get(key)))
        for key, label, _svc, _auth in targets:
            results.append(pick_median(runs[key]) | {"label": label, "check": checks[key]})

        add_latency_deltas(results)
        report["results"] = results
        if args.baseline and args.ab_pairs:
            current = next(svc for key, _, svc, _ in targets if key == "portcullis_access_log_on")
            baseline = next(svc for key, _, svc, _ in targets if key == "portcullis_baseline")
            report["ab"] = ab_pairs(current, baseline, lua, args.ab_pairs)
        if budgeted and args.keys_pairs:
            static_key = next(svc for key, _, svc, _ in targets if key == STATIC_KEY_ROW)
            report["keys_ab"] = {
                key: ab_pairs(
                    svc, static_key, lua, args.keys_pairs, current_lua=scripts.get(key, lua), store=stores.get(key)
                )
                | {"label": label}
                for key, label, svc, _ in targets
                if key in budgeted or key == CONTROL_ROW
            }
        if budgeted:  # what the run spent of each budget
            report["budget_left"] = {
                key: {"before": budget_before[key], "after": budget_left(svc, bearer[key])}
                for key, svc in budgeted.items()
            }
        report["loadavg_end"] = loadavg()

        for key, _, svc, _ in targets:
            if key.startswith("portcullis"):
                lines = svc.log_path.read_bytes().splitlines()
                report.setdefault("portcullis_stderr", {})[key] = {
                    "lines": len(lines),
                    "httpx_request_lines": sum(1 for line in lines if b'"logger":"httpx"' in line),
                    "access_lines": sum(1 for line in lines if b'"request_id"' in line),
                }

        if not args.no_client_floor:
            report["client_floor"] = client_floor(static.port, args.duration)

        if args.profile_dir:
            svc = next(s for k, _, s, _ in targets if k == "portcullis_access_log_on")
            report["profile"] = profile_gateway(svc, lua, args.duration, args.profile_dir.resolve())
    finally:
        procs.stop_all()
        if args.keep_tmp:
            print(f"temp dir kept: {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    if args.with_workers:  # after the other targets are stopped: the pinned runs want the cores to themselves
        report["workers"] = measure_workers(args)
        report["load_cpus"] = args.load_cpus
        report["loadavg_end"] = loadavg()

    print(f"\nmachine: {report['machine']}")
    print(f"load average: start {report['loadavg_start']}, end {report['loadavg_end']}")
    print(
        f"wrk -t1, {args.duration:g}s per run, median of {args.repeat} interleaved round(s); "
        f"RPS at 32 connections, latency at 1 connection; +p50/+p99 = added over direct\n"
    )
    print(table(results))
    if report.get("ab"):
        ab = report["ab"]
        print(
            f"\nalternating pairs against the baseline ({ab['pairs']} x {ab['seconds']:g} s, c32, access log on): "
            f"median RPS ratio {ab['median_ratio']} (quartiles {ab['ratio_quartiles']}), "
            f"median CPU-per-request ratio {ab['median_cpu_ratio']} (quartiles {ab['cpu_ratio_quartiles']})"
        )
    if report.get("keys_ab"):
        print(keys_table(report["keys_ab"]))
    for key, left in report.get("budget_left", {}).items():
        print(f"{key}: budget before the runs {left['before']}, after {left['after']}")
    for r in results:
        if "store_cpu_us_per_request" in r["c32"]:
            print(f"{r['label']}: redis-server CPU {r['c32']['store_cpu_us_per_request']} us/req on top (c32 run)")
    for key, info in report.get("portcullis_stderr", {}).items():
        print(
            f"{key}: {info['lines']} stderr lines in all ({info['access_lines']} access-log lines, "
            f"{info['httpx_request_lines']} httpx 'HTTP Request' lines)"
        )
    if report.get("client_floor"):
        print("\nupstream client alone against the static upstream (one process, CPU per request):")
        for row in report["client_floor"]:
            print(
                f"  {row['client']:<8} x{row['connections']:<3} {row['rps']:>8.0f} req/s "
                f"{row['cpu_us_per_request']:>8.1f} CPU us/req"
            )
    if report.get("profile"):
        prof = report["profile"]
        print(
            f"\npy-spy self time, Portcullis (access log on) under c32 "
            f"({prof['samples']} samples, {prof['rps_while_profiling']} RPS while profiled):"
        )
        for row in prof["self_by_package"]:
            print(f"  {row['pct']:>5.1f}%  {row['package']}")
        print("  top functions:")
        for row in prof["self_by_function"]:
            print(f"  {row['pct']:>5.1f}%  {row['function']}")
        print(f"  inclusive: {prof['inclusive_pct']}")
    if report.get("workers"):
        print(f"\nlisten.workers 1 against 2, same run:\n{workers_table(report['workers'], args)}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
