"""`--compute int8`'s decode step as one onnxruntime call: every layer, its attention over the paged KV cache, the
final norm and the LM head in one graph, for a step with no prompt chunk in it.

Why: the per-layer graphs (`int8_layers.py`) and the attention graph (`decode_attention.py`) are ~60 calls a token,
each on its own session's thread pool, whose worker sleeps between calls: with two threads, every call woke a
worker, and a second core did nothing for one stream (30 layers' weights read at M=1: 5.5 ms on one thread or two,
against 4.0-4.3 ms on two threads as one graph; docs/benchmarks.md). In one graph the pool's workers spin through
the whole step and every matmul splits over the cores, with no Python between layers.

A graph cannot write into its inputs, so the new token's K and V are not in the cache when its layer attends:
each layer attends to the cached tokens (`bias` masks the slots past them) and to its own new K and V from the
graph, and returns those rows (`kv`) for the caller to store. Prompt chunks keep the per-layer path, whose
attention is causal over the chunk.

Where the CPU has VNNI the step has two graphs, chosen by the number of rows: a step of `BATCHED_ROWS` rows or
more multiplies smoothed int8 rows, LM head included, through MLAS's integer GEMM (`int8_rows.py`: about twice as
fast as the blocks' kernel at 32 rows), a smaller one 8-bit blocks whose input the kernel quantizes itself
(`calibration.few_row_layers`: at one row, where a step reads every byte once, 0.92x the time of the rows; at 4 rows
0.97x, at 6 1.04x). Two sessions, not one graph with an ONNX `If`: onnxruntime kept the weights of an `If`'s
branches beside their prepacked copies (+540 MiB resident for the bundled model).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from backend_engine.model.decode_attention import attention_nodes
from backend_engine.model.int8_layers import (
    Matrix,
    norm_qkv_nodes,
    out_width,
    product,
    qkv_nodes,
    residual_nodes,
    rope_inputs,
    rope_layout,
    skip_norm,
)
from backend_engine.model.int8_matmul import constant, session

BATCHED_ROWS = 5  # the fewest rows a step multiplies by its batched weights, where it has them


@dataclass
class StepWeights:
    """The matrices one of the step's graphs multiplies: the layers' (norms included, which smoothing changes) and
    the LM head's."""

    layers: list[LayerWeights]
    lm_head: Matrix

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for lw in self.layers for a in vars(lw).values()) + int(self.lm_head.nbytes)


if TYPE_CHECKING:
    from backend_engine.model.llama import LayerWeights, LlamaConfig


class Int8DecodeStep:
    """`run(h, rope, block_tables, bias, caches)` -> (logits [D, vocab], kv [D, layers, 2 * kv_heads * head_dim]):
    h the decode rows' embeddings [D, hidden]; `rope` the RoPE inputs (`int8_layers.rope_inputs`); block tables
    [D, nb] (int64) and additive bias [D, nb * block_size] over each row's cached tokens; `caches` one array a
    layer, [2, kv_heads, blocks, block_size, head_dim]. kv holds each layer's new K then V row, K turned by RoPE."""

    def __init__(self, cfg: LlamaConfig, final_norm: np.ndarray, few: StepWeights, batched: StepWeights | None = None):
        self.layers = len(few.layers)
        self.nbytes = few.nbytes + (0 if batched is None else batched.nbytes)
        self._few = session(_step_graph(cfg, final_norm, few))
        self._batched = None if batched is None else session(_step_graph(cfg, final_norm, batched))

    def run(
        self,
        h: np.ndarray,
        rope: dict[str, np.ndarray],
        block_tables: np.ndarray,
        bias: np.ndarray,
        caches: list[np.ndarray],
    ) -> tuple[np.ndarray, np.ndarray]:
        feeds = {"h": h, "block_tables": block_tables, "bias": bias, **rope}
        for li, cache in enumerate(caches):
            feeds[f"k{li}"], feeds[f"v{li}"] = cache[0], cache[1]
        graph = self._batched if self._batched is not None and len(h) >= BATCHED_ROWS else self._few
        logits, kv = graph.run(None, feeds)
        return logits, kv.reshape(len(h), self.layers, -1)


def _step_graph(cfg: LlamaConfig, final_norm: np.ndarray, weights: StepWeights) -> bytes:
    from onnx import TensorProto, helper

    nkv, hd = cfg.num_kv_heads, cfg.head_dim
    f = TensorProto.FLOAT
    layers = weights.layers
    outputs = [
        helper.make_tensor_value_info("logits", f, ["D", out_width(weights.lm_head)]),
        helper.make_tensor_value_info("kv", f, ["D", len(layers) * 2 * nkv * hd]),
    ]
    nodes, inits = _step_nodes(cfg, final_norm, weights)
    cache_shape: list[str | int] = [nkv, "blocks", "block_size", hd]
    inputs = [
        helper.make_tensor_value_info("h", f, ["D", layers[0].attn_norm.shape[0]]),
        *rope_inputs(),
        helper.make_tensor_value_info("block_tables", TensorProto.INT64, ["D", "nb"]),
        helper.make_tensor_value_info("bias", f, ["D", "L"]),
    ]
    for li in range(len(layers)):
        inputs += [helper.make_tensor_value_info(f"{kind}{li}", f, cache_shape) for kind in "kv"]
    graph = helper.make_graph(nodes, "int8_decode_step", inputs, outputs, inits)
    model = helper.make_model(
        graph, ir_version=9, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )
    return model.SerializeToString()


def _step_nodes(cfg: LlamaConfig, final_norm: np.ndarray, weights: StepWeights) -> tuple[list[Any], list[Any]]:
    """The step's nodes over `weights`, from the graph's inputs to `logits` and `kv`."""
    from onnx import TensorProto, helper

    nh, nkv, hd, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_eps
    layers = weights.layers
    rope = rope_layout(nh, nkv, hd)
    nodes, inits = norm_qkv_nodes(layers[0].attn_norm, layers[0].wqkv, eps, rope, "h", "l0/qkv")
    kv_rows: list[str] = []
    residual = "h"
    for li, lw in enumerate(layers):
        p = f"l{li}/"
        inits.append(constant(f"{p}qkv_parts", np.array([nh * hd, nkv * hd, nkv * hd]), TensorProto.INT64))
        nodes.append(
            helper.make_node("Split", [f"{p}qkv", f"{p}qkv_parts"], [f"{p}q", f"{p}k_row", f"{p}v_row"], axis=-1)
        )
        kv_rows += [f"{p}k_row", f"{p}v_row"]
        more, more_inits = attention_nodes(
            nkv, nh // nkv, hd, f"{p}att/", f"{p}q", f"k{li}", f"v{li}", "block_tables", "bias", f"{p}attn",
            new_kv=(f"{p}k_row", f"{p}v_row"),
        )  # fmt: skip
        nodes += more
        inits += more_inits
        more, more_inits = residual_nodes(lw, eps, residual, f"{p}attn", p)
        nodes += more
        inits += more_inits
        if li + 1 < len(layers):
            nxt = f"l{li + 1}/"
            inits.append(constant(f"{nxt}attn_norm", layers[li + 1].attn_norm))
            nodes.append(skip_norm(f"{p}h_mid", f"{p}d", f"{nxt}attn_norm", f"{nxt}x_attn", f"{p}h_out", eps))
            more, more_inits = qkv_nodes(layers[li + 1].wqkv, rope, f"{nxt}x_attn", f"{nxt}qkv")
            nodes += more
            inits += more_inits
            residual = f"{p}h_out"
        else:
            inits.append(constant("final_norm", final_norm))
            nodes.append(skip_norm(f"{p}h_mid", f"{p}d", "final_norm", "x_final", "", eps))
    more, more_inits = product(weights.lm_head, "x_final", "logits")
    nodes += [*more, helper.make_node("Concat", kv_rows, ["kv"], axis=1)]
    return nodes, inits + more_inits
