"""`portcullis bench serve` as a library: a seeded load generator for OpenAI-compatible chat endpoints.

    from gateway.bench import BenchConfig, run_benchmark, plot_ttft
    base = BenchConfig(workload="shared-prefix", tenants=8, system_prompt_len=1000, conversations=32, turns=4,
                       concurrency=16, output_len=32, seed=0, tokenizer="bundled", model="SmolLM2-135M-Instruct")
    results = {name: run_benchmark(dataclasses.replace(base, name=name, base_url=url)) for name, url in targets}
    plot_ttft(results, "ttft.png")

A result is a JSON-ready dict: name, base_url, model, started_at, config (api_keys as a count),
reset_prefix_cache {engine_url: "ok" | error} or None, plan {num_requests, sent, fingerprint (sha256 of the
request sequence: equal across runs with the same workload options and seed)}, duration_s, completed, failed,
cancelled, errors {message: count}, total_input_tokens, total_output_tokens, request_throughput (req/s),
output_throughput and total_token_throughput (tok/s), ttft_ms / tpot_ms / itl_ms / e2el_ms {mean, p50, p90, p99},
goodput {slo_ttft_ms, slo_tpot_ms, good_requests, request_goodput (req/s), attainment} or None, replica_share
{replica: {requests, share}} or None (no x-portcullis-replica header seen), per_tenant {tenant: {requests,
completed, failed, ttft_p50_ms, ttft_p99_ms, measured_hit_rate}}, prefix_cache {measured_hit_rate, cached_tokens,
prompt_tokens, oracle_hit_rate, oracle_hit_rate_with_outputs, oracle_cached_tokens, oracle_prompt_tokens,
tokenizer, block_size} (oracle fields None without a tokenizer), and requests [{index, tenant, conversation, turn,
start_s, success, status, error, cancelled, ttft_ms, tpot_ms, e2el_ms, output_tokens, prompt_tokens, cached_tokens,
replica, oracle_prompt_tokens, oracle_cached_tokens}] unless keep_requests=False. The CLI's --json file is
{"runs": {name: result}}. Metric definitions: gateway/bench/metrics.py.
"""

from __future__ import annotations

import importlib
from typing import Any

# Lazy, so mounting the CLI (`portcullis serve` too) imports neither numpy nor matplotlib.
_EXPORTS = {
    "BenchConfig": "runner",
    "run_benchmark": "runner",
    "run_benchmark_async": "runner",
    "format_table": "report",
    "plot_ttft": "report",
    "RequestResult": "metrics",
    "oracle_hit_rate": "metrics",
    "oracle_hits": "metrics",
    "summarize": "metrics",
    "PlannedRequest": "workload",
    "WorkloadSpec": "workload",
    "build_plan": "workload",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'gateway.bench' has no attribute {name!r}")
    return getattr(importlib.import_module(f"gateway.bench.{_EXPORTS[name]}"), name)
