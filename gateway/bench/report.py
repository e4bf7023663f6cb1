"""Terminal table (one column per run) and the TTFT distribution plot."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any


def _num(value: Any, fmt: str = "{:.2f}") -> str:
    return "n/a" if value is None else fmt.format(value)


def _pct(value: Any) -> str:
    return "n/a" if value is None else f"{value * 100:.1f}%"


def _rows(result: Mapping[str, Any]) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = [
        ("Target", result.get("base_url", "")),
        ("Requests planned / sent", f"{result['plan']['num_requests']} / {result['plan']['sent']}"),
        ("Completed", str(result["completed"])),
        ("Failed", str(result["failed"])),
        ("Cancelled (max duration)", str(result["cancelled"])),
        ("Duration (s)", _num(result["duration_s"])),
        ("Request throughput (req/s)", _num(result["request_throughput"])),
        ("Output throughput (tok/s)", _num(result["output_throughput"])),
        ("Total token throughput (tok/s)", _num(result["total_token_throughput"])),
    ]
    for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2E latency")):
        stats = result[key]
        for stat in ("mean", "p50", "p90", "p99"):
            rows.append((f"{label} {stat} (ms)", _num(stats[stat])))
    goodput = result.get("goodput")
    if goodput:
        slo = ", ".join(
            f"{name} <= {goodput[key]:g} ms"
            for key, name in (("slo_ttft_ms", "TTFT"), ("slo_tpot_ms", "TPOT"))
            if goodput[key] is not None
        )
        rows.append((f"Goodput (req/s) [{slo}]", _num(goodput["request_goodput"])))
        rows.append(("SLO attainment", _pct(goodput["attainment"])))
    cache = result["prefix_cache"]
    rows.append(("Prefix cache hit rate (measured)", _pct(cache["measured_hit_rate"])))
    rows.append(("Prefix cache hit rate (oracle)", _pct(cache["oracle_hit_rate"])))
    rows.append(("  oracle, outputs cached too", _pct(cache.get("oracle_hit_rate_with_outputs"))))
    tenants = result.get("per_tenant") or {}
    if 1 < len(tenants) <= 16:
        for tenant, row in tenants.items():
            rows.append(
                (
                    f"Tenant {tenant}: requests, TTFT p50/p99 (ms)",
                    f"{row['requests']}, {_num(row['ttft_p50_ms'], '{:.0f}')}/{_num(row['ttft_p99_ms'], '{:.0f}')}",
                )
            )
    share = result.get("replica_share")
    if share:
        for name, row in share.items():
            rows.append((f"Replica {name} share", f"{_pct(row['share'])} ({row['requests']})"))
    else:
        rows.append(("Replica share", "n/a"))
    return rows


def format_table(results: Mapping[str, Mapping[str, Any]]) -> str:
    """One column per run; rows a run lacks (another run's replicas) show as blank."""
    per_run = {name: dict(_rows(r)) for name, r in results.items()}
    labels: list[str] = []
    for rows in per_run.values():
        labels += [label for label in rows if label not in labels]
    names = list(per_run)
    widths = [max(len(n), *(len(per_run[n].get(lab, "")) for lab in labels)) for n in names]
    label_width = max(len(lab) for lab in labels)
    head = " " * label_width + "  " + "  ".join(n.rjust(w) for n, w in zip(names, widths))
    lines = [head, "-" * len(head)]
    for lab in labels:
        lines.append(
            lab.ljust(label_width) + "  " + "  ".join(per_run[n].get(lab, "").rjust(w) for n, w in zip(names, widths))
        )
    for name, result in results.items():
        if errors := result.get("errors"):
            lines.append(f"[{name}] errors: " + "; ".join(f"{count}x {msg}" for msg, count in errors.items()))
    return "\n".join(lines)


def plot_ttft(results: Mapping[str, Mapping[str, Any]], path: str | Path) -> Path:
    """PNG of each run's TTFT distribution: empirical CDF (left) and box plot (right). Needs per-request rows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    series = {
        name: np.array(
            [row["ttft_ms"] for row in r.get("requests", []) if row.get("success") and row.get("ttft_ms") is not None],
            dtype=float,
        )
        for name, r in results.items()
    }
    fig, (cdf, box) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [2, 1]})

    def label(n: str, v: np.ndarray) -> str:
        return (
            f"{n} (p50 {np.percentile(v, 50):.0f}, p99 {np.percentile(v, 99):.0f} ms)" if v.size else f"{n} (no data)"
        )

    for name, values in series.items():
        xs = np.sort(values)
        cdf.step(xs, np.arange(1, xs.size + 1) / max(xs.size, 1), where="post", label=label(name, values))
    values = np.concatenate([v for v in series.values() if v.size] or [np.array([1.0])])
    if values.min() > 0 and values.max() / values.min() > 50:  # long tails: a log axis keeps the body readable
        cdf.set_xscale("log")
    cdf.set_xlabel("TTFT (ms)")
    cdf.set_ylabel("fraction of requests")
    cdf.set_title("TTFT, empirical CDF")
    cdf.grid(True, alpha=0.3)
    cdf.legend(fontsize="small", loc="lower right")
    box.boxplot([v if v.size else np.array([np.nan]) for v in series.values()], whis=(1, 99), showfliers=False)
    box.set_xticks(range(1, len(series) + 1), list(series), rotation=20, fontsize="small")
    box.set_ylabel("TTFT (ms)")
    box.set_title("whiskers p1-p99")
    box.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
