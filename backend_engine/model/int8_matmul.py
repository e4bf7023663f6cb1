"""`x @ W` with W kept in 4- or 8-bit blocks and x quantized to int8 per row and block: llama.cpp's way of running
a quantized model on a CPU, here through onnxruntime's MatMulNBits kernel (MLAS) instead of a kernel of our own.

Why: float32 numpy matmuls are compute-bound once decode is batched (docs/benchmarks.md, Engine). Integer dot
products do about twice the work per cycle and read 4-8x fewer weight bytes. The price is precision: outputs
differ from float32 by ~0.5 % relative, so this is the opt-in `--compute int8`, and the float32 path stays
the reference one. Activations are quantized per row, so a row's result never depends on the rest of the batch.

MatMulNBits computes scale * (code - zero) per block (ggml's 32 values, or wider once requantized); Q4_1's
per-block offset (see `quant_blocks.py`) is added by a second, 32x smaller product in the same graph: the row sums
of x over each block times the offsets. Where the CPU has VNNI, the engine serves most matrices as smoothed int8
rows instead (`int8_rows.py`), faster in batches, and 8-bit blocks without offsets elsewhere (`calibration.py`).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from backend_engine.model.quant_blocks import BlockQuantized

_ACCURACY_INT8 = 4  # MatMulNBits accuracy_level: int8 activations, int32 accumulation


_threads = 1


def configure_threads(threads: int | None) -> None:
    """Threads for the weight sessions created from now on (None: one per core).

    Each session gets its own pool, whose workers spin only while that session runs (`session`). onnxruntime's
    Python API can share one global pool but not stop its workers spinning between runs, and on this 2-core
    machine workers left spinning fought numpy's own threads between matmuls (a 1,000-token prefill took 4.4 s
    instead of 1.9 s). Sleeping workers cost a wake-up per kernel instead: a single decode token's layers took
    5.6 ms with a sleeping 2-thread pool, 5.0 ms on one thread, and 4.0 ms with workers spinning within a run."""
    import onnxruntime as ort

    global _threads
    ort.set_default_logger_severity(3)
    _threads = threads or os.cpu_count() or 1


@functools.cache
def _shared_arena() -> None:
    """One CPU memory arena for every weight's session: per-session arenas each grow to the largest batch seen,
    ~120 of them, and first-touching all that memory cost more than the matmuls (measured: 140k page faults in
    one 1,000-token prefill)."""
    import onnxruntime as ort

    info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
    ort.create_and_register_allocator(info, None)


def session(model: bytes, threads: int | None = None, profile_prefix: str | None = None) -> Any:
    """A CPU session over `model` on `threads` threads (default: `configure_threads`'s); with `profile_prefix`,
    onnxruntime records every node's time into a JSON file so named (`bench/decode_profile.py --by-op`)."""
    import onnxruntime as ort

    _shared_arena()
    options = ort.SessionOptions()
    if profile_prefix:
        options.enable_profiling = True
        options.profile_file_prefix = profile_prefix
    options.add_session_config_entry("session.use_env_allocators", "1")
    options.intra_op_num_threads = threads or _threads  # 1: the caller's thread only, no pool
    # Spin while the graph runs (a decode layer is eight short kernels, and waking a sleeping worker for each cost
    # more than it saved), and stop as soon as the run returns, so no worker spins between the calls.
    options.add_session_config_entry("session.intra_op.allow_spinning", "1")
    options.add_session_config_entry("session.force_spinning_stop", "1")
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def matmul_nodes(w: BlockQuantized, x: str, y: str) -> tuple[list[Any], list[Any]]:
    """ONNX nodes and initializers computing `y = x @ W.T` for a float32 input named `x` [T, in]; every name
    they add starts with `y`, so several matrices can share one graph."""
    from onnx import TensorProto, helper

    rows, cols = w.shape
    nb = cols // w.block
    codes = w.codes.reshape(rows, nb, w.block)
    if w.bits == 4:
        codes = codes[..., 0::2] | (codes[..., 1::2] << 4)  # MatMulNBits packs element 2i low, 2i + 1 high
    q = y if w.offset is None else f"{y}_q"
    inits = [constant(f"{y}_codes", codes, TensorProto.UINT8), constant(f"{y}_scale", w.scale.reshape(-1))]
    nodes = [
        helper.make_node(
            "MatMulNBits",
            [x, f"{y}_codes", f"{y}_scale"],
            [q],
            domain="com.microsoft",
            K=cols,
            N=rows,
            bits=w.bits,
            block_size=w.block,
            accuracy_level=_ACCURACY_INT8,
        )
    ]
    if w.offset is not None:
        inits += [
            constant(f"{y}_offset", w.offset.T),  # [blocks, out]
            constant(f"{y}_blocked", np.array([0, nb, w.block], np.int64), TensorProto.INT64),
            constant(f"{y}_last", np.array([2], np.int64), TensorProto.INT64),
        ]
        nodes += [
            helper.make_node("Reshape", [x, f"{y}_blocked"], [f"{y}_x_blocks"]),
            helper.make_node("ReduceSum", [f"{y}_x_blocks", f"{y}_last"], [f"{y}_x_sums"], keepdims=0),
            helper.make_node("MatMul", [f"{y}_x_sums", f"{y}_offset"], [f"{y}_o"]),
            helper.make_node("Add", [q, f"{y}_o"], [y]),
        ]
    return nodes, inits


def constant(name: str, array: np.ndarray, kind: int = 1) -> Any:
    """An initializer (default kind: float32) holding `array`'s bytes."""
    from onnx import helper

    return helper.make_tensor(name, kind, array.shape, np.ascontiguousarray(array).tobytes(), raw=True)


def float_graph(
    nodes: list[Any],
    inits: list[Any],
    inputs: dict[str, int],
    outputs: dict[str, int],
    extra_inputs: Sequence[Any] = (),
) -> bytes:
    """A serialized model over float32 [T, width] inputs and outputs (`name: width`), plus `extra_inputs` (value
    infos of any other shape)."""
    from onnx import TensorProto, helper

    def values(widths: dict[str, int]) -> list[Any]:
        return [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["T", c]) for n, c in widths.items()]

    graph = helper.make_graph(nodes, "int8", values(inputs) + list(extra_inputs), values(outputs), inits)
    model = helper.make_model(
        graph,
        ir_version=9,  # what onnxruntime >= 1.15 reads, whatever `onnx` writes
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
    )
    return model.SerializeToString()


class Int8Matmul:
    """One weight matrix [out, in] as a callable: `m(x)` = x [T, in] @ W.T, float32 in and out."""

    def __init__(self, w: BlockQuantized) -> None:
        self.nbytes = w.nbytes
        rows, cols = w.shape
        self._session = session(float_graph(*matmul_nodes(w, "x", "y"), {"x": cols}, {"y": rows}))

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self._session.run(None, {"x": np.ascontiguousarray(x, dtype=np.float32)})[0]
