"""KV-cache-aware routing benchmark: four routing policies in front of the same engine replicas.

    .venv/bin/python tests/bench/routing_bench.py                 # full run (docs/benchmarks.md), ~15-25 min here
    .venv/bin/python tests/bench/routing_bench.py --quick         # smoke test, a few minutes
    .venv/bin/python tests/bench/routing_bench.py --out-dir /tmp/r --no-doc-png --policies round_robin kv_events

Starts N engine replicas (`portcullis engine serve --threads 1`, one BLAS thread each) on free loopback ports, then,
for each scenario (the shared-prefix workload with tenants in turn, then with a hot tenant taking a share of the
conversations) and each routing policy: starts one gateway process (`routing: <policy>`, `scrape_interval: 0.2`,
`telemetry.replica_header: true`) in front of the same engines, empties every engine's prefix cache
(POST /reset_prefix_cache, so each policy starts cold), runs the same seeded request sequence through it with
gateway.bench.run_benchmark, and stops the gateway. The plan fingerprints are checked equal across policies.

Writes to --out-dir (default .bench/routing/, gitignored): results.json ({"meta", "scenarios": {scenario: {"runs":
{policy: result}}}}, results as gateway/bench/__init__.py describes), summary.txt (the summary and the full
format_table per scenario), ttft_<scenario>.png (plot_ttft); and copies the uniform scenario's PNG to
docs/routing_ttft.png unless --no-doc-png. Everything it starts is stopped on exit, errors included.
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
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from gateway.bench import BenchConfig, format_table, plot_ttft, run_benchmark  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
POLICIES = ("round_robin", "least_load", "prefix_affinity", "kv_events")
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


def start_engines(n: int, kv_cache_bytes: str, logs: Path) -> list[Proc]:
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


def targets(uniform: list[dict], hot: list[dict]) -> list[str]:
    out = []
    rr = next((r for r in uniform if r["policy"] == "round_robin"), None)
    for r in uniform:
        if r["policy"] in CACHE_AWARE and rr and r["ttft_p50"]:
            x = rr["ttft_p50"] / r["ttft_p50"]
            out.append(
                f"{r['policy']}: TTFT p50 {x:.2f}x better than round_robin (target >= 3): "
                f"{'MET' if x >= 3 else 'not met'}"
            )
        if r["policy"] in CACHE_AWARE and r["hit_over_oracle"] is not None:
            out.append(
                f"{r['policy']}: hit rate {r['hit']:.3f} = {r['hit_over_oracle']:.2f} x oracle {r['oracle']:.3f}"
                f" (target >= 0.9): {'MET' if r['hit_over_oracle'] >= 0.9 else 'not met'}"
            )
        if r["policy"] in CACHE_AWARE and r["max_over_mean"] is not None:
            out.append(
                f"{r['policy']}: uniform max/mean requests per replica {r['max_over_mean']:.2f} "
                f"(target <= 1.3): {'MET' if r['max_over_mean'] <= 1.3 else 'not met'}"
            )
    for r in hot:
        if r["policy"] in CACHE_AWARE and r["max_over_mean"] is not None:
            out.append(
                f"{r['policy']}: hot-tenant max/mean requests per replica {r['max_over_mean']:.2f} "
                f"(target <= 1.5): {'MET' if r['max_over_mean'] <= 1.5 else 'not met'}"
            )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke test: small prompts and few requests")
    ap.add_argument("--out-dir", type=Path, default=ROOT / ".bench" / "routing")
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--kv-cache-bytes", default="1G", help="per engine; the whole working set fits (see the doc)")
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    ap.add_argument(
        "--hot-policies",
        nargs="*",
        default=None,
        choices=POLICIES,
        help="policies for the hot-tenant scenario (default: all of --policies); none to skip it",
    )
    ap.add_argument(
        "--scenarios",
        nargs="+",
        default=["uniform", "hot"],
        choices=["uniform", "hot"],
        help="uniform: tenants in turn; hot: one tenant takes --hot-tenant-share of the conversations",
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
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-doc-png", action="store_true", help="do not copy the plot to docs/routing_ttft.png")
    ap.add_argument("--keep-logs", action="store_true", help="keep engine/gateway logs and configs in out-dir/logs")
    args = ap.parse_args(argv)
    if args.quick:
        args.tenants, args.system_prompt_len, args.conversations, args.turns = 4, 200, 4, 2
        args.num_requests, args.concurrency, args.output_len = 8, 4, 4
        args.no_doc_png = True
        if args.hot_policies is None:
            args.hot_policies = ["kv_events"]
    hot_policies = args.policies if args.hot_policies is None else args.hot_policies

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
        seed=args.seed,
        ignore_eos=True,
        tokenizer="bundled",
        model=MODEL,
        request_timeout_s=900,
    )
    scenarios = [("uniform", base, args.policies)] if "uniform" in args.scenarios else []
    if hot_policies and "hot" in args.scenarios:
        scenarios.append(("hot", dataclasses.replace(base, hot_tenant_share=args.hot_tenant_share), hot_policies))

    results: dict[str, dict] = {}
    summaries: dict[str, list[dict]] = {}
    text: list[str] = []
    engines: list[Proc] = []
    gateway: Proc | None = None
    try:
        t = time.monotonic()
        engines = start_engines(args.engines, args.kv_cache_bytes, logs)
        warm_up(engines)
        urls = [e.url for e in engines]
        print(f"routing_bench: {len(engines)} engines up in {time.monotonic() - t:.0f}s: {' '.join(urls)}", flush=True)
        for scenario, config, policies in scenarios:
            runs: dict[str, dict] = {}
            for policy in policies:
                t = time.monotonic()
                gateway = start_gateway(policy, engines, logs, scenario)
                try:
                    run = run_benchmark(
                        dataclasses.replace(
                            config, name=policy, base_url=gateway.url + "/v1", reset_prefix_cache=tuple(urls)
                        )
                    )
                finally:
                    gateway.stop()
                    gateway = None
                bad_resets = {u: o for u, o in (run["reset_prefix_cache"] or {}).items() if o != "ok"}
                if bad_resets:
                    raise RuntimeError(f"could not reset prefix caches: {bad_resets}")
                runs[policy] = run
                print(
                    f"routing_bench: [{scenario}] {policy}: {run['completed']} ok, {run['failed']} failed, "
                    f"TTFT p50 {run['ttft_ms']['p50']:.0f} ms, hit {run['prefix_cache']['measured_hit_rate']}, "
                    f"{time.monotonic() - t:.0f}s, load {uptime()}",
                    flush=True,
                )
            prints = {r["plan"]["fingerprint"] for r in runs.values()}
            if len(prints) != 1:
                raise RuntimeError(f"[{scenario}] request sequences differ across policies: {prints}")
            results[scenario] = {
                "config": {k: v for k, v in runs[policies[0]]["config"].items() if k not in ("name", "base_url")},
                "fingerprint": prints.pop(),
                "engines": urls,
                "runs": runs,
            }
            rows, table = summarize(runs, urls)
            summaries[scenario] = rows
            results[scenario]["summary"] = rows
            share = f", hot tenant share {config.hot_tenant_share}" if config.hot_tenant_share is not None else ""
            text += [f"## {scenario}{share}", table, "", format_table(runs), ""]
            png = plot_ttft(runs, out / f"ttft_{scenario}.png")
            print(f"routing_bench: wrote {png}", flush=True)
    finally:
        if gateway:
            gateway.stop()
        for e in reversed(engines):
            e.stop()
        meta["loadavg_end"] = uptime()
        meta["finished_at"] = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
        (out / "results.json").write_text(json.dumps({"meta": meta, "scenarios": results}, indent=1))
        if not args.keep_logs:
            shutil.rmtree(logs, ignore_errors=True)

    checks = targets(summaries.get("uniform", []), summaries.get("hot", []))
    text += [
        "## targets",
        *checks,
        "",
        f"load average: start {meta['loadavg_start']}, end {meta['loadavg_end']}; machine {meta['machine']}",
    ]
    report = "\n".join(text)
    (out / "summary.txt").write_text(report + "\n")
    print(report)
    if not args.no_doc_png and (out / "ttft_uniform.png").exists():
        shutil.copyfile(out / "ttft_uniform.png", ROOT / "docs" / "routing_ttft.png")
        print(
            f"routing_bench: copied the plot to docs/routing_ttft.png "
            f"({(ROOT / 'docs' / 'routing_ttft.png').stat().st_size // 1024} KB)"
        )
    print(f"routing_bench: results in {out}")
    return 0 if all(r["completed"] for rows in summaries.values() for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
