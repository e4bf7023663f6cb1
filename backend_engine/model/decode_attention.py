"""`--compute int8`'s decode attention over the paged KV cache as one onnxruntime graph per layer.

Why: numpy gathers every sequence's blocks into a new array and then loops over small matrix products on one
thread, a dozen calls a layer. The graph does the same gather (in place: the K and V halves of a layer's cache are
contiguous arrays, which onnxruntime takes without a copy) and products in one call. Measured on the bundled
model's shapes (2 cores, one layer): one sequence of 128 tokens 22.7 us in numpy, 16.2 us here on one thread; of
1,024 tokens 0.16 ms and 0.07 ms on two threads; 64 sequences of ~300 tokens 4.8 ms and 1.35-1.7 ms.

Small steps run on the caller's thread alone: a sleeping or spinning second thread costs more than it saves below
`POOLED_GATHERED_TOKENS` (sequences x their padded length; one sequence of 64 tokens 12.6 us on one thread, 15.9 us
on two; from ~512 up two threads win, 1,024 tokens 83 us against 69 us). Results match numpy's to float32 rounding
(~2e-7), not bit for bit, which is why the float32 path, held to the reference fixtures, keeps numpy's.
"""

from __future__ import annotations

import numpy as np

from backend_engine.model.int8_matmul import constant, session

POOLED_GATHERED_TOKENS = 512


class DecodeAttention:
    """`attend(q, cache, block_tables, bias)` -> [D, heads * head_dim]: q [D, heads * head_dim], a layer's cache
    [2, kv_heads, blocks, block_size, head_dim], block tables [D, nb] (int64), additive bias [D, nb * block_size]
    (0 for a token in the sequence, -1e30 past its end)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        graph = _graph(num_kv_heads, num_heads // num_kv_heads, head_dim)
        self._single = session(graph, threads=1)
        self._pooled = session(graph)

    def attend(self, q: np.ndarray, cache: np.ndarray, block_tables: np.ndarray, bias: np.ndarray) -> np.ndarray:
        feeds = {
            "q": np.ascontiguousarray(q, dtype=np.float32),
            "k_cache": cache[0],
            "v_cache": cache[1],
            "block_tables": block_tables,
            "bias": bias,
        }
        graph = self._pooled if bias.size >= POOLED_GATHERED_TOKENS else self._single
        return graph.run(None, feeds)[0]


def _graph(nkv: int, group: int, hd: int) -> bytes:
    from onnx import TensorProto, helper

    width = nkv * group * hd
    inits = [
        constant("q_shape", np.array([0, nkv, group, hd], np.int64), TensorProto.INT64),
        constant("kv_shape", np.array([nkv, 0, -1, hd], np.int64), TensorProto.INT64),  # [nkv, D, L, hd]
        constant("o_shape", np.array([0, width], np.int64), TensorProto.INT64),
        constant("scale", np.array(1.0 / np.sqrt(hd), np.float32)),
        constant("head_axis", np.array([1], np.int64), TensorProto.INT64),
    ]
    nodes = [
        helper.make_node("Reshape", ["q", "q_shape"], ["q4"]),
        helper.make_node("Transpose", ["q4"], ["qh"], perm=[1, 0, 2, 3]),  # [nkv, D, group, hd]
        helper.make_node("Gather", ["k_cache", "block_tables"], ["k_blocks"], axis=1),
        helper.make_node("Reshape", ["k_blocks", "kv_shape"], ["k"]),
        helper.make_node("Gather", ["v_cache", "block_tables"], ["v_blocks"], axis=1),
        helper.make_node("Reshape", ["v_blocks", "kv_shape"], ["v"]),
        helper.make_node("Transpose", ["k"], ["k_t"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["qh", "k_t"], ["dots"]),  # [nkv, D, group, L]
        helper.make_node("Mul", ["dots", "scale"], ["scaled"]),
        helper.make_node("Unsqueeze", ["bias", "head_axis"], ["bias3"]),  # [D, 1, L]
        helper.make_node("Add", ["scaled", "bias3"], ["scores"]),
        helper.make_node("Softmax", ["scores"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "v"], ["o4"]),  # [nkv, D, group, hd]
        helper.make_node("Transpose", ["o4"], ["o3"], perm=[1, 0, 2, 3]),
        helper.make_node("Reshape", ["o3", "o_shape"], ["out"]),
    ]
    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    inputs = [
        helper.make_tensor_value_info("q", f, ["D", width]),
        helper.make_tensor_value_info("k_cache", f, [nkv, "blocks", "block_size", hd]),
        helper.make_tensor_value_info("v_cache", f, [nkv, "blocks", "block_size", hd]),
        helper.make_tensor_value_info("block_tables", i64, ["D", "nb"]),
        helper.make_tensor_value_info("bias", f, ["D", "L"]),
    ]
    outputs = [helper.make_tensor_value_info("out", f, ["D", width])]
    graph = helper.make_graph(nodes, "decode_attention", inputs, outputs, inits)
    model = helper.make_model(graph, ir_version=9, opset_imports=[helper.make_opsetid("", 17)])
    return model.SerializeToString()
