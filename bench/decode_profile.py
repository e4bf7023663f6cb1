"""Where a decode step goes, in process: wall time of each part of `LLMEngine.step`, per step.

    .venv/bin/python -m bench.decode_profile --compute int8 --threads 2 --steps 200
    .venv/bin/python -m bench.decode_profile --rows 32 --steps 60                # a batched step
    .venv/bin/python -m bench.decode_profile --instructions --steps 40      # callgrind; needs valgrind

`--rows` greedy streams (EOS ignored; default one) decode `--steps` tokens each after their prefills, every step
decode rows alone; each part is timed by wrapping the method that does it, so a part's time includes its own
Python and onnxruntime crossings. `other forward` is what
`LlamaModel.forward` spends outside the timed parts (the embedding lookup, slicing, the step's small arrays);
`other step` is `LLMEngine.step` outside the forward pass, the scheduler and the sampling (metrics, KV events).
Wall time moves with other work on the cores: compare two checkouts in alternating runs, not across hours.

`--by-op` (int8) splits the decode step's one graph by operator type instead, from onnxruntime's own profile of
the same steps. The profiler adds a few microseconds to each of the graph's ~1,700 nodes: at 32 rows that is a
fifth of a step, at one row more than half (a 9 ms step profiles as 22), so read it at many rows.

`--instructions` counts instead what the same decode steps execute, on one thread under callgrind, split by library
(load-independent, but valgrind offers no AVX-512: onnxruntime runs its AVX2 kernels there).
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import backend_engine.engine as engine_module
import backend_engine.model.int8_decode_step as decode_step_module
from backend_engine.config import EngineConfig
from backend_engine.engine import LLMEngine
from backend_engine.sequence import SamplingParams
from bench.engine_bench import SHORT, model_path


def _parts(eng: LLMEngine) -> list[tuple[Any, str, str]]:
    """(object, attribute, part) for every timed call; attributes a checkout lacks are skipped."""
    m = eng.model
    parts = [
        (eng.scheduler, "schedule", "scheduler"),
        (engine_module, "build_forward_batch", "batch building"),
        (m, "forward", "forward"),
        (m, "_decode_plan", "decode plan (block tables, mask)"),
        (m, "_store_kv", "KV store (numpy)"),
        (m, "_decode_attention", "decode attention"),
        (m, "_mm", "matmuls outside the layer graphs (int8: the LM head)"),
        (m, "_rms", "RMSNorm outside the layer graphs (int8: the final one)"),
        (eng, "_append_token", "sampling, stop checks, detokenizing"),
        (eng, "step", "step"),
    ]
    if getattr(m.w, "int8_decode", None) is not None:  # a decode-only step; its K and V stores are `_store_kv`'s
        parts.append((m.w.int8_decode, "run", "int8: the decode step's one graph"))
    stack = m.w.int8_layers
    if stack is not None:
        parts += [
            (stack, "first", "layer 0's Q|K|V graph"),
            (stack, "after_attention", "layer graphs (norms, matmuls, SiLU, RoPE)"),
        ]
    return [p for p in parts if hasattr(p[0], p[1])]


def time_calls(fn: Callable[..., Any], part: str, acc: dict[str, float]) -> Callable[..., Any]:
    """`fn`, adding the wall time of each call to `acc[part]`."""

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[part] = acc.get(part, 0.0) + time.perf_counter() - t0

    return timed


def _streams(compute: str, threads: int, steps: int, rows: int = 1) -> LLMEngine:
    """A warm engine with `rows` greedy streams past their prefills (prompts differing in their last token), each
    with `steps` tokens left to decode."""
    eng = LLMEngine(
        EngineConfig(
            compute=compute,
            threads=threads,
            kv_cache_bytes=1 << 28,
            max_num_seqs=max(8, rows),
            model=model_path(),
        )
    )
    eng.generate([SHORT], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))  # warm-up
    for i in range(rows):
        prompt = SHORT if rows == 1 else [*SHORT, 100 + i]
        eng.add_request(f"profile-{i}", prompt, SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True))
    while any(seq.num_output_tokens == 0 for seq in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()  # the prefills and the first tokens
    return eng


def _steps_left(eng: LLMEngine) -> int:
    """Steps in which every stream still decodes (a stream prefilled early may have decoded already)."""
    return min(seq.params.max_tokens - seq.num_output_tokens for seq in eng.scheduler.running)


def profile(compute: str, threads: int, steps: int, rows: int = 1) -> dict[str, Any]:
    eng = _streams(compute, threads, steps, rows)
    timed = _steps_left(eng)
    acc: dict[str, float] = {}
    for obj, name, part in _parts(eng):
        setattr(obj, name, time_calls(getattr(obj, name), part, acc))
    cpu0, t0 = time.process_time(), time.perf_counter()
    for _ in range(timed):
        eng.step()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    ms = {part: 1000 * s / timed for part, s in acc.items()}
    step, forward = ms.pop("step"), ms.pop("forward")
    in_step = ("scheduler", "batch building", "sampling, stop checks, detokenizing")
    ms["other step"] = step - forward - sum(ms[p] for p in in_step)
    ms["other forward"] = forward - sum(v for p, v in ms.items() if p not in (*in_step, "other step"))
    return {
        "compute": compute,
        "threads": threads,
        "rows": rows,
        "tok_s": rows * timed / wall,
        "wall_ms_per_step": 1000 * wall / timed,
        "cpu_ms_per_step": 1000 * cpu / timed,
        "parts_ms_per_step": dict(sorted(ms.items(), key=lambda kv: -kv[1])),
    }


def by_op(threads: int, steps: int, rows: int) -> dict[str, Any]:
    """The decode step's graph split by operator type: kernel milliseconds a step, share, nodes a step."""
    prefix = os.path.join(tempfile.mkdtemp(prefix="decode-profile-"), "ort")
    original = decode_step_module.session
    decode_step_module.session = functools.partial(original, profile_prefix=prefix)
    try:
        eng = _streams("int8", threads, steps, rows)
    finally:
        decode_step_module.session = original
    timed = _steps_left(eng)
    for _ in range(timed):
        eng.step()
    with open(eng.model.w.int8_decode._session.end_profiling()) as f:
        events = json.load(f)
    runs = sorted((e for e in events if e.get("name") == "model_run"), key=lambda e: e["ts"])[-timed:]
    start = runs[0]["ts"]  # the warm-up's and the prefills' decode steps ran before
    kernel_us: collections.Counter[str] = collections.Counter()
    nodes: collections.Counter[str] = collections.Counter()
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] >= start:
            kernel_us[e["args"]["op_name"]] += e["dur"]
            nodes[e["args"]["op_name"]] += 1
    total = sum(kernel_us.values())
    return {
        "rows": rows,
        "steps": timed,
        "step_ms_profiled": sum(e["dur"] for e in runs) / timed / 1000,
        "by_op": {
            op: {"ms_per_step": us / timed / 1000, "share": us / total, "nodes_per_step": nodes[op] // timed}
            for op, us in kernel_us.most_common()
        },
    }


def _callgrind_child(compute: str, steps: int) -> None:
    """Under callgrind: ready, wait while the parent turns counting on, decode, done, wait for the dump."""
    eng = _streams(compute, 1, steps)
    print("ready", flush=True)
    sys.stdin.readline()
    for _ in range(steps):
        eng.step()
    print("done", flush=True)
    sys.stdin.readline()


def instructions(compute: str, steps: int) -> dict[str, Any]:
    """Instructions a decode token executes (one thread), in all and by library, from one callgrind dump."""
    tmp = tempfile.mkdtemp(prefix="decode-profile-")
    argv = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={tmp}/cg"]
    argv += [sys.executable, "-m", "bench.decode_profile", "--callgrind-child", "--compute", compute]
    child = subprocess.Popen(
        [*argv, "--steps", str(steps)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert child.stdin is not None and child.stdout is not None
    pid = str(child.pid)

    def control(*flags: str) -> None:
        for flag in flags:
            subprocess.run(["callgrind_control", flag, pid], check=True, capture_output=True)

    try:
        assert child.stdout.readline().strip() == "ready", "the engine did not start under callgrind"
        control("--instr=on", "--zero")
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "done"
        control("--dump", "--instr=off")
        child.stdin.write("exit\n")
        child.stdin.flush()
        child.wait(timeout=600)
    finally:
        if child.poll() is None:
            child.kill()
    (dump,) = [os.path.join(tmp, f) for f in os.listdir(tmp) if re.fullmatch(r"cg\.\d+", f)]
    report = subprocess.run(
        ["callgrind_annotate", "--threshold=100", dump], check=True, capture_output=True, text=True
    ).stdout
    by_library: collections.Counter[str] = collections.Counter()
    functions = []
    for line in report.splitlines():
        m = re.match(r"\s*([\d,]+) \(\s*[\d.]+%\)\s+(\S+) \[(.+)\]\s*$", line)
        if m:
            count = int(m.group(1).replace(",", "")) / steps
            by_library[os.path.basename(m.group(3))] += count
            functions.append((count, m.group(2), os.path.basename(m.group(3))))
    total = sum(by_library.values())  # every function's own count, at --threshold=100
    return {
        "compute": compute,
        "instructions_per_token": total,
        "share_by_library": {lib: n / total for lib, n in by_library.most_common()},
        "hottest_functions": [{"share": n / total, "function": fn, "library": lib} for n, fn, lib in functions[:5]],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--compute", choices=("int8", "float32"), default="int8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=200, help="decode steps timed (default 200)")
    ap.add_argument("--rows", type=int, default=1, help="streams decoding together (default 1)")
    ap.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    ap.add_argument("--by-op", action="store_true", help="int8: the step's graph by operator type (onnxruntime)")
    ap.add_argument("--instructions", action="store_true", help="count instructions under callgrind (one thread)")
    ap.add_argument("--callgrind-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.callgrind_child:
        _callgrind_child(args.compute, args.steps)
        return
    if args.instructions:
        print(json.dumps(instructions(args.compute, args.steps), indent=1))
        return
    if args.by_op:
        ops = by_op(args.threads, args.steps, args.rows)
        if args.json:
            print(json.dumps(ops))
            return
        head = f"int8, threads={args.threads}, rows={args.rows}: the step's graph by operator, {ops['steps']} steps"
        print(f"{head}, {ops['step_ms_profiled']:.2f} ms a step profiled")
        for op, v in ops["by_op"].items():
            print(f"  {v['ms_per_step']:7.3f} ms  {100 * v['share']:5.1f} %  {op} ({v['nodes_per_step']} a step)")
        return
    res = profile(args.compute, args.threads, args.steps, args.rows)
    if args.json:
        print(json.dumps(res))
        return
    wall, cpu = res["wall_ms_per_step"], res["cpu_ms_per_step"]
    head = f"{res['compute']}, threads={res['threads']}, rows={res['rows']}: {res['tok_s']:.1f} tok/s"
    print(f"{head}, {wall:.2f} ms ({cpu:.2f} ms CPU) a step")
    for part, ms in res["parts_ms_per_step"].items():
        print(f"  {ms:7.3f} ms  {100 * ms / res['wall_ms_per_step']:5.1f} %  {part}")


if __name__ == "__main__":
    main()
