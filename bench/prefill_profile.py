"""Where a prompt step goes, in process: wall time of one step that prefills `--prompts` new prompts of
`--prompt-len` tokens each (random token ids, nothing cached), and the parts of it spent in prompt attention and in
the layer graphs (int8) — the median over `--repeats` steps after two warm-up steps.

    .venv/bin/python -m bench.prefill_profile --prompts 8 --prompt-len 64      # many short prompts in one step
    .venv/bin/python -m bench.prefill_profile --prompts 1 --prompt-len 960     # one long prompt (its TTFT's work)

The step's token budget is set to hold every prompt whole, so one step computes them all (the server's default
budget, 512 tokens, cuts a longer prompt into chunks). Wall time moves with other work on the cores: compare two
checkouts in alternating runs (`PYTHONPATH=<checkout>`), not across hours.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from backend_engine.config import EngineConfig
from backend_engine.engine import LLMEngine
from backend_engine.sequence import SamplingParams
from bench.decode_profile import time_calls
from bench.engine_bench import model_path

WARM_UP = 2


def profile(compute: str, threads: int, prompts: int, length: int, repeats: int) -> dict[str, float]:
    """Milliseconds a prompt step takes in all and in each timed part, medians over `repeats` steps."""
    budget = {"max_num_seqs": max(8, prompts), "max_num_batched_tokens": max(512, prompts * length)}  # one step
    eng = LLMEngine(
        EngineConfig(compute=compute, threads=threads, kv_cache_bytes=1 << 29, model=model_path(), **budget)
    )
    m = eng.model
    parts = [(m, "_prefill_attention", "prompt attention"), (m, "forward", "forward")]
    if m.w.int8_layers is not None:
        parts.append((m.w.int8_layers, "after_attention", "layer graphs (norms, matmuls, SiLU, RoPE)"))
    acc: dict[str, float] = {}
    for obj, name, part in parts:
        setattr(obj, name, time_calls(getattr(obj, name), part, acc))
    rng = np.random.default_rng(0)
    samples: dict[str, list[float]] = {}
    for step in range(WARM_UP + repeats):
        acc.clear()
        for i in range(prompts):
            ids = rng.integers(1000, 20000, size=length).tolist()  # a new prompt: nothing from the prefix cache
            eng.add_request(f"p{step}-{i}", ids, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        t0 = time.perf_counter()
        while eng.has_unfinished():
            eng.step()
        acc["step"] = time.perf_counter() - t0
        if step >= WARM_UP:
            for part, seconds in acc.items():
                samples.setdefault(part, []).append(1000 * seconds)
    return {part: statistics.median(ms) for part, ms in samples.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--compute", choices=("int8", "float32"), default="int8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=8, help="new prompts in the step (default 8)")
    ap.add_argument("--prompt-len", type=int, default=64, help="tokens a prompt (default 64)")
    ap.add_argument("--repeats", type=int, default=8, help="steps timed after the warm-up (default 8)")
    args = ap.parse_args()
    ms = profile(args.compute, args.threads, args.prompts, args.prompt_len, args.repeats)
    step = ms.pop("step")
    print(f"{args.compute}, threads={args.threads}, {args.prompts} x {args.prompt_len} tokens: {step:.1f} ms a step")
    for part, value in sorted(ms.items(), key=lambda kv: -kv[1]):
        print(f"  {value:8.1f} ms  {100 * value / step:5.1f} %  {part}")


if __name__ == "__main__":
    main()
