"""`--compute int8`'s token-wise layer work as one onnxruntime call per layer, so numpy only does attention.

Why: single-stream decode was bound by call overhead, not arithmetic. A decode token's four weight matmuls per
layer take 10-30 us of kernel time each, and every one of them also paid for a Python -> onnxruntime crossing
and for waking the pool thread, with numpy's RMSNorm, SiLU and residual adds (a dozen small calls) in between.
Here everything from one layer's attention output to the next layer's Q|K|V is one graph:

    o = attn @ Wo;  x = RMSNorm(h + o);  g|u = x @ Wgate_up;  d = (SiLU(g) * u) @ Wdown
    h' = h + o + d;  qkv' = RoPE(RMSNorm'(h') @ Wqkv')      (the last layer returns h' alone)

and a first graph computes layer 0's Q|K|V from the embeddings. RMSNorm and the residual add are onnxruntime's
(Skip)SimplifiedLayerNormalization kernels; matrices are `int8_matmul.matmul_nodes` (a dense float32 matrix,
for a layout the blocks do not cover, becomes a plain MatMul). A layer's output matches the per-matmul path to
~5e-7 relative. RoPE is onnxruntime's RotaryEmbedding (rotating halves, over the model's cos / sin tables given as
inputs): it turns Q and K within the Q|K|V rows, so numpy only copies K and V into the cache. In numpy RoPE was
nine calls a layer, 5.5 of the 8.7 us a single decode token spent a layer outside attention. SiLU is spelled
g / (1 + exp(-g)) as in numpy: Sigmoid * Mul would be fused into onnxruntime's QuickGelu, whose approximation moved
the logprobs measurably further from the float32 reference. The node builders below also make the one-graph decode
step (`int8_decode_step.py`), every name under a prefix of its layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from backend_engine.model.int8_matmul import constant, float_graph, matmul_nodes, session
from backend_engine.model.int8_rows import RowQuantized, row_product_nodes
from backend_engine.model.quant_blocks import BlockQuantized

if TYPE_CHECKING:
    from backend_engine.model.llama import LayerWeights

Matrix = BlockQuantized | RowQuantized | np.ndarray  # blocks or rows [out, in], or dense float32 [in, out]


def product(w: Matrix, x: str, y: str) -> tuple[list[Any], list[Any]]:
    from onnx import helper

    if isinstance(w, BlockQuantized):
        return matmul_nodes(w, x, y)
    if isinstance(w, RowQuantized):
        return row_product_nodes(w, x, y)
    return [helper.make_node("MatMul", [x, f"{y}_w"], [y])], [constant(f"{y}_w", w)]


def out_width(w: Matrix) -> int:
    """Output columns of `x @ w`."""
    return w.shape[1] if isinstance(w, np.ndarray) else w.shape[0]


def _depth(w: Matrix) -> int:
    """Input columns of `x @ w`."""
    return w.shape[0] if isinstance(w, np.ndarray) else w.shape[1]


def rope_inputs() -> list[Any]:
    """The RoPE inputs of every graph: positions [T, 1] and the model's cos / sin tables [positions, head_dim / 2]."""
    from onnx import TensorProto, helper

    return [
        helper.make_tensor_value_info("positions", TensorProto.INT64, ["T", 1]),
        helper.make_tensor_value_info("cos", TensorProto.FLOAT, ["P", "half"]),
        helper.make_tensor_value_info("sin", TensorProto.FLOAT, ["P", "half"]),
    ]


def rope_layout(num_heads: int, num_kv_heads: int, head_dim: int) -> tuple[int, int, int]:
    """`_rope_nodes`' shape arguments for Q|K|V rows: the heads RoPE turns, the rows' width, V's width."""
    return num_heads + num_kv_heads, (num_heads + 2 * num_kv_heads) * head_dim, num_kv_heads * head_dim


def _rope_nodes(raw: str, out: str, qk_heads: int, width: int, kv_width: int) -> tuple[list[Any], list[Any]]:
    """Nodes turning the Q and K heads of the Q|K|V rows `raw` [T, width] by each row's position, V untouched.

    Each row is its own batch entry of one token ([T, 1, heads * head_dim]): as one sequence of T tokens,
    onnxruntime refuses a step longer than the cos / sin tables, whatever the positions."""
    from onnx import TensorProto, helper

    qk_width = width - kv_width
    inits = [
        constant(f"{out}_split", np.array([qk_width, kv_width]), TensorProto.INT64),
        constant(f"{out}_batch", np.array([-1, 1, qk_width]), TensorProto.INT64),  # [T, 1, heads * head_dim]
        constant(f"{out}_rows", np.array([-1, qk_width]), TensorProto.INT64),
    ]
    nodes = [
        helper.make_node("Split", [raw, f"{out}_split"], [f"{out}_qk", f"{out}_v"], axis=1),
        helper.make_node("Reshape", [f"{out}_qk", f"{out}_batch"], [f"{out}_qk3"]),
        helper.make_node(
            "RotaryEmbedding",
            [f"{out}_qk3", "positions", "cos", "sin"],
            [f"{out}_qk3_rot"],
            domain="com.microsoft",
            interleaved=0,
            num_heads=qk_heads,
        ),
        helper.make_node("Reshape", [f"{out}_qk3_rot", f"{out}_rows"], [f"{out}_qk_rot"]),
        helper.make_node("Concat", [f"{out}_qk_rot", f"{out}_v"], [out], axis=1),
    ]
    return nodes, inits


class Int8LayerStack:
    """`first(h, rope)` -> layer 0's Q|K|V; `after_attention(i, h, attn, rope)` -> (new residual, layer i + 1's
    Q|K|V or None after the last layer). Q and K come out rotated; `rope` feeds `rope_inputs`. The layers'
    matrices are `Matrix`es."""

    def __init__(self, layers: list[LayerWeights], eps: float, num_heads: int, num_kv_heads: int):
        self.nbytes = sum(int(a.nbytes) for lw in layers for a in vars(lw).values())
        hidden = layers[0].attn_norm.shape[0]
        head_dim = out_width(layers[0].wqkv) // (num_heads + 2 * num_kv_heads)
        self._rope = rope_layout(num_heads, num_kv_heads, head_dim)
        self._first = session(self._norm_qkv_graph(layers[0].attn_norm, layers[0].wqkv, eps, hidden))
        self._after = [
            session(self._layer_graph(layer, layers[i + 1] if i + 1 < len(layers) else None, eps, hidden))
            for i, layer in enumerate(layers)
        ]

    def first(self, h: np.ndarray, rope: dict[str, np.ndarray]) -> np.ndarray:
        return self._first.run(None, {"h": h, **rope})[0]

    def after_attention(
        self, i: int, h: np.ndarray, attn: np.ndarray, rope: dict[str, np.ndarray]
    ) -> tuple[np.ndarray, Any]:
        out = self._after[i].run(None, {"h": h, "attn": attn, **rope})
        return out[0], (out[1] if len(out) > 1 else None)

    def _norm_qkv_graph(self, norm: np.ndarray, wqkv: Matrix, eps: float, hidden: int) -> bytes:
        nodes, inits = norm_qkv_nodes(norm, wqkv, eps, self._rope, "h", "qkv")
        return float_graph(nodes, inits, {"h": hidden}, {"qkv": out_width(wqkv)}, rope_inputs())

    def _layer_graph(self, lw: LayerWeights, nxt: LayerWeights | None, eps: float, hidden: int) -> bytes:
        from onnx import helper

        nodes, inits = residual_nodes(lw, eps, "h", "attn", "")
        outputs = {"h_out": hidden}
        if nxt is None:
            nodes.append(helper.make_node("Add", ["h_mid", "d"], ["h_out"]))
        else:
            nodes.append(skip_norm("h_mid", "d", "next_norm", "x_next", "h_out", eps))
            inits.append(constant("next_norm", nxt.attn_norm))
            more, more_inits = qkv_nodes(nxt.wqkv, self._rope, "x_next", "qkv")
            nodes += more
            inits += more_inits
            outputs["qkv"] = out_width(nxt.wqkv)
        return float_graph(nodes, inits, {"h": hidden, "attn": _depth(lw.wo)}, outputs, rope_inputs())


def skip_norm(residual: str, delta: str, norm: str, x: str, total: str, eps: float) -> Any:
    """`total` = residual + delta, and `x` = RMSNorm(total) * norm (`total` may be "" when only `x` is wanted)."""
    from onnx import helper

    return helper.make_node(
        "SkipSimplifiedLayerNormalization",
        [residual, delta, norm],
        [x, "", "", total],
        domain="com.microsoft",
        epsilon=eps,
    )


def qkv_nodes(wqkv: Matrix, rope: tuple[int, int, int], x: str, qkv: str) -> tuple[list[Any], list[Any]]:
    """`qkv` = x @ Wqkv with Q and K turned by RoPE; every name added starts with `qkv`."""
    nodes, inits = product(wqkv, x, f"{qkv}_raw")
    rope_nodes, rope_inits = _rope_nodes(f"{qkv}_raw", qkv, *rope)
    return nodes + rope_nodes, inits + rope_inits


def norm_qkv_nodes(
    norm: np.ndarray, wqkv: Matrix, eps: float, rope: tuple[int, int, int], h: str, qkv: str
) -> tuple[list[Any], list[Any]]:
    """Layer 0's `qkv` from the embeddings `h`: RMSNorm, then `qkv_nodes`; every name added starts with `qkv`."""
    from onnx import helper

    nodes = [helper.make_node("SimplifiedLayerNormalization", [h, f"{qkv}_norm"], [f"{qkv}_x"], axis=-1, epsilon=eps)]
    more, inits = qkv_nodes(wqkv, rope, f"{qkv}_x", qkv)
    return nodes + more, [constant(f"{qkv}_norm", norm), *inits]


def residual_nodes(lw: LayerWeights, eps: float, h: str, attn: str, p: str) -> tuple[list[Any], list[Any]]:
    """A layer after attention, up to the two terms of its new residual: `{p}h_mid` = h + attn @ Wo and `{p}d`, the
    MLP's output on RMSNorm(h_mid); every name added starts with `p`. What follows (the sum alone, or with the next
    norm) is the caller's."""
    from onnx import TensorProto, helper

    make = helper.make_node
    inter = out_width(lw.w_gate_up) // 2
    nodes: list[Any] = []
    inits = [
        constant(f"{p}ffn_norm", lw.ffn_norm),
        constant(f"{p}split", np.array([inter, inter]), TensorProto.INT64),
        constant(f"{p}one", np.ones(1, np.float32)),
    ]

    def add(product: tuple[list[Any], list[Any]]) -> None:
        nodes.extend(product[0])
        inits.extend(product[1])

    add(product(lw.wo, attn, f"{p}o"))
    nodes.append(skip_norm(h, f"{p}o", f"{p}ffn_norm", f"{p}x", f"{p}h_mid", eps))
    add(product(lw.w_gate_up, f"{p}x", f"{p}gu"))
    nodes += [
        make("Split", [f"{p}gu", f"{p}split"], [f"{p}g", f"{p}u"], axis=-1),
        make("Neg", [f"{p}g"], [f"{p}g_neg"]),
        make("Exp", [f"{p}g_neg"], [f"{p}g_exp"]),
        make("Add", [f"{p}g_exp", f"{p}one"], [f"{p}g_den"]),
        make("Div", [f"{p}g", f"{p}g_den"], [f"{p}g_silu"]),
        make("Mul", [f"{p}g_silu", f"{p}u"], [f"{p}act"]),
    ]
    add(product(lw.w_down, f"{p}act", f"{p}d"))
    return nodes, inits
