"""The engine's int8 weight product against onnxruntime's u8s8 GEMM, on one layer's matrices of the bundled model.

    .venv/bin/python -m bench.matmul_kernels --threads 2 --rows 1 32 256

For each of layer 0's four matrices (Q|K|V, O, gate|up, down) and each row count M: the microseconds of `x @ W.T`
as `--compute int8` runs it (`int8_matmul.Int8Matmul`: MatMulNBits over the Q4_1 blocks, int8 activations per
block of 32, plus the offsets' product), and as `DynamicQuantizeMatMul` (MLAS's u8s8 GEMM, the VNNI kernel
onnxruntime quantizes whole models with) over the same matrix requantized to int8 per output row, activations
quantized per tensor. Each comes with its output's relative error against float32 on the same input (standard
normal rows: the model's own embeddings would flatter MatMulNBits, whose per-block int8 grid holds Q8_0 rows
exactly).

Why: at one row both read their weights at about the same speed, but a batched step spends most of its time in
MatMulNBits (`decode_profile.py --rows 32`); this measures what a GEMM kernel built for batches would give, and
what its coarser quantization would cost (a row's result would also depend on its batch mates).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from backend_engine.model.gguf import load_gguf
from backend_engine.model.int8_matmul import Int8Matmul, configure_threads, constant, float_graph, session
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


def _u8s8(w: np.ndarray) -> Any:
    """`x @ w.T` through DynamicQuantizeMatMul, w [out, in] requantized to int8 with one scale per output row."""
    from onnx import TensorProto, helper

    scale = np.maximum(np.abs(w).max(axis=1), 1e-12) / 127
    codes = np.clip(np.rint(w / scale[:, None]), -127, 127).astype(np.int8)
    rows, cols = w.shape
    nodes = [helper.make_node("DynamicQuantizeMatMul", ["x", "w", "w_scale"], ["y"], domain="com.microsoft")]
    inits = [constant("w", codes.T, TensorProto.INT8), constant("w_scale", scale.astype(np.float32))]
    return session(float_graph(nodes, inits, {"x": cols}, {"y": rows}))


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
        nbits, u8s8 = Int8Matmul(blocks), _u8s8(w)

        def run_u8s8(x: np.ndarray, s: Any = u8s8) -> np.ndarray:
            return s.run(None, {"x": x})[0]

        for m in row_counts:
            x = rng.standard_normal((m, w.shape[1])).astype(np.float32)
            exact = x @ w.T
            runs = {"MatMulNBits": nbits, "u8s8 GEMM": run_u8s8}
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
    print("| matrix [out, in] | rows | MatMulNBits µs (error) | u8s8 GEMM µs (error) | speed-up |")
    print("|---|---:|---:|---:|---:|")
    for r in compare(args.threads, args.rows):
        a, b = r["MatMulNBits"], r["u8s8 GEMM"]
        print(
            f"| {r['matrix']} {r['shape']} | {r['rows']} | {a['us']:.1f} ({a['relative_error']:.2e}) "
            f"| {b['us']:.1f} ({b['relative_error']:.2e}) | {a['us'] / b['us']:.2f}x |"
        )


if __name__ == "__main__":
    main()
