"""Calibrate the routing cost's decode weight: how many prefill tokens one running stream is worth.

    .venv/bin/python -m bench.decode_weight_bench --compute int8 --streams 8 --prompt-words 700

Starts one bundled engine (`--threads 1`), then measures the time to first token of a cold prompt (a fresh one
each trial, so nothing is cached) twice over: on an idle engine, and while `--streams` other requests are decoding
(long `max_tokens`, `ignore_eos`). The prompt's prefill time per token is TTFT_idle / P; each decoding stream
adds (TTFT_busy - TTFT_idle) / streams, so the weight is that over the per-token time, in prompt tokens per
stream. Medians over `--trials`. gateway/routing/policies.py's default `decode_weight` comes from this script; the
figure and the machine go in docs/benchmarks.md (routing).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

from bench.routing_bench import MODEL, free_port, spawn, uptime


def prefill_seconds(url: str, trial: int, words: int) -> tuple[float, int]:
    """One cold prompt with max_tokens=1: the whole request is its prefill plus one sampled token."""
    text = f"Trial {trial}. " + " ".join(f"w{trial}x{i}" for i in range(words))
    started = time.perf_counter()
    r = httpx.post(
        url + "/v1/completions",
        json={"model": MODEL, "prompt": text, "max_tokens": 1, "temperature": 0},
        timeout=600,
    )
    r.raise_for_status()
    return time.perf_counter() - started, r.json()["usage"]["prompt_tokens"]


def running(url: str) -> int:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:num_requests_running"):
            return int(float(line.split()[-1]))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--compute", choices=["float32", "int8"], default="int8")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--prompt-words", type=int, default=700)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--log", type=Path, default=Path("/tmp/decode_weight_engine.log"))
    args = ap.parse_args(argv)
    port = free_port()
    cmd = [sys.executable, "-m", "gateway.cli", "engine", "serve", "--port", str(port), "--threads", "1"]
    engine = spawn("engine", [*cmd, "--compute", args.compute], port, args.log, "/health", timeout=600)
    stop = threading.Event()
    try:
        prefill_seconds(engine.url, -1, 50)  # warm-up
        idle = [prefill_seconds(engine.url, t, args.prompt_words) for t in range(args.trials)]

        def decode_forever(n: int) -> None:
            while not stop.is_set():
                with contextlib.suppress(httpx.HTTPError):  # the engine stops under it at the end
                    httpx.post(
                        engine.url + "/v1/completions",
                        json={"model": MODEL, "prompt": f"Stream {n}: go on.", "max_tokens": 400, "ignore_eos": True},
                        timeout=600,
                    )

        threads = [threading.Thread(target=decode_forever, args=(n,), daemon=True) for n in range(args.streams)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120
        while running(engine.url) < args.streams and time.monotonic() < deadline:
            time.sleep(0.2)
        busy = [prefill_seconds(engine.url, 100 + t, args.prompt_words) for t in range(args.trials)]
        seen = running(engine.url)
    finally:
        stop.set()
        engine.stop()
    prompt = idle[0][1]
    t_idle = statistics.median(s for s, _ in idle)
    t_busy = statistics.median(s for s, _ in busy)
    per_token = t_idle / prompt
    weight = (t_busy - t_idle) / args.streams / per_token
    print(
        f"compute {args.compute}: prompt {prompt} tokens; TTFT idle {t_idle * 1000:.0f} ms "
        f"({[round(s * 1000) for s, _ in idle]}), with {args.streams} streams decoding "
        f"({seen} running at the end) {t_busy * 1000:.0f} ms ({[round(s * 1000) for s, _ in busy]}); "
        f"{per_token * 1000:.2f} ms per prefill token; decode weight {weight:.0f} prompt tokens per stream; "
        f"load average {uptime()}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
