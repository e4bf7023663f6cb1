"""Guard cost on this machine: classifier latency per request and batched throughput, and gateway RPS guard off/on.

    python -m bench.guard_bench [--requests 200] [--json out.json]      # the classifier through its batcher
    python -m bench.guard_bench --device cuda [--quick]                  # on ONNX Runtime's CUDA provider
    python -m bench.guard_bench --proxy [--duration 10 --repeat 3] [--system agent] [--baseline DIR]
                                                                              # needs nginx and wrk (proxy_bench.py)

Stage figures: wall time of one `Guard.classify` call (tokenize + windows + micro-batcher + ONNX Runtime) for prompts
of 32, 128 and 512 tokens, at concurrency 1 (sequential callers) and 32 (32 callers in one event loop, sharing
batches), p50/p99 per request; throughput is prompts/s at concurrency 32 and 64. Model: the bundled int8 model on
the CPU (or what `--device`/`--model` pick). --proxy runs two gateways in front of the harness's static nginx
upstream, guard off and guard on (injection classifier, block), loaded with wrk -c32 and -c1 like waf_bench.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from gateway.guard.runtime import Guard
from gateway.guard.spec import GuardRuntime, InjectionPolicy

TEXT = (
    "Our team is preparing the annual planning document and needs a clear overview of the project milestones, "
    "the budget for each quarter, the hiring plan for engineering and support, and the risks we see in the "
    "supply chain. Please write it in plain language for the board, with a short summary first, then one "
    "section per topic, and finish with the three decisions we need from them this month. "
) * 8


def prompt_of(guard: Guard, tokens: int) -> str:
    tok = guard.model.members[0].tokenizer  # an ensemble: the first model's tokens
    ids = tok.encode(TEXT, add_special_tokens=False).ids[: tokens - 2]
    return tok.decode(ids)


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


async def latency(guard: Guard, text: str, policy, settings, concurrency: int, requests: int) -> dict:
    lat: list[float] = []
    per_worker = max(1, requests // concurrency)

    async def worker():
        for _ in range(per_worker):
            started = time.perf_counter()
            await guard.classify([text], policy, settings)
            lat.append(time.perf_counter() - started)

    await guard.classify([text], policy, settings)  # warm this shape
    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    return {
        "p50_ms": round(pct(lat, 0.5) * 1e3, 2),
        "p99_ms": round(pct(lat, 0.99) * 1e3, 2),
        "prompts_per_s": round(len(lat) / elapsed, 1),
        "n": len(lat),
    }


async def stage(args: argparse.Namespace) -> dict:
    settings = GuardRuntime(
        model=args.model,
        device=args.device,
        threads=args.threads,
        max_batch=args.max_batch,
        max_wait_us=args.max_wait_us,
    )
    guard = Guard()
    guard.load(settings)
    policy = InjectionPolicy()
    windows = {n: len(guard.windows([prompt_of(guard, n)], policy).items) for n in (32, 128, 512)}
    out = {
        "model": str(guard.model.path),
        "provider": guard.model.providers[0],
        "window_tokens": guard.model.max_length,
        "windows_per_prompt": windows,
        "max_batch": args.max_batch,
        "max_wait_us": args.max_wait_us,
        "latency": {},
        "throughput": {},
    }
    for tokens in (128,) if args.quick else (32, 128, 512):
        text = prompt_of(guard, tokens)
        for concurrency in (1,) if args.quick else (1, 32):
            n = args.requests if concurrency == 1 else max(args.requests, 8 * concurrency)
            if tokens == 512:
                n = max(concurrency, n // 4)
            r = await latency(guard, text, policy, settings, concurrency, n)
            out["latency"][f"{tokens}tok_c{concurrency}"] = r
            print(
                f"{tokens:4} tokens  c{concurrency:<3} p50 {r['p50_ms']:7.2f} ms  p99 {r['p99_ms']:7.2f} ms  "
                f"{r['prompts_per_s']:7.1f} prompts/s",
                flush=True,
            )
    for tokens in (128,) if args.quick else (32, 128):
        text = prompt_of(guard, tokens)
        r = await latency(guard, text, policy, settings, 64, 64 if args.quick else 64 * 8)
        out["throughput"][f"{tokens}tok_c64"] = r["prompts_per_s"]
        print(
            f"throughput {tokens} tokens c64: {r['prompts_per_s']:.1f} prompts/s "
            f"(batches: {guard.largest_batch} largest)",
            flush=True,
        )
    await guard.aclose()
    return out


# An agent's system prompt (about 230 tokens): the same on every request of a deployment
SYSTEM_PROMPT = (
    "You are the customer support assistant of Northwind Outfitters, an online shop for hiking and camping gear. "
    "Answer questions about orders, shipping, returns, sizing and product care. Be friendly and brief: two or three "
    "sentences unless the customer asks for detail. Use the order tools to look up an order before you say anything "
    "about its status, and never guess a tracking number. Returns are accepted within 60 days for unused items with "
    "their tags; worn footwear can be returned within 14 days if it does not fit. Refunds go back to the original "
    "payment method within five business days of the return arriving at the warehouse. If a customer is upset, "
    "acknowledge it once, then focus on what you can do. Do not discuss competitors, discounts that are not in the "
    "current promotions list, or internal processes. Hand the conversation to a human agent when the customer asks "
    "for one, when a payment dispute is mentioned, or when you cannot help after two tries."
)


def proxy(duration: float, repeat: int, system: str, baseline: Path | None, only: list[str] | None = None) -> int:
    """Gateway throughput and latency with the guard off and on, same upstream, interleaved rounds: with the bundled
    guard, with it reading every text afresh (score reuse off), the English model alone, and an earlier commit's."""
    from bench.harness.compare import compare_policies
    from bench.harness.upstream import REQUEST
    from gateway.guard.model import MODELS_DIR

    # "Say hello." (the proxy benchmark's prompt) is a false positive of the bundled model: ask something else
    request = {
        **REQUEST,
        "messages": [
            {"role": "system", "content": SYSTEM_PROMPT if system == "agent" else "You are terse."},
            {"role": "user", "content": "What is the capital of France? (ticket @N@)"},  # a new one each request
        ],
    }
    on = {"guard": {"enabled": True}}  # the bundled two-model guard, blocking
    variants = {
        "guard_off": {"guard": {}},
        "guard_on_injection_block": on,
        "guard_on_no_score_reuse": {"guard": {"enabled": True, "runtime": {"score_cache": 0}}},
        "guard_on_english_model_only": {
            "guard": {"enabled": True, "runtime": {"model": str(MODELS_DIR / "minilm-pi")}}
        },
    }
    if baseline is not None:
        variants["baseline_guard_on"] = on
    if only:
        variants = {name: spec for name, spec in variants.items() if name in only}
    checkouts = {"baseline_guard_on": baseline} if baseline is not None else None
    return compare_policies("guard", variants, duration, repeat, request=request, checkouts=checkouts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--model")
    parser.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--max-wait-us", type=int, default=500)
    parser.add_argument("--json", help="write the stage results here")
    parser.add_argument("--quick", action="store_true", help="128 tokens alone: c1 latency, c64 throughput (a smoke)")
    parser.add_argument("--proxy", action="store_true")
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--system", choices=["terse", "agent"], default="terse", help="--proxy: a 4-token or a 230-token system prompt"
    )
    parser.add_argument("--baseline", type=Path, help="--proxy: an earlier commit's checkout (git worktree) as a row")
    parser.add_argument("--only", nargs="+", help="--proxy: these rows alone (more rounds in the same time)")
    args = parser.parse_args(argv)
    if args.proxy:
        return proxy(args.duration, args.repeat, args.system, args.baseline, args.only)
    out = asyncio.run(stage(args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
