"""WAF stage cost: one evaluation of a typical 2 KB chat request with every built-in pack at paranoia level 2, and
of bodies of 16, 64 and 256 KB (prompt text), on this machine; plus the cost of a request with nothing to match.

    python -m tests.bench.waf_bench [--iterations 2000]

Each figure is the median (and p99) of single `CompiledWaf.evaluate` + `RequestView` construction calls, the work
the stage does per request (span attributes and the audit line aside).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import string
import time

from gateway.waf.model import WafSpec
from gateway.waf.packs import builtin_packs, compile_waf, pack_rules
from gateway.waf.parts import RequestView

HEADERS = [("host", "gateway.internal:8080"), ("user-agent", "OpenAI/Python 1.40.0"),
           ("content-type", "application/json"), ("accept", "application/json"),
           ("authorization", "Bearer sk-0123456789abcdef0123456789abcdef"), ("x-stainless-lang", "python"),
           ("x-stainless-package-version", "1.40.0"), ("x-request-id", "a3f1c2d4e5"),
           ("accept-encoding", "gzip, deflate"), ("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")]


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
    payload = {"model": "SmolLM2-135M-Instruct", "temperature": 0.7, "max_tokens": 256, "stream": True,
               "stream_options": {"include_usage": True}, "user": "user-1234",
               "messages": [{"role": "system", "content": system},
                            {"role": "user", "content": ""}]}
    overhead = len(json.dumps(payload))
    payload["messages"][1]["content"] = prose(max(body_bytes - overhead, 16), rng)
    body = json.dumps(payload).encode()
    return RequestView(method="POST", path="/v1/chat/completions", headers=HEADERS, body=body, payload=payload,
                       route="chat", client_ip="10.0.0.7", tenant="team-a", key_label="ops", model=payload["model"])


def measure(waf, body_bytes: int, iterations: int) -> dict:
    rng = random.Random(body_bytes)
    views = [chat_view(body_bytes, rng) for _ in range(8)]
    samples = []
    for i in range(iterations):
        source = views[i % len(views)]
        started = time.perf_counter()
        view = RequestView(method=source.method, path=source.path, headers=source.headers, body=source.body,
                           payload=source.payload, route=source.route, client_ip=source.client_ip,
                           tenant=source.tenant, key_label=source.key_label, model=source.model)
        verdict = waf.evaluate(view)
        samples.append(time.perf_counter() - started)
        assert not verdict.blocked, verdict.rule_ids
    samples.sort()
    return {"body_bytes": len(views[0].body), "p50_us": round(statistics.median(samples) * 1e6, 1),
            "p99_us": round(samples[int(len(samples) * 0.99)] * 1e6, 1), "iterations": iterations}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--level", type=int, default=2)
    args = parser.parse_args(argv)
    packs = sorted(builtin_packs()[0])
    waf = compile_waf(WafSpec(paranoia_level=args.level, packs=packs), pack_rules({}), "bench")
    print(f"{len(waf.rules)} rules from packs {', '.join(packs)} at paranoia level {args.level}")
    for size in (2 * 1024, 16 * 1024, 64 * 1024, 256 * 1024):
        iterations = args.iterations if size <= 16 * 1024 else max(args.iterations // 10, 50)
        result = measure(waf, size, iterations)
        per_kb = result["p50_us"] / (result["body_bytes"] / 1024)
        print(f"body {result['body_bytes']:>7} B: p50 {result['p50_us']:>8.1f} us  p99 {result['p99_us']:>8.1f} us"
              f"  ({per_kb:.1f} us/KB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
