"""`--compute int8`'s decode attention over the paged KV cache as one onnxruntime graph per layer.

Why: numpy gathers every sequence's blocks into a new array and then loops over small matrix products on one
thread, a dozen calls a layer. The graph does the same gather (in place: the K and V halves of a layer's cache are
contiguous arrays, which onnxruntime takes without a copy) and products in one call. Measured on the bundled
model's shapes (2 cores, one layer): one sequence of 128 tokens 22.7 us in numpy, 16.2 us here on one thread; of
1,024 tokens 0.16 ms and 0.07 ms on two threads; 64 sequences of ~300 tokens 4.8 ms and 1.35-1.7 ms.

Small steps run on the caller's thread alone: a sleeping or spinning second thread costs more than it saves below
`POOLED_GATHERED_TOKENS` (sequences x their padded length; one sequence of 64 tokens 12.6 us on one thread, 15.9 us
on two; from ~512 up two threads win, 1,024 tokens 83 us against 69 us). Results match numpy's to float32 rounding
(~2e-7), not bit for bit, which is why the float32 path, held to the reference fixtures, keeps numpy's. A step of
decode rows alone runs these nodes inside its one graph instead (`attention_nodes`, `int8_decode_step.py`); this graph
serves the steps that mix them with prompt chunks.
"""

from __future__ import annotations

from typing import Any

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
    nodes, inits = attention_nodes(nkv, group, hd, "", "q", "k_cache", "v_cache", "block_tables", "bias", "out")
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


def attention_nodes(
    nkv: int,
    group: int,
    hd: int,
    p: str,
    q: str,
    k_cache: str,
    v_cache: str,
    block_tables: str,
    bias: str,
    out: str,
    new_kv: tuple[str, str] | None = None,
) -> tuple[list[Any], list[Any]]:
    """Nodes computing `out` [D, heads * head_dim], each decode row's attention over its cached tokens (`bias`: 0
    for a cached token, -1e30 for a slot past it) and, given `new_kv` (K and V rows [D, kv_heads * head_dim]), over
    its own new token too, which the cache does not hold yet. Every other name added starts with `p`."""
    from onnx import TensorProto, helper

    make = helper.make_node
    inits = [
        constant(f"{p}q_shape", np.array([0, nkv, group, hd], np.int64), TensorProto.INT64),
        constant(f"{p}kv_shape", np.array([nkv, 0, -1, hd], np.int64), TensorProto.INT64),  # [nkv, D, L, hd]
        constant(f"{p}o_shape", np.array([0, nkv * group * hd], np.int64), TensorProto.INT64),
        constant(f"{p}scale", np.array(1.0 / np.sqrt(hd), np.float32)),
        constant(f"{p}head_axis", np.array([1], np.int64), TensorProto.INT64),
    ]
    nodes = [
        make("Reshape", [q, f"{p}q_shape"], [f"{p}q4"]),
        make("Transpose", [f"{p}q4"], [f"{p}qh"], perm=[1, 0, 2, 3]),  # [nkv, D, group, hd]
        make("Gather", [k_cache, block_tables], [f"{p}k_blocks"], axis=1),
        make("Reshape", [f"{p}k_blocks", f"{p}kv_shape"], [f"{p}k"]),
        make("Gather", [v_cache, block_tables], [f"{p}v_blocks"], axis=1),
        make("Reshape", [f"{p}v_blocks", f"{p}kv_shape"], [f"{p}v"]),
        make("Transpose", [f"{p}k"], [f"{p}k_t"], perm=[0, 1, 3, 2]),
        make("MatMul", [f"{p}qh", f"{p}k_t"], [f"{p}dots"]),  # [nkv, D, group, L]
        make("Mul", [f"{p}dots", f"{p}scale"], [f"{p}scaled"]),
        make("Unsqueeze", [bias, f"{p}head_axis"], [f"{p}bias3"]),  # [D, 1, L]
        make("Add", [f"{p}scaled", f"{p}bias3"], [f"{p}scores"]),
    ]
    if new_kv is None:
        nodes += [
            make("Softmax", [f"{p}scores"], [f"{p}p"], axis=-1),
            make("MatMul", [f"{p}p", f"{p}v"], [f"{p}o4"]),  # [nkv, D, group, hd]
        ]
    else:  # one more score column, the new token's; its weight times its V joins the cached tokens' product
        i64 = TensorProto.INT64
        inits += [
            constant(f"{p}row_shape", np.array([0, nkv, 1, hd], np.int64), i64),
            constant(f"{p}zero", np.array([0], np.int64), i64),
            constant(f"{p}minus_one", np.array([-1], np.int64), i64),
            constant(f"{p}end", np.array([np.iinfo(np.int64).max], np.int64), i64),
        ]
        for name, rows in zip("kv", new_kv):
            nodes += [
                make("Reshape", [rows, f"{p}row_shape"], [f"{p}{name}_new4"]),
                make("Transpose", [f"{p}{name}_new4"], [f"{p}{name}_new"], perm=[1, 0, 2, 3]),  # [nkv, D, 1, hd]
            ]
        last = f"{p}minus_one"  # the last axis
        nodes += [
            make("Transpose", [f"{p}k_new"], [f"{p}k_new_t"], perm=[0, 1, 3, 2]),
            make("MatMul", [f"{p}qh", f"{p}k_new_t"], [f"{p}own_dots"]),  # [nkv, D, group, 1]
            make("Mul", [f"{p}own_dots", f"{p}scale"], [f"{p}own_scaled"]),
            make("Concat", [f"{p}scores", f"{p}own_scaled"], [f"{p}all_scores"], axis=-1),
            make("Softmax", [f"{p}all_scores"], [f"{p}p_all"], axis=-1),
            make("Slice", [f"{p}p_all", f"{p}zero", f"{p}minus_one", last], [f"{p}p"]),
            make("Slice", [f"{p}p_all", f"{p}minus_one", f"{p}end", last], [f"{p}p_own"]),
            make("MatMul", [f"{p}p", f"{p}v"], [f"{p}o_cached"]),
            make("Mul", [f"{p}p_own", f"{p}v_new"], [f"{p}o_own"]),
            make("Add", [f"{p}o_cached", f"{p}o_own"], [f"{p}o4"]),
        ]
    nodes += [
        make("Transpose", [f"{p}o4"], [f"{p}o3"], perm=[1, 0, 2, 3]),
        make("Reshape", [f"{p}o3", f"{p}o_shape"], [out]),
    ]
    return nodes, inits
