"""Load from wrk: its Lua script (a fixed or per-request-varied body), one run's figures, a target measured at 32
connections (RPS, CPU per request) and at 1 (latency), the median of interleaved rounds, and alternating A/B pairs."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

from bench.harness.processes import Service, group_cpu_seconds
from bench.harness.upstream import REQUEST

WRK_LUA = r"""
wrk.method = "POST"
wrk.body = [==[@BODY@]==]
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer @KEY@"

done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRKJSON {"requests":%d,"duration_us":%d,"bytes":%d,"err_connect":%d,"err_read":%d,"err_write":%d,' ..
    '"err_status":%d,"err_timeout":%d,"lat_mean_us":%.3f,"lat_stdev_us":%.3f,"lat_max_us":%d,' ..
    '"p50_us":%d,"p90_us":%d,"p99_us":%d,"p999_us":%d}\n',
    summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write, e.status, e.timeout,
    latency.mean, latency.stdev, latency.max,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency:percentile(99.9)))
end
"""


# Appended to WRK_LUA for a body holding "@N@": each request gets a number of its own there (a user message that
# differs on every request, as real traffic does), random per wrk thread and run so no two runs repeat a body
VARY_LUA = r"""
math.randomseed(os.time() + tonumber(tostring({}):match("0x(%x+)") or "0", 16))
local head, tail = string.match(wrk.body, "^(.-)@N@(.*)$")
request = function()
  return wrk.format(nil, nil, nil, head .. math.random(1, 2000000000) .. tail)
end
"""


def write_wrk_script(path: Path, key: str, request: dict | None = None) -> Path:
    """wrk's Lua script POSTing `request` (default REQUEST) with `key` as the bearer token."""
    body = json.dumps(request or REQUEST, separators=(",", ":"))
    path.write_text(WRK_LUA.replace("@BODY@", body).replace("@KEY@", key))
    return path


def ab_pairs(
    current: Service,
    baseline: Service,
    lua: Path,
    pairs: int,
    seconds: float = 5.0,
    current_lua: Path | None = None,
    store: Service | None = None,
) -> dict:
    """Short c32 runs of one gateway (`current`, e.g. this checkout's) and a `baseline`, alternating (A B B A ...), so
    that load from outside lands on both; the ratio of each adjacent pair, then their median, is what the difference
    costs. Each run also records the gateway's CPU per request, which outside load disturbs far less than its RPS.

    `current_lua`: current's own wrk script (its own key), else `lua`; `store`: a process current's requests also
    cost (redis-server), whose CPU per request is recorded beside, not in, the ratio."""
    ratios, cpu_ratios = [], []
    rps: dict[str, list[float]] = {"current": [], "baseline": []}
    cpu: dict[str, list[float]] = {"current": [], "baseline": []}
    errors = {"current": 0, "baseline": 0}
    store_cpu: list[float] = []
    for number in range(pairs):
        order = [("current", current, current_lua or lua), ("baseline", baseline, lua)]
        measured, spent = {}, {}
        for name, service, script in order if number % 2 == 0 else reversed(order):
            cpu0 = group_cpu_seconds(service.proc.pid)
            store_cpu0 = group_cpu_seconds(store.proc.pid) if store and name == "current" else 0.0
            run = run_wrk(service.port, script, 32, seconds)
            requests = max(run["requests"], 1)
            measured[name] = run["rps"]
            spent[name] = (group_cpu_seconds(service.proc.pid) - cpu0) / requests * 1e6
            if store and name == "current":
                store_cpu.append(round((group_cpu_seconds(store.proc.pid) - store_cpu0) / requests * 1e6, 1))
            rps[name].append(round(measured[name], 1))
            cpu[name].append(round(spent[name], 1))
            errors[name] += run["errors"]
        ratios.append(measured["current"] / measured["baseline"])
        cpu_ratios.append(spent["current"] / spent["baseline"])
    result = {
        "pairs": pairs,
        "seconds": seconds,
        "rps": rps,
        "cpu_us_per_request": cpu,
        "errors": errors,
        "median_ratio": _median_with_quartiles(ratios)[0],
        "ratio_quartiles": _median_with_quartiles(ratios)[1],
        "median_cpu_ratio": _median_with_quartiles(cpu_ratios)[0],
        "cpu_ratio_quartiles": _median_with_quartiles(cpu_ratios)[1],
    }
    if store_cpu:
        result["store_cpu_us_per_request"] = store_cpu
    return result


def _median_with_quartiles(values: list[float]) -> tuple[float, list[float]]:
    ordered = sorted(values)
    n = len(ordered)
    return round(ordered[n // 2], 3), [round(ordered[n // 4], 3), round(ordered[3 * n // 4], 3)]


def pick_median(runs: list[dict]) -> dict:
    """The median round by c32 RPS and, separately, by c1 p50 (each with its own p99 and errors)."""
    by_rps = sorted(runs, key=lambda r: r["c32"]["rps"])
    by_p50 = sorted(runs, key=lambda r: r["c1"]["p50_us"])
    result = {
        "target": runs[0]["target"],
        "port": runs[0]["port"],
        "c32": by_rps[len(runs) // 2]["c32"],
        "c1": by_p50[len(runs) // 2]["c1"],
        "rounds": len(runs),
    }
    if len(runs) > 1:
        result["all_rounds"] = [
            {
                "c32_rps": round(r["c32"]["rps"], 1),
                "c1_p50_us": r["c1"]["p50_us"],
                "c1_p99_us": r["c1"]["p99_us"],
                "cpu_us_per_request": r["c32"]["cpu_us_per_request"],
                "errors": r["c32"]["errors"] + r["c1"]["errors"],
            }
            for r in runs
        ]
    return result


def run_wrk(
    port: int, lua: Path, connections: int, duration: float, latency: bool = False, cpus: str | None = None
) -> dict:
    """wrk -t1 against `port`; `cpus`: pinned there (a taskset list)."""
    argv = ["wrk", "-t1", f"-c{connections}", f"-d{max(1, round(duration))}s", "--timeout", "10s", "-s", str(lua)]
    if cpus is not None:
        argv = ["taskset", "-c", cpus, *argv]
    if latency:
        argv.append("--latency")
    argv.append(f"http://127.0.0.1:{port}/v1/chat/completions")
    out = subprocess.run(argv, capture_output=True, text=True, timeout=duration + 60)
    match = re.search(r"^WRKJSON (\{.*\})$", out.stdout, re.MULTILINE)
    if out.returncode != 0 or not match:
        raise RuntimeError(f"wrk failed ({out.returncode}): {out.stdout[-2000:]} {out.stderr[-2000:]}")
    result = json.loads(match.group(1))
    non2xx = re.search(r"Non-2xx or 3xx responses:\s*(\d+)", out.stdout)
    result["non_2xx"] = int(non2xx.group(1)) if non2xx else 0
    result["errors"] = (
        result["err_connect"] + result["err_read"] + result["err_write"] + result["err_timeout"] + result["non_2xx"]
    )
    result["rps"] = result["requests"] / (result["duration_us"] / 1e6)
    return result


def measure(
    name: str, service: Service, lua: Path, duration: float, warmup: float, store: Service | None = None
) -> dict:
    """wrk at 32 connections (RPS, CPU) and at 1 (latency); `store`: a process whose CPU the target also costs."""
    print(
        f"[{time.strftime('%H:%M:%S')}] {name}: warmup {warmup:g}s, c32 {duration:g}s, c1 {duration:g}s",
        file=sys.stderr,
        flush=True,
    )
    port = service.port
    if warmup > 0:
        run_wrk(port, lua, 32, warmup)
    cpu0 = group_cpu_seconds(service.proc.pid)
    store_cpu0 = group_cpu_seconds(store.proc.pid) if store else 0.0
    c32 = run_wrk(port, lua, 32, duration)
    cpu = group_cpu_seconds(service.proc.pid) - cpu0
    if store and c32["requests"]:
        store_cpu = group_cpu_seconds(store.proc.pid) - store_cpu0
        c32["store_cpu_us_per_request"] = round(store_cpu / c32["requests"] * 1e6, 1)
    # CPU the target itself spent per request (excludes the static upstream behind it): independent of how much of
    # the shared cores it got, so it is the steadier number on a busy 2-core machine.
    c32["cpu_s"] = round(cpu, 3)
    c32["cpu_us_per_request"] = round(cpu / c32["requests"] * 1e6, 1) if c32["requests"] else None
    c32["cpu_util"] = round(cpu / (c32["duration_us"] / 1e6), 3)
    c1 = run_wrk(port, lua, 1, duration, latency=True)
    return {"target": name, "port": port, "c32": c32, "c1": c1}
