"""What a run prints and records: the machine it ran on, the load average, and the table of targets."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

from bench.harness.gateways import REPO, litellm_version


def machine() -> dict:
    def cmd(*argv: str) -> str:
        try:
            out = subprocess.run(argv, capture_output=True, text=True, timeout=10)
            return (out.stdout + out.stderr).strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""

    model = next(
        (line.split(":", 1)[1].strip() for line in cmd("lscpu").splitlines() if line.startswith("Model name")),
        platform.processor(),
    )
    mem_kb = next(
        (
            int(line.split()[1])
            for line in Path("/proc/meminfo").read_text().splitlines()
            if line.startswith("MemTotal")
        ),
        0,
    )
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "ram_gib": round(mem_kb / 1024 / 1024, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "nginx": cmd("nginx", "-v").replace("nginx version: ", ""),
        "wrk": cmd("wrk", "--version").splitlines()[0].split(" [")[0] if cmd("wrk", "--version") else "",
        "litellm": litellm_version(),
        "commit": cmd("git", "-C", str(REPO), "rev-parse", "--short", "HEAD"),
        "gateway_uncommitted": cmd("git", "-C", str(REPO), "status", "--porcelain", "--", "gateway").splitlines(),
    }


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def table(results: list[dict]) -> str:
    direct = next((r for r in results if r["target"] == "direct"), None)
    width = max(30, *(len(r["label"]) for r in results))
    header = (
        f"{'target':<{width}} {'RPS c32':>9} {'err':>5} {'p50 c1 ms':>10} {'p99 c1 ms':>10} "
        f"{'+p50 ms':>8} {'+p99 ms':>8} {'RPS c1':>8} {'CPU us/req':>10} {'CPU util':>8}"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        c32, c1 = r["c32"], r["c1"]
        p50, p99 = c1["p50_us"] / 1000, c1["p99_us"] / 1000
        add50 = add99 = "-"
        if direct is not None and r is not direct:
            add50 = f"{p50 - direct['c1']['p50_us'] / 1000:.3f}"
            add99 = f"{p99 - direct['c1']['p99_us'] / 1000:.3f}"
        errors = sum(x["errors"] for x in r["all_rounds"]) if "all_rounds" in r else c32["errors"] + c1["errors"]
        lines.append(
            f"{r['label']:<{width}} {c32['rps']:>9.0f} {errors:>5} {p50:>10.3f} {p99:>10.3f} "
            f"{add50:>8} {add99:>8} {c1['rps']:>8.0f} {c32['cpu_us_per_request']:>10} {c32['cpu_util']:>8}"
        )
    return "\n".join(lines)


def add_latency_deltas(results: list[dict]) -> None:
    direct = next((r for r in results if r["target"] == "direct"), None)
    for r in results:
        if direct is not None and r is not direct:
            r["added_p50_ms"] = round((r["c1"]["p50_us"] - direct["c1"]["p50_us"]) / 1000, 3)
            r["added_p99_ms"] = round((r["c1"]["p99_us"] - direct["c1"]["p99_us"]) / 1000, 3)
