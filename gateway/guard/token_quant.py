"""Int8 guard models with their activations quantized per token, so a text's score never depends on its batch-mates.

Why: ONNX Runtime's dynamic quantization (`DynamicQuantizeLinear`, what `quantize_dynamic` writes before every
`MatMulInteger`) picks one scale and zero point for a whole activation tensor: every window of a micro-batch, the
padding included. A prompt's score therefore moved with whatever shared its batch (up to 0.12 on neuralchemy's
validation prompts, measured), and a verdict near the threshold could flip with concurrent traffic or a retry.

Here each `DynamicQuantizeLinear` is replaced by an asymmetric quantization computed per token (over the hidden
size, the range widened to hold 0) into 7-bit codes (0-127): scale s_t and zero point z_t per token. `MatMulInteger`
only takes one zero point for its whole input, so the codes go in with zero point 0 and the products subtract z_t
times each weight column's sum (of codes minus the weight's zero point) after it: exact integer algebra, in float32.
The scale output keeps its name and broadcasts ([..., tokens, 1]) through the scale products that follow, so the rest
of the graph is unchanged. A token's codes depend on that token alone and the integer products are exact, so a
window scores the same in any batch. (Symmetric per-token codes were measured too: they flagged 3.3 % of the
held-out hard negatives instead of 0.3 %.) The price is ONNX Runtime's fused `DynamicQuantizeMatMul`, which no
longer applies (docs/benchmarks.md).

Why 7 bits: on x86 CPUs without VNNI, MLAS multiplies uint8 codes by the int8 weights with VPMADDUBSW, which adds
each pair of products into 16 bits and saturates. With 8-bit codes about 5 % of a product's outputs came out wrong,
and a score moved by up to 0.27 (mean 0.003) from the same model's on a VNNI CPU, or with exact arithmetic (600
neuralchemy validation prompts, measured); with codes below 128, two products never pass 2 x 127 x 128 < 2^15, so
every CPU computes the same integers. Against exact 8-bit arithmetic the 7-bit scores differ by 0.0009 on average
(at most 0.044), with validation F1 unchanged within a row or two; exact 8-bit products through the u8u8 kernel
instead cost 23-35 % of a 128-token prompt's latency on such a CPU.
"""

from __future__ import annotations

from typing import Any

import numpy as np

SCALE_FLOOR = 1e-30  # an all-zero token: any positive scale gives codes equal to its zero point
CODE_MAX = 127  # 7-bit codes: no 16-bit saturation in any CPU's u8 x s8 kernel (module docstring)


def per_token_activations(model: Any) -> int:
    """Rewrite `model` (an onnx.ModelProto) in place; returns how many quantizations it replaced (0: not a dynamically
    quantized int8 model, left as it was)."""
    from onnx import helper, numpy_helper

    graph = model.graph
    if not any(n.op_type == "DynamicQuantizeLinear" for n in graph.node):
        return 0
    if next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 17) >= 18:
        return 0  # ReduceMax/Min take their axes as an input from opset 18: not written for here, left as it was
    weights = {i.name: i for i in graph.initializer}
    graph.initializer.extend(
        numpy_helper.from_array(np.array(value, dtype), name)
        for name, value, dtype in [
            ("per_token/inv127", 1 / CODE_MAX, np.float32),
            ("per_token/floor", SCALE_FLOOR, np.float32),
            ("per_token/0", 0, np.float32),
            ("per_token/zero", 0, np.uint8),
            ("per_token/one", [1], np.int64),
        ]
    )
    zero_points: dict[str, str] = {}  # codes -> their per-token zero points
    nodes: list[Any] = []
    replaced = 0
    for node in graph.node:
        if node.op_type == "DynamicQuantizeLinear":
            x, (codes, scale, zero) = node.input[0], node.output
            zero_points[codes] = f"{codes}/z"
            nodes += _quantize(helper, x, codes, scale, zero, f"{codes}/z")
            replaced += 1
        elif node.op_type == "MatMulInteger" and node.input[0] in zero_points:
            nodes += _product(helper, numpy_helper, node, zero_points[node.input[0]], weights, graph)
        else:
            nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
    return replaced


def _quantize(helper: Any, x: str, codes: str, scale: str, zero: str, z: str) -> list[Any]:
    """x -> uint8 codes (0-CODE_MAX), scale [..., 1] and zero point z [..., 1] per token; `zero` (the old scalar)
    becomes 0.

    The codes come from one QuantizeLinear over the tokens as rows (per-axis scale and zero point), the fused
    kernel, rather than five elementwise passes."""
    from onnx import TensorProto

    p = f"{codes}/per_token"
    return [
        helper.make_node("Shape", [x], [f"{p}/shape"]),
        helper.make_node("Shape", [x], [f"{p}/lead"], end=-1),
        helper.make_node("Concat", [f"{p}/lead", "per_token/one"], [f"{p}/col_shape"], axis=0),
        helper.make_node("Flatten", [x], [f"{p}/rows"], axis=-1),
        helper.make_node("ReduceMax", [f"{p}/rows"], [f"{p}/max"], axes=[1], keepdims=0),
        helper.make_node("ReduceMin", [f"{p}/rows"], [f"{p}/min"], axes=[1], keepdims=0),
        helper.make_node("Max", [f"{p}/max", "per_token/0"], [f"{p}/high"]),
        helper.make_node("Min", [f"{p}/min", "per_token/0"], [f"{p}/low"]),
        helper.make_node("Sub", [f"{p}/high", f"{p}/low"], [f"{p}/range"]),
        helper.make_node("Mul", [f"{p}/range", "per_token/inv127"], [f"{p}/step"]),
        helper.make_node("Max", [f"{p}/step", "per_token/floor"], [f"{p}/scale"]),
        helper.make_node("Div", [f"{p}/low", f"{p}/scale"], [f"{p}/low_steps"]),
        helper.make_node("Neg", [f"{p}/low_steps"], [f"{p}/z_raw"]),
        helper.make_node("Round", [f"{p}/z_raw"], [f"{p}/z"]),
        helper.make_node("Cast", [f"{p}/z"], [f"{p}/z8"], to=TensorProto.UINT8),
        helper.make_node("QuantizeLinear", [f"{p}/rows", f"{p}/scale", f"{p}/z8"], [f"{p}/codes"], axis=0),
        helper.make_node("Reshape", [f"{p}/codes", f"{p}/shape"], [codes]),
        helper.make_node("Reshape", [f"{p}/scale", f"{p}/col_shape"], [scale]),
        helper.make_node("Reshape", [f"{p}/z", f"{p}/col_shape"], [z]),
        helper.make_node("Identity", ["per_token/zero"], [zero]),
    ]


def _product(helper: Any, numpy_helper: Any, node: Any, z: str, weights: dict[str, Any], graph: Any) -> list[Any]:
    """`node` (MatMulInteger over per-token codes) with each token's zero point taken out: acc - z_t * colsum."""
    from onnx import TensorProto

    codes, w, _, w_zero = (list(node.input) + [""] * 4)[:4]
    out = node.output[0]
    if w not in weights:
        raise ValueError(f"{node.name or out}: an int8 product whose weights are not a constant of the model")
    columns = numpy_helper.to_array(weights[w]).astype(np.int64)
    if w_zero:
        columns = columns - numpy_helper.to_array(weights[w_zero]).astype(np.int64)
    graph.initializer.append(numpy_helper.from_array(columns.sum(axis=0).astype(np.float32), f"{out}/colsum"))
    inputs = [codes, w, "per_token/zero"] + ([w_zero] if w_zero else [])
    return [
        helper.make_node("MatMulInteger", inputs, [f"{out}/acc"]),
        helper.make_node("Cast", [f"{out}/acc"], [f"{out}/accf"], to=TensorProto.FLOAT),
        helper.make_node("Mul", [z, f"{out}/colsum"], [f"{out}/offset"]),
        helper.make_node("Sub", [f"{out}/accf", f"{out}/offset"], [out]),
    ]
