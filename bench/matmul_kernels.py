"""The engine's two int8 weight products, side by side on one layer's matrices of the bundled model.

    .venv/bin/python -m bench.matmul_kernels --threads 2 --rows 1 32 256

For each of layer 0's four matrices (Q|K|V, O, gate|up, down) and each row count M: the microseconds of `x @ W.T`
as MatMulNBits over the Q4_1 blocks (`int8_matmul.Int8Matmul`: int8 activations per block of 32, plus the offsets'
product), and as the smoothed int8 rows for MLAS's u8s8 GEMM (`int8_rows.py`: the matrix requantized per column,
each row of x quantized on its own), smoothed by the test rows' own channel ranges. Each comes with its output's
relative error against float32 on the same input (standard normal rows: the model's own embeddings would flatter
MatMulNBits, whose per-block int8 grid holds Q8_0 rows exactly).

Why: where the engine serves a matrix from (`int8_rows.row_kernel_available`) is a trade of speed at batched
sizes against precision; this measures both on this CPU.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from backend_engine.model.gguf import load_gguf
from backend_engine.model.int8_matmul import Int8Matmul, configure_threads, float_graph, session
from backend_engine.model.int8_rows import row_product_nodes, smoothed
from backend_engine.model.quant_blocks import BlockQuantized
from bench.engine_bench import model_path


def _layer0() -> dict[str, BlockQuantized]:
    """Layer 0's matrices as the engine fuses them."""
    _, t, _ = load_gguf(model_path(), keep_blocks=True)
    p = "model.layers.0."

    def fused(*names: str) -> BlockQuantized:
        stacked = BlockQuantized.stack_rows([t[p + n + ".weight"] for n in names])
        assert stacked is not None, "the bundled model's layers are all in one block layout"
        return stacked

    return {
        "Q|K|V": fused("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        "O": fused("self_attn.o_proj"),
        "gate|up": fused("mlp.gate_proj", "mlp.up_proj"),
        "down": fused("mlp.down_proj"),
    }


def _rows(blocks: BlockQuantized, activation_max: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
    """`x @ W.T` as the engine's smoothed int8 rows."""
    w = smoothed(blocks, activation_max)
    out, depth = w.shape
    run = session(float_graph(*row_product_nodes(w, "x", "y"), {"x": depth}, {"y": out})).run
    return lambda x: run(None, {"x": x})[0]


def _microseconds(runs: dict[str, Any], x: np.ndarray, rounds: int = 5) -> dict[str, float]:
    """Each kernel's median time over `rounds` of 4,000 rows' worth of calls (at least 10), the kernels alternating
    within each round (this VM's speed drifts)."""
    for run in runs.values():
        for _ in range(5):
            run(x)
    n = max(10, 4000 // len(x))
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            t0 = time.perf_counter()
            for _ in range(n):
                run(x)
            times[name].append(1e6 * (time.perf_counter() - t0) / n)
    return {name: float(np.median(t)) for name, t in times.items()}


def compare(threads: int, row_counts: list[int]) -> list[dict[str, Any]]:
    configure_threads(threads)
    mats = _layer0()
    rng = np.random.default_rng(0)
    results = []
    for name, blocks in mats.items():
        w = blocks.dequantize()
        ranges = np.abs(rng.standard_normal((256, w.shape[1]))).max(axis=0)
        runs = {"MatMulNBits": Int8Matmul(blocks), "u8s8 rows": _rows(blocks, ranges)}
        for m in row_counts:
            x = rng.standard_normal((m, w.shape[1])).astype(np.float32)
            exact = x @ w.T
            us = _microseconds(runs, x)
            row: dict[str, Any] = {"matrix": name, "shape": list(w.shape), "rows": m}
            for kernel, run in runs.items():
                err = float(np.linalg.norm(run(x) - exact) / np.linalg.norm(exact))
                row[kernel] = {"us": us[kernel], "relative_error": err}
            results.append(row)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 32, 256])
    args = ap.parse_args()
    print("| matrix [out, in] | rows | MatMulNBits µs (error) | u8s8 rows µs (error) | speed-up |")
    print("|---|---:|---:|---:|---:|")
    for r in compare(args.threads, args.rows):
        a, b = r["MatMulNBits"], r["u8s8 rows"]
        print(
            f"| {r['matrix']} {r['shape']} | {r['rows']} | {a['us']:.1f} ({a['relative_error']:.2e}) "
            f"| {b['us']:.1f} ({b['relative_error']:.2e}) | {a['us'] / b['us']:.2f}x |"
        )


if __name__ == "__main__":
    main()
