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
the logprobs measurably further from the float32 reference.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from backend_engine.model.int8_matmul import constant, float_graph, matmul_nodes, session
from backend_engine.model.quant_blocks import BlockQuantized

if TYPE_CHECKING:
    from backend_engine.model.llama import LayerWeights

Matrix = BlockQuantized | np.ndarray  # blocks [out, in], or dense float32 pre-transposed [in, out]


def _product(w: Matrix, x: str, y: str) -> tuple[list[Any], list[Any]]:
    from onnx import helper

    if isinstance(w, BlockQuantized):
        return matmul_nodes(w, x, y)
    return [helper.make_node("MatMul", [x, f"{y}_w"], [y])], [constant(f"{y}_w", w)]


def _width(w: Matrix) -> int:
    """Output columns of `x @ w`."""
    return w.shape[0] if isinstance(w, BlockQuantized) else w.shape[1]


def _depth(w: Matrix) -> int:
    """Input columns of `x @ w`."""
    return w.shape[1] if isinstance(w, BlockQuantized) else w.shape[0]


def _rope_inputs() -> list[Any]:
    """The RoPE inputs of every graph: positions [T, 1] and the model's cos / sin tables [positions, head_dim / 2]."""
    from onnx import TensorProto, helper

    return [
        helper.make_tensor_value_info("positions", TensorProto.INT64, ["T", 1]),
        helper.make_tensor_value_info("cos", TensorProto.FLOAT, ["P", "half"]),
        helper.make_tensor_value_info("sin", TensorProto.FLOAT, ["P", "half"]),
    ]


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
    Q|K|V or None after the last layer). Q and K come out rotated; `rope` feeds `_rope_inputs`. The layers'
    matrices are `Matrix`es."""

    def __init__(self, layers: list[LayerWeights], eps: float, num_heads: int, num_kv_heads: int):
        self.nbytes = sum(int(a.nbytes) for lw in layers for a in vars(lw).values())
        hidden = layers[0].attn_norm.shape[0]
        width = _width(layers[0].wqkv)
        head_dim = width // (num_heads + 2 * num_kv_heads)
        self._rope = (num_heads + num_kv_heads, width, num_kv_heads * head_dim)
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
        from onnx import helper

        nodes = [helper.make_node("SimplifiedLayerNormalization", ["h", "norm"], ["x"], axis=-1, epsilon=eps)]
        mm_nodes, inits = _product(wqkv, "x", "qkv_raw")
        rope_nodes, rope_inits = _rope_nodes("qkv_raw", "qkv", *self._rope)
        return float_graph(
            nodes + mm_nodes + rope_nodes,
            [constant("norm", norm), *inits, *rope_inits],
            {"h": hidden},
            {"qkv": _width(wqkv)},
            _rope_inputs(),
        )

    def _layer_graph(self, lw: LayerWeights, nxt: LayerWeights | None, eps: float, hidden: int) -> bytes:
        from onnx import TensorProto, helper

        inter = _width(lw.w_gate_up) // 2
        nodes: list[Any] = []
        inits = [
            constant("ffn_norm", lw.ffn_norm),
            constant("split", np.array([inter, inter]), TensorProto.INT64),
            constant("one", np.ones(1, np.float32)),
        ]

        def add(product: tuple[list[Any], list[Any]]) -> None:
            nodes.extend(product[0])
            inits.extend(product[1])

        def skip_norm(residual: str, delta: str, norm: str, x: str, total: str) -> Any:
            return helper.make_node(
                "SkipSimplifiedLayerNormalization",
                [residual, delta, norm],
                [x, "", "", total],
                domain="com.microsoft",
                epsilon=eps,
            )

        add(_product(lw.wo, "attn", "o"))
        nodes.append(skip_norm("h", "o", "ffn_norm", "x", "h_mid"))
        add(_product(lw.w_gate_up, "x", "gu"))
        nodes += [
            helper.make_node("Split", ["gu", "split"], ["g", "u"], axis=-1),
            helper.make_node("Neg", ["g"], ["g_neg"]),
            helper.make_node("Exp", ["g_neg"], ["g_exp"]),
            helper.make_node("Add", ["g_exp", "one"], ["g_den"]),
            helper.make_node("Div", ["g", "g_den"], ["g_silu"]),
            helper.make_node("Mul", ["g_silu", "u"], ["act"]),
        ]
        add(_product(lw.w_down, "act", "d"))
        outputs = {"h_out": hidden}
        if nxt is None:
            nodes.append(helper.make_node("Add", ["h_mid", "d"], ["h_out"]))
        else:
            inits.append(constant("next_norm", nxt.attn_norm))
            nodes.append(skip_norm("h_mid", "d", "next_norm", "x_next", "h_out"))
            add(_product(nxt.wqkv, "x_next", "qkv_raw"))
            add(_rope_nodes("qkv_raw", "qkv", *self._rope))
            outputs["qkv"] = _width(nxt.wqkv)
        return float_graph(nodes, inits, {"h": hidden, "attn": _depth(lw.wo)}, outputs, _rope_inputs())
