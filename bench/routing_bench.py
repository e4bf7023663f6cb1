"""KV-cache-aware routing benchmark: routing policies in front of the same engine replicas, over seeds, KV sizes
and compute modes, reported as the median and spread (min-max) over seeds.

    .venv/bin/python -m bench.routing_bench --compute int8 --kv-mib 128 --seeds 0 1 2   # cache pressure
    .venv/bin/python -m bench.routing_bench --compute int8 float32 --kv-mib 128 1024   # every cell
    .venv/bin/python -m bench.routing_bench --quick                                    # smoke test

For each cell (compute mode x KV MiB per replica x scenario) it starts N engine replicas (`portcullis engine serve
--threads 1 --compute C --kv-cache-bytes K`) on free loopback ports and reads their KV capacity from /metrics; the
cell is under cache pressure when one replica cannot hold every tenant's system prompt. Then for each seed and each
policy: starts one gateway process (`routing: <policy>`, `scrape_interval: 0.2`, `telemetry.replica_header: true`),
empties every engine's prefix cache (POST /reset_prefix_cache, so each policy starts cold), runs the seeded request
sequence through it with gateway.bench.run_benchmark, and stops the gateway. Plan fingerprints are checked equal
across the policies of a seed. Gains are round robin's TTFT over the policy's, per seed, then summarised.

Writes to --out-dir (default .bench/routing/, gitignored): results.json ({"meta", "runs": [{cell, seed, policy,
result}], "table"}), summary.txt (the table, per-run detail, the targets), ttft_<cell>.png (plot_ttft, first seed);
copies the first cell's plot to docs/routing_ttft.png with --doc-png. Everything it starts is stopped on exit,
errors included.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import json
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import yaml

from gateway.bench import BenchConfig, plot_ttft, run_benchmark

ROOT = Path(__file__).resolve().parents[1]

MODEL = "SmolLM2-135M-Instruct"
POLICIES = ("round_robin", "least_outstanding", "least_load", "prefix_affinity", "kv_events")
DEFAULT_POLICIES = ("round_robin", "prefix_affinity", "kv_events")
CACHE_AWARE = ("prefix_affinity", "kv_events")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclasses.dataclass
class Proc:
    name: str
    url: str
    proc: subprocess.Popen
    log: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def spawn(name: str, cmd: list[str], port: int, log: Path, ready_path: str, timeout: float) -> Proc:
    """Start `cmd`, wait until GET ready_path answers below 500; raise with its log if it dies or never answers."""
    out = log.open("wb")
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    p = Proc(name, f"http://127.0.0.1:{port}", proc, log)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}:\n{log.read_text(errors='replace')[-3000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(p.url + ready_path, timeout=1.0).status_code < 500:
                return p
        time.sleep(0.2)
    p.stop()
    raise RuntimeError(f"{name} not ready in {timeout}s:\n{log.read_text(errors='replace')[-3000:]}")


def uptime() -> str:
    with contextlib.suppress(OSError):
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    return "n/a"


def machine() -> dict:
    lscpu = {}
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout.splitlines():
            key, _, value = line.partition(":")
            lscpu[key.strip()] = value.strip()
    mem_kib = 0
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_kib = int(line.split()[1])
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    return {
        "cpu_model": lscpu.get("Model name"),
        "cpus": lscpu.get("CPU(s)"),
        "mem_gib": round(mem_kib / 2**20, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "commit": commit.strip(),
    }


def start_engines(n: int, kv_cache_bytes: str, compute: str, logs: Path) -> list[Proc]:
    engines = []
    for i in range(n):  # one at a time: model loads compete for the same cores
        port = free_port()
        cmd = [
            sys.executable,
            "-m",
            "gateway.cli",
            "engine",
            "serve",
            "--port",
            str(port),
            "--threads",
            "1",
            "--kv-cache-bytes",
            kv_cache_bytes,
            "--compute",
            compute,
        ]
        engines.append(spawn(f"engine-{i}", cmd, port, logs / f"engine-{i}.log", "/health", timeout=600))
    return engines


def warm_up(engines: list[Proc]) -> None:
    """One short request per engine so first-call costs (allocation, caches) stay out of every run."""
    for e in engines:
        r = httpx.post(
            e.url + "/v1/chat/completions",
            timeout=300,
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": "Say hi."}],
                "max_tokens": 4,
                "temperature": 0,
            },
        )
        r.raise_for_status()


def start_gateway(policy: str, engines: list[Proc], logs: Path, tag: str) -> Proc:
    port = free_port()
    config = logs / f"gateway-{tag}-{policy}.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "listen": {"host": "127.0.0.1", "port": port},
                "policy_dir": str(ROOT / "policies"),
                # no access log: one less thing competing for the two cores; the header tells the bench the replica
                "telemetry": {"replica_header": True, "access_log": False},
                "pools": [
                    {
                        "name": "engine",
                        "replicas": [{"url": e.url} for e in engines],
                        "routing": policy,
                        "scrape_interval": 0.2,
                        "timeouts": {"read": 600},
                    }
                ],
            }
        )
    )
    return spawn(
        f"gateway-{policy}",
        [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config)],
        port,
        logs / f"gateway-{tag}-{policy}.log",
        "/healthz",
        timeout=180,
    )


def balance(result: dict, engine_urls: list[str]) -> dict:
    """Requests per replica over ALL replicas (one that got none counts as 0) and max/mean."""
    share = result.get("replica_share") or {}
    counts = {url: (share.get(url) or {}).get("requests", 0) for url in engine_urls}
    for url, row in share.items():  # a header value that is not one of ours (should not happen): keep it visible
        if url not in counts:
            counts[url] = row["requests"]
    total = sum(counts.values())
    mean = total / len(engine_urls) if engine_urls else 0
    return {"counts": counts, "max_over_mean": (max(counts.values()) / mean) if mean else None}


def steady_ttft_p99(result: dict) -> float | None:
    """TTFT p99 of the requests sent after the opening burst: the first `concurrency` requests leave at once, before
    anything is cached, and land two to a replica under every policy, so their TTFT is the same cold work in every
    run and only the machine's load moves it; with 48 requests they would set the p99 on their own."""
    sent = sorted((q for q in result["requests"] if q["success"]), key=lambda q: q["start_s"])
    later = [q["ttft_ms"] for q in sent[result["config"]["concurrency"] :] if q["ttft_ms"] is not None]
    return float(np.percentile(later, 99)) if later else None


def summarize(runs: dict[str, dict], engine_urls: list[str]) -> tuple[list[dict], str]:
    rows = []
    for name, r in runs.items():
        cache = r["prefix_cache"]
        measured, oracle = cache["measured_hit_rate"], cache["oracle_hit_rate"]
        bal = balance(r, engine_urls)
        rows.append(
            {
                "policy": name,
                "completed": r["completed"],
                "failed": r["failed"],
                "duration_s": r["duration_s"],
                "ttft_p50": r["ttft_ms"]["p50"],
                "ttft_p90": r["ttft_ms"]["p90"],
                "ttft_p99": r["ttft_ms"]["p99"],
                "ttft_p99_steady": steady_ttft_p99(r),
                "tpot_p50": r["tpot_ms"]["p50"],
                "e2e_p50": r["e2el_ms"]["p50"],
                "e2e_p99": r["e2el_ms"]["p99"],
                "out_tok_s": r["output_throughput"],
                "hit": measured,
                "oracle": oracle,
                "oracle_with_outputs": cache.get("oracle_hit_rate_with_outputs"),
                "hit_over_oracle": (measured / oracle) if measured is not None and oracle else None,
                "replica_requests": [bal["counts"][u] for u in engine_urls],
                "max_over_mean": bal["max_over_mean"],
            }
        )

    def f(v, fmt="{:.0f}"):
        return "n/a" if v is None else fmt.format(v)

    head = (
        "| policy | TTFT p50 | p90 | p99 (ms) | TPOT p50 (ms) | E2E p50 | p99 (ms) | out tok/s | hit rate "
        "| oracle | hit/oracle | requests per replica | max/mean | ok/failed |"
    )
    lines = [head, "|---" + "|---:" * 13 + "|"]
    for row in rows:
        lines.append(
            f"| {row['policy']} | {f(row['ttft_p50'])} | {f(row['ttft_p90'])} | {f(row['ttft_p99'])} "
            f"| {f(row['tpot_p50'], '{:.1f}')} | {f(row['e2e_p50'])} | {f(row['e2e_p99'])} "
            f"| {f(row['out_tok_s'], '{:.1f}')} | {f(row['hit'], '{:.3f}')} | {f(row['oracle'], '{:.3f}')} "
            f"| {f(row['hit_over_oracle'], '{:.2f}')} | {' / '.join(map(str, row['replica_requests']))} "
            f"| {f(row['max_over_mean'], '{:.2f}')} | {row['completed']}/{row['failed']} |"
        )
    base = next((row for row in rows if row["policy"] == "round_robin"), None)
    if base and base["ttft_p50"]:
        speedups = ", ".join(
            f"{row['policy']} {base['ttft_p50'] / row['ttft_p50']:.2f}x"
            for row in rows
            if row["policy"] != "round_robin" and row["ttft_p50"]
        )
        lines.append(f"\nTTFT p50 speed-up over round_robin: {speedups}")
    return rows, "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Cell:
    compute: str
    kv_mib: int
    scenario: str

    @property
    def name(self) -> str:
        return f"{self.compute}-{self.kv_mib}MiB-{self.scenario}"


def kv_capacity_tokens(url: str) -> int:
    """The engine's KV cache size in tokens, from its cache_config_info metric."""
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            labels = dict(part.split("=") for part in line[line.index("{") + 1 : line.index("}")].split(","))
            return int(float(labels["num_gpu_blocks"].strip('"'))) * int(labels["block_size"].strip('"'))
    raise RuntimeError(f"{url}/metrics has no vllm:cache_config_info")


def spread(values: list[float], fmt: str = "{:.0f}") -> str:
    """Median [min-max] of per-seed figures."""
    if not values:
        return "n/a"
    median = statistics.median(values)
    return f"{fmt.format(median)} [{fmt.format(min(values))}-{fmt.format(max(values))}]"


def aggregate(records: list[dict]) -> tuple[list[dict], str]:
    """One row per cell and policy: TTFT p50/p99 and the gain over round robin, median [min-max] over seeds."""
    by_cell: dict[str, dict[str, dict[int, dict]]] = {}
    for rec in records:
        by_cell.setdefault(rec["cell"], {}).setdefault(rec["policy"], {})[rec["seed"]] = rec
    rows = []
    for cell, policies in by_cell.items():
        base = policies.get("round_robin", {})
        for policy, seeds in policies.items():
            recs = list(seeds.values())
            first = recs[0]
            gains = {
                q: [base[s][q] / r[q] for s, r in seeds.items() if s in base and r[q]]
                for q in ("ttft_p50", "ttft_p99", "ttft_p99_steady")
            }
            rows.append(
                {
                    "cell": cell,
                    "compute": first["compute"],
                    "kv_mib": first["kv_mib"],
                    "kv_tokens": first["kv_tokens"],
                    "pressure": first["pressure"],
                    "policy": policy,
                    "seeds": sorted(seeds),
                    "ttft_p50": [r["ttft_p50"] for r in recs],
                    "ttft_p99": [r["ttft_p99"] for r in recs],
                    "ttft_p99_steady": [r["ttft_p99_steady"] for r in recs],
                    "p50_gain": gains["ttft_p50"],
                    "p99_gain": gains["ttft_p99"],
                    "p99_steady_gain": gains["ttft_p99_steady"],
                    "hit": [r["hit"] for r in recs if r["hit"] is not None],
                    "max_over_mean": [r["max_over_mean"] for r in recs if r["max_over_mean"] is not None],
                    "completed": sum(r["completed"] for r in recs),
                    "failed": sum(r["failed"] for r in recs),
                }
            )
    lines = [
        "median [min-max] over seeds; gain = round_robin's TTFT / the policy's, per seed",
        "",
        "| compute | KV per replica | cache pressure | policy | seeds | TTFT p50 (ms) | TTFT p99 (ms) "
        "| p99 after the opening burst (ms) | p50 gain | p99 gain | p99 gain after the burst | hit rate "
        "| max/mean requests | ok/failed |",
        "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        gain50 = spread(r["p50_gain"], "{:.2f}x") if r["policy"] != "round_robin" else "-"
        gain99 = spread(r["p99_gain"], "{:.2f}x") if r["policy"] != "round_robin" else "-"
        steady99 = spread(r["p99_steady_gain"], "{:.2f}x") if r["policy"] != "round_robin" else "-"
        lines.append(
            f"| {r['compute']} | {r['kv_mib']} MiB ({r['kv_tokens']:,} tokens) | {'yes' if r['pressure'] else 'no'} "
            f"| {r['policy']} | {len(r['seeds'])} | {spread(r['ttft_p50'])} | {spread(r['ttft_p99'])} "
            f"| {spread(r['ttft_p99_steady'])} | {gain50} | {gain99} | {steady99} | {spread(r['hit'], '{:.2f}')} "
            f"| {spread(r['max_over_mean'], '{:.2f}')} "
            f"| {r['completed']}/{r['failed']} |"
        )
    return rows, "\n".join(lines)


def targets(rows: list[dict]) -> list[str]:
    """Never worse than round robin (median over seeds) on p50 and p99 in any cell; under cache pressure at least
    2x on p50 and a p99 cut."""
    out = []
    for r in rows:
        if r["policy"] not in CACHE_AWARE or not r["p50_gain"] or not r["p99_gain"]:
            continue
        p50, p99 = statistics.median(r["p50_gain"]), statistics.median(r["p99_gain"])
        steady = statistics.median(r["p99_steady_gain"]) if r["p99_steady_gain"] else float("nan")
        worst = min(r["p50_gain"] + r["p99_gain"])
        ok = p50 >= 1 and p99 >= 1
        line = f"{r['cell']} {r['policy']}: p50 {p50:.2f}x, p99 {p99:.2f}x (worst seed {worst:.2f}x), "
        line += f"p99 after the opening burst {steady:.2f}x: "
        line += f"not worse than round_robin {'MET' if ok else 'NOT MET'}"
        if r["pressure"]:
            line += f"; p50 >= 2x {'MET' if p50 >= 2 else 'not met'}, p99 cut {'MET' if p99 > 1 else 'not met'}"
        out.append(line)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke test: small prompts and few requests")
    ap.add_argument("--out-dir", type=Path, default=ROOT / ".bench" / "routing")
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument(
        "--kv-mib",
        type=int,
        nargs="+",
        default=[128, 1024],
        help="KV cache MiB per replica, one cell each: small enough that the tenants' prompts do not fit in one "
        "replica (cache pressure) and large enough that they do",
    )
    ap.add_argument("--compute", nargs="+", default=["int8", "float32"], choices=["int8", "float32"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--policies", nargs="+", default=list(DEFAULT_POLICIES), choices=POLICIES)
    ap.add_argument(
        "--scenarios",
        nargs="+",
        default=["uniform"],
        choices=["uniform", "hot", "mixed"],
        help="uniform: tenants in turn; hot: one tenant takes --hot-tenant-share of the conversations; mixed: no "
        "shared prefix, prompt lengths drawn from --mixed-input-len x [0.1, 1.9] (only load balancing can win)",
    )
    ap.add_argument("--mixed-input-len", type=int, default=500)
    ap.add_argument(
        "--request-rate",
        type=float,
        help="Poisson arrivals at this many requests/s (still capped by --concurrency); default: all at once",
    )
    ap.add_argument("--hot-tenant-share", type=float, default=0.5)
    ap.add_argument("--tenants", type=int, default=8)
    ap.add_argument("--system-prompt-len", type=int, default=1000)
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--user-len", type=int, default=64)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--doc-png", action="store_true", help="copy the first cell's plot to docs/routing_ttft.png")
    ap.add_argument("--keep-logs", action="store_true", help="keep engine/gateway logs and configs in out-dir/logs")
    args = ap.parse_args(argv)
    if args.quick:
        args.tenants, args.system_prompt_len, args.conversations, args.turns = 4, 200, 4, 2
        args.num_requests, args.concurrency, args.output_len = 8, 4, 4
        args.seeds, args.compute, args.kv_mib = args.seeds[:1], args.compute[:1], args.kv_mib[:1]

    out = args.out_dir
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    meta = {
        "started_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "loadavg_start": uptime(),
        "machine": machine(),
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    print(f"routing_bench: load average at start {meta['loadavg_start']}", flush=True)
    base = BenchConfig(
        workload="shared-prefix",
        tenants=args.tenants,
        system_prompt_len=args.system_prompt_len,
        conversations=args.conversations,
        turns=args.turns,
        user_len=args.user_len,
        num_requests=args.num_requests,
        concurrency=args.concurrency,
        output_len=args.output_len,
        request_rate=args.request_rate,
        ignore_eos=True,
        tokenizer="bundled",
        model=MODEL,
        request_timeout_s=900,
    )
    shared_prefixes = args.tenants * args.system_prompt_len
    cells = [Cell(c, kv, sc) for c in args.compute for kv in args.kv_mib for sc in args.scenarios]
    records: list[dict] = []
    loads: list[str] = []
    detail: list[str] = []
    engines: list[Proc] = []
    gateway: Proc | None = None
    try:
        for cell in cells:
            t = time.monotonic()
            engines = start_engines(args.engines, f"{cell.kv_mib}M", cell.compute, logs)
            warm_up(engines)
            urls = [e.url for e in engines]
            kv_tokens = kv_capacity_tokens(urls[0])
            pressure = cell.scenario != "mixed" and kv_tokens < shared_prefixes
            print(
                f"routing_bench: [{cell.name}] {len(engines)} engines up in {time.monotonic() - t:.0f}s, "
                f"{kv_tokens} KV tokens each vs {shared_prefixes} tokens of system prompts: "
                f"{'cache pressure' if pressure else 'no cache pressure'}",
                flush=True,
            )
            config = base
            if cell.scenario == "hot":
                config = dataclasses.replace(base, hot_tenant_share=args.hot_tenant_share)
            elif cell.scenario == "mixed":
                config = dataclasses.replace(base, workload="random", input_len=args.mixed_input_len, range_ratio=0.9)
            for seed in args.seeds:
                runs: dict[str, dict] = {}
                for policy in args.policies:
                    t = time.monotonic()
                    gateway = start_gateway(policy, engines, logs, cell.name)
                    try:
                        run = run_benchmark(
                            dataclasses.replace(
                                config,
                                seed=seed,
                                name=policy,
                                base_url=gateway.url + "/v1",
                                reset_prefix_cache=tuple(urls),
                            )
                        )
                    finally:
                        gateway.stop()
                        gateway = None
                    bad_resets = {u: o for u, o in (run["reset_prefix_cache"] or {}).items() if o != "ok"}
                    if bad_resets:
                        raise RuntimeError(f"could not reset prefix caches: {bad_resets}")
                    runs[policy] = run
                    loads.append(uptime())
                    print(
                        f"routing_bench: [{cell.name} seed {seed}] {policy}: {run['completed']} ok, "
                        f"{run['failed']} failed, TTFT p50 {run['ttft_ms']['p50']:.0f} ms, "
                        f"p99 {run['ttft_ms']['p99']:.0f} ms, hit {run['prefix_cache']['measured_hit_rate']}, "
                        f"{time.monotonic() - t:.0f}s, load {loads[-1]}",
                        flush=True,
                    )
                prints = {r["plan"]["fingerprint"] for r in runs.values()}
                if len(prints) != 1:
                    raise RuntimeError(f"[{cell.name} seed {seed}] request sequences differ: {prints}")
                rows, table = summarize(runs, urls)
                detail += [f"## {cell.name}, seed {seed}", table, ""]
                for row in rows:
                    records.append(
                        {
                            **dataclasses.asdict(cell),
                            "cell": cell.name,
                            "seed": seed,
                            "kv_tokens": kv_tokens,
                            "pressure": pressure,
                            **row,
                            "result": runs[row["policy"]],
                        }
                    )
                if seed == args.seeds[0]:
                    print(f"routing_bench: wrote {plot_ttft(runs, out / f'ttft_{cell.name}.png')}", flush=True)
            for e in reversed(engines):
                e.stop()
            engines = []
    finally:
        if gateway:
            gateway.stop()
        for e in reversed(engines):
            e.stop()
        meta["loadavg_end"] = uptime()
        meta["loadavg_after_each_run"] = loads
        meta["finished_at"] = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
        rows, table = aggregate(records)
        (out / "results.json").write_text(json.dumps({"meta": meta, "runs": records, "table": rows}, indent=1))
        if not args.keep_logs:
            shutil.rmtree(logs, ignore_errors=True)

    report = "\n".join(
        [
            table,
            "",
            "## targets",
            *targets(rows),
            "",
            f"load average (1/5/15 min): start {meta['loadavg_start']}, end {meta['loadavg_end']}, after each run "
            f"{'; '.join(loads)}",
            f"machine {meta['machine']}",
        ]
    )
    (out / "summary.txt").write_text(report + "\n\n" + "\n".join(detail) + "\n")
    print(report)
    first_plot = out / f"ttft_{cells[0].name}.png"
    if args.doc_png and first_plot.exists():
        shutil.copyfile(first_plot, ROOT / "docs" / "routing_ttft.png")
        print("routing_bench: copied the plot to docs/routing_ttft.png")
    print(f"routing_bench: results in {out}")
    return 0 if records and all(r["completed"] and not r["failed"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
