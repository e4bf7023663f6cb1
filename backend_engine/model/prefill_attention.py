"""`--compute int8`'s causal attention of prompt chunks over the paged KV cache as one onnxruntime graph per call.

Why: numpy computes it as batched products of small matrices, one BLAS call each, and reductions over short rows;
eight 64-token chunks took 2.5 ms a layer that way (a fifth of their prefill step, 1.2 ms here), and one 960-token
prompt's attention 1.3 of its 1.9 s of prefill (0.54 of 1.1 s here; two threads, AVX-512 VNNI). Here MLAS does the
gather, the products and the softmax in one call. Results match numpy's to float32 rounding, not bit for bit, which
is why the float32 path, held to the reference fixtures, keeps numpy's (as for decode attention,
`decode_attention.py`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from backend_engine.model.int8_matmul import constant, session


class PrefillAttention:
    """`attend(q, cache, group)` -> the rows `group.rows` of the chunks' attention [rows, heads * head_dim]: q the flat
    batch's queries [T, heads * head_dim], a layer's cache [2, kv_heads, blocks, block_size, head_dim], and a
    `llama.PrefillGroup` (its bias [S, 1, 1, n, L] with L a whole number of blocks)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        self._session = session(_graph(num_kv_heads, num_heads // num_kv_heads, head_dim))

    def attend(self, q: np.ndarray, cache: np.ndarray, group: Any) -> np.ndarray:
        feeds = {
            "q": np.ascontiguousarray(q, dtype=np.float32),
            "queries": group.queries,
            "k_cache": cache[0],
            "v_cache": cache[1],
            "block_tables": group.block_tables,
            "bias": group.bias,
            "kept": group.kept,
        }
        return self._session.run(None, feeds)[0]


def _graph(nkv: int, group: int, hd: int) -> bytes:
    from onnx import TensorProto, helper

    make = helper.make_node
    width = nkv * group * hd
    i64, f = TensorProto.INT64, TensorProto.FLOAT
    inits = [
        constant("q_shape_tail", np.array([-1, nkv, group, hd], np.int64), i64),  # [n, ...] after [S]
        constant("kv_shape", np.array([nkv, 0, 1, -1, hd], np.int64), i64),  # [nkv, S, 1, L, hd]
        constant("o_shape", np.array([-1, width], np.int64), i64),
        constant("scale", np.array(1.0 / np.sqrt(hd), np.float32)),
        constant("bias_axes", np.array([1], np.int64), i64),
    ]
    nodes = [
        make("Gather", ["q", "queries"], ["q_rows"], axis=0),  # [S * n, width]
        make("Shape", ["block_tables"], ["chunks"], start=0, end=1),  # [S]
        make("Concat", ["chunks", "q_shape_tail"], ["q_shape"], axis=0),
        make("Reshape", ["q_rows", "q_shape"], ["q5"]),  # [S, n, nkv, group, hd]
        make("Transpose", ["q5"], ["qh"], perm=[2, 0, 3, 1, 4]),  # [nkv, S, group, n, hd]
        make("Gather", ["k_cache", "block_tables"], ["k_blocks"], axis=1),  # [nkv, S, nb, bs, hd]
        make("Reshape", ["k_blocks", "kv_shape"], ["k"]),
        make("Gather", ["v_cache", "block_tables"], ["v_blocks"], axis=1),
        make("Reshape", ["v_blocks", "kv_shape"], ["v"]),
        make("Transpose", ["k"], ["k_t"], perm=[0, 1, 2, 4, 3]),  # [nkv, S, 1, hd, L]
        make("MatMul", ["qh", "k_t"], ["dots"]),  # [nkv, S, group, n, L]
        make("Mul", ["dots", "scale"], ["scaled"]),
        make("Squeeze", ["bias", "bias_axes"], ["bias3"]),  # [S, 1, n, L]: broadcast over kv heads and the group
        make("Add", ["scaled", "bias3"], ["scores"]),
        make("Softmax", ["scores"], ["p"], axis=-1),
        make("MatMul", ["p", "v"], ["o5"]),  # [nkv, S, group, n, hd]
        make("Transpose", ["o5"], ["o_rows5"], perm=[1, 3, 0, 2, 4]),  # [S, n, nkv, group, hd]
        make("Reshape", ["o_rows5", "o_shape"], ["o_rows"]),
        make("Gather", ["o_rows", "kept"], ["out"], axis=0),
    ]
    inputs = [
        helper.make_tensor_value_info("q", f, ["T", width]),
        helper.make_tensor_value_info("queries", i64, ["Q"]),
        helper.make_tensor_value_info("k_cache", f, [nkv, "blocks", "block_size", hd]),
        helper.make_tensor_value_info("v_cache", f, [nkv, "blocks", "block_size", hd]),
        helper.make_tensor_value_info("block_tables", i64, ["S", "nb"]),
        helper.make_tensor_value_info("bias", f, ["S", 1, 1, "n", "L"]),
        helper.make_tensor_value_info("kept", i64, ["R"]),
    ]
    outputs = [helper.make_tensor_value_info("out", f, ["R", width])]
    graph = helper.make_graph(nodes, "prefill_attention", inputs, outputs, inits)
    model = helper.make_model(graph, ir_version=9, opset_imports=[helper.make_opsetid("", 17)])
    return model.SerializeToString()
