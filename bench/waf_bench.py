"""WAF stage cost: one evaluation of a typical 2 KB chat request with every built-in pack at paranoia level 2, and
of bodies of 16, 64 and 256 KB (prompt text), on this machine; plus the cost of a request with nothing to match.

    python -m bench.waf_bench [--iterations 2000]
    python -m bench.waf_bench --proxy [--duration 10 --repeat 3]   # needs nginx and wrk, like proxy_bench.py
    python -m bench.waf_bench --instructions [--checkout DIR]      # needs valgrind

Each figure is the median (and p99) of single `CompiledWaf.evaluate` + `RequestView` construction calls, the work
the stage does per request (span attributes and the audit line aside), in thread CPU time (steadier than wall time on
a shared machine) and wall time.

--instructions counts the same work for the 2 KB request in instructions, which a busy machine cannot move: the
evaluations run under callgrind with instrumentation switched on only around them (`callgrind_control -i on/off`),
once 200 and once 1000 times, and the difference is divided by 800, so start-up, warm-up and the switching cancel
out. --checkout measures another tree (a `git worktree` of an earlier commit) with these same requests.

--proxy runs two gateways (access log off) in front of the harness's static nginx upstream, one with no WAF and one
with every built-in pack at PL2, and loads each with wrk -c32 (throughput, gateway CPU per request) and -c1 (p50/p99),
interleaved over --repeat rounds; the median round is reported.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import random
import re
import statistics
import string
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gateway.waf.model import WafSpec
from gateway.waf.packs import builtin_packs, compile_waf, pack_rules
from gateway.waf.parts import RequestView

HEADERS = [
    ("host", "gateway.internal:8080"),
    ("user-agent", "OpenAI/Python 1.40.0"),
    ("content-type", "application/json"),
    ("accept", "application/json"),
    ("authorization", "Bearer sk-0123456789abcdef0123456789abcdef"),
    ("x-stainless-lang", "python"),
    ("x-stainless-package-version", "1.40.0"),
    ("accept-encoding", "gzip, deflate"),
    ("x-request-id", "a3f1c2d4e5"),
    ("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),
]


def prose(size: int, rng: random.Random) -> str:
    words = []
    total = 0
    while total < size:
        word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 9)))
        if rng.random() < 0.08:
            word += rng.choice([",", ".", "?", ";", ":"])
        words.append(word)
        total += len(word) + 1
    return " ".join(words)[:size]


def chat_view(body_bytes: int, rng: random.Random) -> RequestView:
    system = "You are a helpful assistant. Answer briefly and cite sources when you can."
    payload = {
        "model": "SmolLM2-135M-Instruct",
        "temperature": 0.7,
        "max_tokens": 256,
        "stream": True,
        "stream_options": {"include_usage": True},
        "user": "user-1234",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": ""}],
    }
    overhead = len(json.dumps(payload))
    payload["messages"][1]["content"] = prose(max(body_bytes - overhead, 16), rng)
    body = json.dumps(payload).encode()
    return RequestView(
        method="POST",
        path="/v1/chat/completions",
        headers=HEADERS,
        body=body,
        payload=payload,
        route="chat",
        client_ip="10.0.0.7",
        tenant="team-a",
        key_label="ops",
        model=payload["model"],
    )


_REQUEST_IDS = itertools.count()  # every measured request gets ids no earlier request had, whatever the body size


def next_request(source: RequestView) -> RequestView:
    """The source request again, with what differs between real requests even from one client: request id and
    trace context."""
    rid = next(_REQUEST_IDS)
    headers = source.headers[:-2] + [
        ("x-request-id", f"{rid:010x}"),
        ("traceparent", f"00-{rid:032x}-{rid * 7919:016x}-01"),
    ]
    return dataclasses.replace(source, headers=headers)  # a new view: nothing extracted from the source is kept


def warmed_up(waf, body_bytes: int) -> list[RequestView]:
    """Eight requests of the size, each evaluated once: compiled sets' DFAs and the per-value caches are warm."""
    rng = random.Random(body_bytes)
    views = [chat_view(body_bytes, rng) for _ in range(8)]
    for view in views:
        waf.evaluate(view)
    return views


def measure(waf, body_bytes: int, iterations: int) -> dict:
    views = warmed_up(waf, body_bytes)
    cpu, wall = [], []
    for i in range(iterations):
        started, started_cpu = time.perf_counter(), time.thread_time()
        verdict = waf.evaluate(next_request(views[i % len(views)]))
        cpu.append(time.thread_time() - started_cpu)
        wall.append(time.perf_counter() - started)
        assert not verdict.blocked, verdict.rule_ids
    cpu.sort()
    wall.sort()
    return {
        "body_bytes": len(views[0].body),
        "p50_us": round(statistics.median(cpu) * 1e6, 1),
        "p99_us": round(cpu[int(len(cpu) * 0.99)] * 1e6, 1),
        "wall_p50_us": round(statistics.median(wall) * 1e6, 1),
        "iterations": iterations,
    }


def proxy(duration: float, repeat: int) -> int:
    """Gateway throughput and latency with the WAF off and on (all packs, PL2), same upstream, interleaved rounds."""
    from bench.harness.compare import compare_policies

    all_packs = {"paranoia_level": 2, "packs": sorted(builtin_packs()[0])}
    return compare_policies(
        "waf",
        {"waf_off": {"waf": {}}, "waf_on_all_packs_pl2": {"waf": all_packs}},
        duration,
        repeat,
        headers={"User-Agent": "OpenAI/Python 1.40.0"},
    )


COUNTED = (200, 1000)  # evaluations per callgrind run: the difference is what the extra ones cost


def instructions(checkout: Path, level: int) -> int:
    """Instructions per evaluation of the 2 KB request, by the difference of two callgrind runs."""
    collected = []
    env = {**os.environ, "PYTHONPATH": str(checkout)}  # that tree's gateway package, this file's requests
    for count in COUNTED:
        with tempfile.TemporaryDirectory() as tmp:
            argv = [sys.executable, str(Path(__file__).resolve()), "--count", str(count), "--level", str(level)]
            run = subprocess.run(
                ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={tmp}/out", *argv],
                capture_output=True,
                text=True,
                cwd=checkout,
                env=env,
            )
            found = re.findall(r"Collected : (\d+)", run.stderr)
            if run.returncode != 0 or not found:
                raise SystemExit(f"callgrind run failed ({run.returncode}):\n{run.stderr[-2000:]}")
            collected.append(int(found[-1]))
    return (collected[1] - collected[0]) // (COUNTED[1] - COUNTED[0])


def count(waf, evaluations: int) -> None:
    """Evaluate the 2 KB request `evaluations` times with callgrind's instrumentation on (run under callgrind)."""
    views = warmed_up(waf, 2 * 1024)
    for i in range(300):  # the per-value memories settle as they would in a serving process
        waf.evaluate(next_request(views[i % len(views)]))
    subprocess.run(["callgrind_control", "-i", "on", str(os.getpid())], capture_output=True, check=True)
    for i in range(evaluations):
        waf.evaluate(next_request(views[i % len(views)]))
    subprocess.run(["callgrind_control", "-i", "off", str(os.getpid())], capture_output=True, check=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--level", type=int, default=2)
    parser.add_argument("--proxy", action="store_true", help="gateway RPS and latency with the WAF off and on")
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--instructions", action="store_true", help="instructions per 2 KB evaluation (callgrind)")
    parser.add_argument("--checkout", type=Path, default=Path.cwd(), help="the tree --instructions measures")
    parser.add_argument("--count", type=int, help=argparse.SUPPRESS)  # one callgrind run of --instructions
    args = parser.parse_args(argv)
    if args.proxy:
        return proxy(args.duration, args.repeat)
    if args.instructions:
        per = instructions(args.checkout.resolve(), args.level)
        print(f"{args.checkout}: {per:,} instructions per evaluation of the 2 KB request (PL{args.level})")
        return 0
    packs = sorted(builtin_packs()[0])
    waf = compile_waf(WafSpec(paranoia_level=args.level, packs=packs), pack_rules({}), "bench")
    if args.count:
        count(waf, args.count)
        return 0
    print(f"{len(waf.rules)} rules from packs {', '.join(packs)} at paranoia level {args.level}")
    for size in (2 * 1024, 16 * 1024, 64 * 1024, 256 * 1024):
        iterations = args.iterations if size <= 16 * 1024 else max(args.iterations // 10, 50)
        result = measure(waf, size, iterations)
        per_kb = result["p50_us"] / (result["body_bytes"] / 1024)
        print(
            f"body {result['body_bytes']:>7} B: CPU p50 {result['p50_us']:>8.1f} us  p99 {result['p99_us']:>8.1f} us"
            f"  ({per_kb:.1f} us/KB)  wall p50 {result['wall_p50_us']:>8.1f} us"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
