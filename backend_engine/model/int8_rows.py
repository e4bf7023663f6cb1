"""`x @ W` as onnxruntime's u8s8 integer GEMM: W requantized to int8 per output column, each row of x quantized to
int8 on its own, after SmoothQuant's per-channel smoothing (Xiao et al., 2023).

Why: MatMulNBits (`int8_matmul.py`) unpacks its 4-bit blocks and rescales every block of 32 inside its kernel; on
the same matrices MLAS's integer GEMM is 2.1-2.8x faster at 32 rows, 1.4-1.8x at 8 and 1.1-1.2x at one (two
threads, AVX-512 VNNI; `bench/matmul_kernels.py`). The price is precision: one scale per row of x instead of one
per block of 32 lets a few large activation channels (outliers every row of a layer shares) take the int8 grid
from the rest. Smoothing moves that range into the weights, exactly: x @ W = (x / s) @ (s * W), with
s_j = max|x_j|^a / max|W_j|^(1 - a) per input channel j, from the activations the model itself produced on a
calibration chat (`calibration.py`). The MLP's down projection keeps blocks (8-bit, of 128 values): its input,
SiLU(gate) * up, has outliers smoothing did not tame (tests/engine/int8_drift.py's p95 log-probability error 0.84
with it smoothed against a bound of 0.8, 0.47 in ggml's blocks, in a prototype).

The engine uses these only where MLAS multiplies u8 by s8 with VNNI (or AMX) instructions: on AVX2 and AVX-512
without VNNI that kernel adds pairs of u8 x s8 products in 16 bits, which full-range weights overflow, and weights
cut to 7 bits (onnxruntime's reduce_range) moved the drift to its bounds (p95 0.72-0.83). There every matrix keeps
its blocks. Like the blocks, a row's result depends on that row alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from backend_engine.model.int8_matmul import constant
from backend_engine.model.quant_blocks import BlockQuantized

ALPHA = 0.7  # the share of an activation channel's range moved into the weights (SmoothQuant's migration strength)
_Q = 127  # symmetric int8: codes in [-127, 127]


@dataclass
class RowQuantized:
    """A matrix for `x @ W` as (x * inv_smooth) @ (codes * scale): int8 codes [in, out], a float32 scale per output
    column, and the reciprocal of the smoothing per input channel; plus, where `float_channels` is set, those input
    channels' rows of W in float32, multiplied apart (their codes and inv_smooth are 0, so they neither add to the
    integer product nor widen a row's int8 step)."""

    codes: np.ndarray  # int8 [in, out]
    scale: np.ndarray  # float32 [out]
    inv_smooth: np.ndarray | None  # float32 [in]; None once folded into the RMSNorm before (`fold_into_norm`)
    float_channels: np.ndarray | None = None  # int64 [c]
    float_weights: np.ndarray | None = None  # float32 [c, out]

    @property
    def shape(self) -> tuple[int, int]:
        """[out, in], as a `BlockQuantized`'s."""
        return self.codes.shape[1], self.codes.shape[0]

    @property
    def nbytes(self) -> int:
        extra = (self.inv_smooth, self.float_channels, self.float_weights)
        return int(self.codes.nbytes + self.scale.nbytes + sum(0 if a is None else a.nbytes for a in extra))


def fold_into_norm(norm: np.ndarray, w: RowQuantized) -> tuple[np.ndarray, RowQuantized]:
    """The RMSNorm weight that feeds `w` alone, times `w`'s 1/s, and `w` without it: one node less a matrix."""
    assert w.inv_smooth is not None, "already folded"
    assert w.float_channels is None, "its float channels read x before the smoothing"
    return (norm * w.inv_smooth).astype(np.float32), RowQuantized(w.codes, w.scale, None)


def smoothed(
    w: BlockQuantized, activation_max: np.ndarray, alpha: float = ALPHA, float_channels: int = 0
) -> RowQuantized:
    """`w` ([out, in] blocks) smoothed by the largest |x| seen in each input channel, then requantized per column;
    the `float_channels` input channels of the widest activations are kept apart in float32."""
    dense = w.dequantize().T.astype(np.float64)  # [in, out]
    kept = np.sort(np.argsort(activation_max)[len(activation_max) - float_channels :]) if float_channels else None
    kept_weights = None
    if kept is not None:
        kept_weights = dense[kept].astype(np.float32)
        dense[kept] = 0
    weight_max = np.maximum(np.abs(dense).max(axis=1), 1e-8)
    smooth = np.maximum(activation_max.astype(np.float64), 1e-5) ** alpha / weight_max ** (1 - alpha)
    dense *= smooth[:, None]
    scale = np.maximum(np.abs(dense).max(axis=0), 1e-12) / _Q
    codes = np.clip(np.rint(dense / scale), -_Q, _Q).astype(np.int8)
    inv_smooth = (1 / smooth).astype(np.float32)
    if kept is not None:
        inv_smooth[kept] = 0
    return RowQuantized(codes, scale.astype(np.float32), inv_smooth, kept, kept_weights)


def row_kernel_available() -> bool:
    """Whether this CPU gives MLAS's u8s8 GEMM a VNNI (or AMX) kernel, which sums u8 x s8 products in 32 bits (the
    module's docstring). Read from cpuid as numpy's dispatcher found it, so an emulated CPU answers for itself."""
    import importlib

    found = getattr(importlib.import_module("numpy._core._multiarray_umath"), "__cpu_features__", {})
    return bool(found.get("AVX512VNNI"))  # numpy names no AVX-VNNI (without AVX-512): those CPUs keep the blocks


def row_product_nodes(w: RowQuantized, x: str, y: str) -> tuple[list[Any], list[Any]]:
    """ONNX nodes and initializers computing `y = x @ W` for a float32 input named `x` [T, in]; every name they add
    starts with `y`. Each row of x (times inv_smooth, unless folded) is quantized with its own step, max|row| / 127,
    around 128 (u8).
    Without VNNI the weights go in as u8 around 128 too: the same integer products, through MLAS's u8 x u8 kernel,
    which does not overflow (slower than u8 x s8 with VNNI, so the engine keeps its blocks there)."""
    from onnx import TensorProto, helper

    make = helper.make_node
    if row_kernel_available():
        weights = [constant(f"{y}_codes", w.codes, TensorProto.INT8)]
        product = [f"{y}_xq", f"{y}_codes", f"{y}_step", f"{y}_scale", f"{y}_zero"]
    else:  # u8 x u8, which MLAS widens to 16 bits before multiplying: exact on any CPU, slower
        weights = [constant(f"{y}_codes", (w.codes.astype(np.int16) + 128).astype(np.uint8), TensorProto.UINT8)]
        product = [f"{y}_xq", f"{y}_codes", f"{y}_step", f"{y}_scale", f"{y}_zero", f"{y}_zero"]
    inits = [
        *weights,
        constant(f"{y}_scale", w.scale),
        constant(f"{y}_per_code", np.array(1 / _Q, np.float32)),
        constant(f"{y}_tiny", np.array(1e-30, np.float32)),  # an all-zero row quantizes to zeros, not NaN
        constant(f"{y}_unit", np.array(1, np.float32)),
        constant(f"{y}_zero", np.array(128, np.uint8), TensorProto.UINT8),
    ]
    nodes: list[Any] = []
    float_nodes: list[Any] = []
    out = y
    if w.float_channels is not None and w.float_weights is not None:
        out = f"{y}_int"
        inits += [
            constant(f"{y}_float_channels", w.float_channels, TensorProto.INT64),
            constant(f"{y}_float_weights", w.float_weights),
        ]
        float_nodes = [
            make("Gather", [x, f"{y}_float_channels"], [f"{y}_xf"], axis=1),
            make("MatMul", [f"{y}_xf", f"{y}_float_weights"], [f"{y}_float"]),
            make("Add", [out, f"{y}_float"], [y]),
        ]
    if w.inv_smooth is not None:
        inits.append(constant(f"{y}_inv_smooth", w.inv_smooth))
        nodes.append(make("Mul", [x, f"{y}_inv_smooth"], [f"{y}_xs"]))
        x = f"{y}_xs"
    nodes += [
        make("Abs", [x], [f"{y}_abs"]),
        make("ReduceMax", [f"{y}_abs"], [f"{y}_max"], axes=[1], keepdims=1),
        make("Mul", [f"{y}_max", f"{y}_per_code"], [f"{y}_step0"]),
        make("Max", [f"{y}_step0", f"{y}_tiny"], [f"{y}_step"]),  # [T, 1]
        make("Div", [x, f"{y}_step"], [f"{y}_xn"]),
        make("QuantizeLinear", [f"{y}_xn", f"{y}_unit", f"{y}_zero"], [f"{y}_xq"]),
        # (xq - 128) @ (codes - zero), times each row's step and each column's scale
        make("MatMulIntegerToFloat", product, [out], domain="com.microsoft"),
        *float_nodes,
    ]
    return nodes, inits
