"""`portcullis bench serve`: the argparse wiring gateway/cli.py mounts with add_subcommands()."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from gateway.bench.workload import WORKLOADS


def _run_spec(text: str) -> tuple[str, str]:
    name, sep, url = text.partition("=")
    if not sep or not name or not url:
        raise argparse.ArgumentTypeError(f"expected NAME=URL, got {text!r}")
    return name, url


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def add_subcommands(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks")
    sub = bench.add_subparsers(dest="bench_command", metavar="COMMAND")
    sub.required = True
    s = sub.add_parser(
        "serve",
        help="load-test an OpenAI-compatible endpoint (this gateway, an engine, anything else)",
        description="Streams chat completions from a seeded, deterministic request sequence and reports TTFT, "
        "TPOT, ITL, E2E latency, throughput, goodput, prefix-cache hit rate and per-replica share.",
    )
    target = s.add_argument_group("target")
    target.add_argument("--base-url", help="http://host:port (or .../v1); not with --runs")
    target.add_argument(
        "--runs",
        nargs="+",
        type=_run_spec,
        metavar="NAME=URL",
        help="run the same request sequence against each target in turn",
    )
    target.add_argument("--name", default="run", help="the run's name with --base-url (default: run)")
    target.add_argument("--model", help="model name (default: the first of GET /v1/models)")
    target.add_argument("--api-key", help="Bearer key for every request")
    target.add_argument("--api-keys", help="comma-separated keys, tenant i uses key i mod count")
    target.add_argument(
        "--extra-body",
        type=_json_object,
        default={},
        metavar="JSON",
        help="merged into every request body, e.g. '{\"top_p\": 0.9}'",
    )
    target.add_argument("--request-timeout", type=float, default=600.0, metavar="S")
    target.add_argument(
        "--reset-prefix-cache",
        nargs="+",
        default=[],
        metavar="ENGINE_URL",
        help="POST /reset_prefix_cache to these engines before each run (cold caches)",
    )
    w = s.add_argument_group("workload")
    w.add_argument("--workload", choices=WORKLOADS, default="random")
    w.add_argument("--num-requests", type=int, help="default: 100 (random), conversations x turns (shared-prefix)")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--input-len", type=int, default=256, help="random: prompt tokens")
    w.add_argument("--range-ratio", type=float, default=0.0, help="random: prompt length spread, [0, 1)")
    w.add_argument("--tenants", type=int, default=8, help="shared-prefix: tenants, one system prompt each")
    w.add_argument("--system-prompt-len", type=int, default=1000, help="shared-prefix: system prompt tokens")
    w.add_argument(
        "--conversations",
        type=int,
        default=32,
        help="shared-prefix: conversations in flight; a finished one is replaced by a new one",
    )
    w.add_argument("--turns", type=int, default=4, help="shared-prefix: user turns per conversation")
    w.add_argument("--user-len", type=int, default=64, help="shared-prefix: tokens per user message")
    w.add_argument(
        "--hot-tenant-share",
        type=float,
        help="shared-prefix: fraction of conversations for tenant 0 (default: round robin)",
    )
    load = s.add_argument_group("load")
    load.add_argument("--concurrency", type=int, help="max requests in flight (default 16 without --request-rate)")
    load.add_argument("--request-rate", type=float, help="Poisson arrivals per second")
    load.add_argument("--max-duration", type=float, metavar="S", help="hard cap on the run's wall time")
    load.add_argument("--output-len", type=int, default=32, help="max_tokens per request")
    load.add_argument("--temperature", type=float, default=0.0)
    load.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM, the bundled engine)")
    rep = s.add_argument_group("report")
    rep.add_argument("--slo-ttft-ms", type=float)
    rep.add_argument("--slo-tpot-ms", type=float)
    rep.add_argument("--tokenizer", help="'bundled' or a tokenizer.json, for the oracle prefix-hit rate")
    rep.add_argument("--block-size", type=int, default=16, help="oracle block granularity (default 16)")
    rep.add_argument("--json", metavar="PATH", help='write {"runs": {name: result}} here')
    rep.add_argument("--no-request-rows", action="store_true", help="leave per-request rows out of the JSON")
    rep.add_argument("--plot", metavar="PNG", help="write the TTFT distributions of the runs here")
    s.set_defaults(func=serve)


def serve(args: argparse.Namespace) -> int:
    from gateway.bench import BenchConfig, format_table, plot_ttft, run_benchmark

    if bool(args.base_url) == bool(args.runs):
        print("portcullis bench serve: give --base-url or --runs (one of them)", file=sys.stderr)
        return 2
    targets = args.runs or [(args.name, args.base_url)]
    if len({name for name, _ in targets}) != len(targets):
        print("portcullis bench serve: --runs names must differ", file=sys.stderr)
        return 2
    if args.api_key and args.api_keys:
        print("portcullis bench serve: --api-key or --api-keys, not both", file=sys.stderr)
        return 2
    keys = tuple(k for k in (args.api_keys or "").split(",") if k) or ((args.api_key,) if args.api_key else ())
    concurrency = args.concurrency if args.concurrency is not None else (None if args.request_rate else 16)
    try:
        base = BenchConfig(
            workload=args.workload,
            num_requests=args.num_requests,
            seed=args.seed,
            input_len=args.input_len,
            range_ratio=args.range_ratio,
            tenants=args.tenants,
            system_prompt_len=args.system_prompt_len,
            conversations=args.conversations,
            turns=args.turns,
            user_len=args.user_len,
            hot_tenant_share=args.hot_tenant_share,
            request_rate=args.request_rate,
            model=args.model,
            concurrency=concurrency,
            output_len=args.output_len,
            temperature=args.temperature,
            ignore_eos=args.ignore_eos,
            api_keys=keys,
            extra_body=args.extra_body,
            slo_ttft_ms=args.slo_ttft_ms,
            slo_tpot_ms=args.slo_tpot_ms,
            max_duration_s=args.max_duration,
            request_timeout_s=args.request_timeout,
            tokenizer=args.tokenizer,
            block_size=args.block_size,
            reset_prefix_cache=tuple(args.reset_prefix_cache),
            keep_requests=bool(args.plot) or not args.no_request_rows,
        )
    except ValueError as exc:
        print(f"portcullis bench serve: {exc}", file=sys.stderr)
        return 2
    results: dict[str, dict] = {}
    for name, url in targets:
        print(f"bench: {name} -> {url} ({base.workload}, {base.total_requests} requests)", file=sys.stderr)
        try:
            results[name] = run_benchmark(dataclasses.replace(base, name=name, base_url=url))
            for engine, outcome in (results[name]["reset_prefix_cache"] or {}).items():
                if outcome != "ok":
                    print(f"bench: {name}: could not reset {engine}'s prefix cache: {outcome}", file=sys.stderr)
        except Exception as exc:  # the target is down or /v1/models failed: report, go on with the next
            print(f"bench: {name} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
    if results:
        print(format_table(results))
    if args.plot and results:
        print(f"bench: TTFT plot -> {plot_ttft(results, args.plot)}", file=sys.stderr)
    if args.json:
        rows = (
            results
            if not args.no_request_rows
            else {n: {k: v for k, v in r.items() if k != "requests"} for n, r in results.items()}
        )
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"runs": rows}, indent=2))
    completed = all(name in results and results[name]["completed"] for name, _ in targets)
    return 0 if completed else 1
