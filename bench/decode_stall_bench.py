"""How long a long prompt arriving holds back the streams already decoding, for each `--max-decode-stall`.

    .venv/bin/python -m bench.decode_stall_bench --stalls 0 0.2 --rounds 2

For each round and each stall bound in turn (interleaved, so a machine that slows down mid-run hits both), starts one
bundled engine (`--threads 2 --compute int8 --max-decode-stall S`), lets `--streams` requests decode (`ignore_eos`,
150 tokens each), and one second later sends `--prompts` cold prompts of `--prompt-words` words one after another.
Prints the inter-token gaps of the decoding streams (p50, p99, max) and each prompt's time to first token. The
figures and the machine go in docs/benchmarks.md (engine serving path).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

from bench.routing_bench import MODEL, free_port, spawn, uptime
from gateway.bench.workload import WORDS


def text(seed: str, words: int) -> str:
    rng = random.Random(seed)
    return f"{seed}: " + " ".join(rng.choice(WORDS) for _ in range(words))


async def stream(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int, gaps: list[float]) -> float:
    """Stream one chat completion; append the gaps between its content tokens; return its time to first token."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    started = time.perf_counter()
    first = last = None
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or [{}]
            if not (choices[0].get("delta") or {}).get("content"):
                continue  # the role chunk comes before any token
            now = time.perf_counter()
            if last is None:
                first = now - started
            else:
                gaps.append(now - last)
            last = now
    assert first is not None, "no token streamed"
    return first


async def measure(url: str, tag: str, streams: int, prompts: int, words: int) -> tuple[list[float], list[float]]:
    async with httpx.AsyncClient(timeout=600) as client:
        await stream(client, url, "Say hi.", 2, [])  # first-call costs out of the way
        gaps: list[float] = []
        decoding = [
            asyncio.create_task(stream(client, url, text(f"{tag}-d{i}", 20), 150, gaps)) for i in range(streams)
        ]
        await asyncio.sleep(1.0)
        ttfts = [await stream(client, url, text(f"{tag}-long{k}", words), 1, []) for k in range(prompts)]
        await asyncio.gather(*decoding)
    return sorted(gaps), ttfts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stalls", type=float, nargs="+", default=[0.0, 0.2])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--prompt-words", type=int, default=900)
    ap.add_argument("--log", type=Path, default=Path("/tmp/decode_stall_engine.log"))
    args = ap.parse_args(argv)
    for round_ in range(args.rounds):
        for stall in args.stalls if round_ % 2 == 0 else reversed(args.stalls):
            port = free_port()
            cmd = [sys.executable, "-m", "gateway.cli", "engine", "serve", "--port", str(port), "--threads", "2"]
            cmd += ["--compute", "int8", "--max-decode-stall", str(stall)]
            engine = spawn("engine", cmd, port, args.log, "/health", timeout=600)
            try:
                load = uptime()
                gaps, ttfts = asyncio.run(
                    measure(engine.url, f"r{round_}s{stall}", args.streams, args.prompts, args.prompt_words)
                )
            finally:
                engine.stop()
            p50, p99 = statistics.median(gaps) * 1e3, gaps[int(0.99 * len(gaps))] * 1e3
            print(
                f"round {round_ + 1}, max_decode_stall {stall}: inter-token gaps p50 {p50:.0f} ms, p99 {p99:.0f} ms, "
                f"max {gaps[-1] * 1e3:.0f} ms ({len(gaps)} gaps); "
                f"prompts' TTFT {', '.join(f'{t:.2f}' for t in ttfts)} s; load {load}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
