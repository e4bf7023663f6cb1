"""Matrices as smoothed int8 rows for onnxruntime's u8s8 GEMM (`int8_rows.py`), and the activation ranges that
smooth them (`calibration.py`), on the bundled model's real weights through the real kernel."""

import numpy as np
import pytest

from backend_engine.config import default_model_path
from backend_engine.model import int8_rows
from backend_engine.model.calibration import CALIBRATION_CHAT, DOWN_BLOCK, SMOOTHED, activation_ranges, smooth_layers
from backend_engine.model.gguf import load_gguf
from backend_engine.model.int8_matmul import float_graph, session
from backend_engine.model.int8_rows import RowQuantized, row_product_nodes, smoothed
from backend_engine.model.llama import LayerWeights
from backend_engine.model.quant_blocks import BlockQuantized


@pytest.fixture(scope="module")
def bundled():
    """The bundled model's config, its matrices in blocks and its tokenizer."""
    from backend_engine.model import load_prompt_renderer

    cfg, tensors, _ = load_gguf(default_model_path(), keep_blocks=True)
    return cfg, tensors, load_prompt_renderer(default_model_path())


def _fused(tensors: dict, *names: str) -> BlockQuantized:
    """Matrices stacked along their outputs, as the engine fuses Q|K|V and gate|up."""
    stacked = BlockQuantized.stack_rows([tensors[n] for n in names])
    assert stacked is not None
    return stacked


def _product(w: RowQuantized):
    out, depth = w.shape
    run = session(float_graph(*row_product_nodes(w, "x", "y"), {"x": depth}, {"y": out}), threads=1).run
    return lambda x: run(None, {"x": np.ascontiguousarray(x, np.float32)})[0]


@pytest.fixture(scope="module")
def gate_up(bundled):
    _, tensors, _ = bundled
    return _fused(tensors, "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight")


def test_smoothing_keeps_outlier_channels_from_taking_the_int8_grid(gate_up):
    # Rows like a layer's inputs: most channels of order one, a few shared ones fifty times larger. Quantized per
    # row as they are, the large channels set the step and the rest round to a few codes.
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, gate_up.shape[1])).astype(np.float32)
    x[:, [5, 77, 300]] *= 50
    want = x @ gate_up.dequantize().T
    largest = np.abs(x).max(axis=0)

    def error(w: RowQuantized) -> float:
        return float(np.linalg.norm(_product(w)(x) - want) / np.linalg.norm(want))

    plain = smoothed(gate_up, np.ones_like(largest), alpha=1.0)  # s = 1: requantized per column, no smoothing
    assert np.all(plain.inv_smooth == 1)
    smooth, unsmoothed = error(smoothed(gate_up, largest)), error(plain)
    assert smooth < 0.02, (smooth, unsmoothed)  # within int8 rounding of float32 (0.015; the blocks: 0.013)
    assert smooth < unsmoothed / 2, (smooth, unsmoothed)  # (0.045)


def test_float_channels_are_multiplied_apart_and_leave_the_int8_step_alone(gate_up):
    # Two channels a thousand times wider than the rest: as int8 they would take the grid from every other
    # channel even smoothed; kept in float32, the row's step is set by the others
    rng = np.random.default_rng(3)
    x = rng.standard_normal((8, gate_up.shape[1])).astype(np.float32)
    x[:, [11, 400]] *= 1000
    want = x @ gate_up.dequantize().T
    largest = np.abs(x).max(axis=0)

    def error(w: RowQuantized) -> float:
        return float(np.linalg.norm(_product(w)(x) - want) / np.linalg.norm(want))

    kept = smoothed(gate_up, largest, float_channels=2)
    assert kept.float_channels is not None and kept.float_channels.tolist() == [11, 400]
    assert kept.inv_smooth is not None and np.all(kept.inv_smooth[[11, 400]] == 0)
    assert not kept.codes[[11, 400]].any()
    apart, together = error(kept), error(smoothed(gate_up, largest))
    assert apart < 0.02, (apart, together)  # int8 rounding of the other channels
    assert apart < together / 2, (apart, together)


@pytest.mark.parametrize("kernel", ["this CPU's", "u8 x u8"])
def test_the_product_is_the_integer_product_of_each_rounded_row(gate_up, kernel, monkeypatch):
    # u8 x s8 where the CPU has VNNI, else u8 x u8 (any CPU): both must be the exact integer product, which a
    # kernel that sums pairs of u8 x s8 products in 16 bits would not be
    if kernel == "u8 x u8":
        monkeypatch.setattr(int8_rows, "row_kernel_available", lambda: False)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((8, gate_up.shape[1])).astype(np.float32)
    w = smoothed(gate_up, np.abs(x).max(axis=0))
    xs = x * w.inv_smooth
    step = np.abs(xs).max(axis=1, keepdims=True) * np.float32(1 / 127)  # as the graph computes it
    codes = np.rint(xs / step).astype(np.int64)
    want = (codes @ w.codes.astype(np.int64)) * step * w.scale
    np.testing.assert_allclose(_product(w)(x), want, rtol=1e-5, atol=1e-6 * np.abs(want).max())


def test_a_rows_result_depends_on_that_row_alone(gate_up):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, gate_up.shape[1])).astype(np.float32)
    product = _product(smoothed(gate_up, np.abs(x).max(axis=0)))
    alone = product(x[:1])
    beside_larger_rows = product(np.concatenate([x[:1], 1000 * x[1:], np.zeros_like(x[:1])]))
    np.testing.assert_array_equal(beside_larger_rows[0], alone[0])
    # an all-zero row is zeros, not the NaN a zero step would make
    np.testing.assert_array_equal(beside_larger_rows[-1], np.zeros(gate_up.shape[0], np.float32))


def test_calibration_ranges_are_the_inputs_each_matrix_sees(bundled, cpu_backend):
    cfg, tensors, renderer = bundled
    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        layers.append(
            LayerWeights(
                attn_norm=tensors[p + "input_layernorm.weight"],
                wqkv=_fused(tensors, *(p + f"self_attn.{n}_proj.weight" for n in "qkv")),
                wo=tensors[p + "self_attn.o_proj.weight"],
                ffn_norm=tensors[p + "post_attention_layernorm.weight"],
                w_gate_up=_fused(tensors, p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                w_down=tensors[p + "mlp.down_proj.weight"],
            )
        )
    embed = tensors["model.embed_tokens.weight"].dequantize()
    ids = renderer.chat_ids(CALIBRATION_CHAT, add_generation_prompt=False)
    assert 200 < len(ids) < 1000  # a few hundred tokens: enough to find the outlier channels, cheap at load
    ranges = activation_ranges(cfg, layers, embed, tensors["model.norm.weight"], ids, cpu_backend)

    for i in range(cfg.num_layers):
        for name in SMOOTHED:
            seen = ranges[(i, name)]
            assert seen.shape == (getattr(layers[i], name).shape[1],) and np.all(np.isfinite(seen)), (i, name)
    # Layer 0's Q|K|V reads the embeddings through its RMSNorm: computed here on its own.
    h = embed[ids]
    x = h / np.sqrt((h * h).mean(axis=-1, keepdims=True) + cfg.rms_eps) * layers[0].attn_norm
    np.testing.assert_allclose(ranges[(0, "wqkv")], np.abs(x).max(axis=0), rtol=1e-5)
    # ...and the ranges differ by layer and matrix: they were read from each one's own input
    assert not np.allclose(ranges[(0, "w_gate_up")], ranges[(0, "wqkv")])
    assert not np.allclose(ranges[(1, "wqkv")], ranges[(0, "wqkv")])


def test_the_row_kernel_is_chosen_where_the_cpu_reports_vnni():
    # read apart from numpy's dispatcher: the kernel's flags as the Linux kernel lists this CPU's (an x86 machine)
    with open("/proc/cpuinfo") as cpuinfo:
        flags = next((line.split(":", 1)[1].split() for line in cpuinfo if line.startswith("flags")), [])
    assert flags, "no CPU flags in /proc/cpuinfo"
    assert int8_rows.row_kernel_available() == ("avx512_vnni" in flags)


@pytest.mark.parametrize("width,block", [(2 * DOWN_BLOCK, DOWN_BLOCK), (DOWN_BLOCK + 32, 32)])
def test_the_down_projection_is_requantized_only_where_its_blocks_fit(width, block):
    # a model whose MLP width is no multiple of DOWN_BLOCK keeps ggml's blocks (and still loads)
    rng = np.random.default_rng(4)
    blocks = width // 32
    down = BlockQuantized(4, rng.integers(0, 16, (8, width)).astype(np.uint8), rng.random((8, blocks), np.float32),
                          rng.random((8, blocks), np.float32))  # fmt: skip
    dense = np.zeros((8, 8), np.float32)  # no blocks: left as they are
    layer = LayerWeights(attn_norm=np.ones(8, np.float32), wqkv=dense, wo=dense, ffn_norm=np.ones(8, np.float32),
                         w_gate_up=dense, w_down=down)  # fmt: skip
    (got,) = smooth_layers([layer], {})
    assert isinstance(got.w_down, BlockQuantized) and got.w_down.block == block
    np.testing.assert_allclose(got.w_down.dequantize(), down.dequantize(), atol=np.abs(down.dequantize()).max() / 200)
