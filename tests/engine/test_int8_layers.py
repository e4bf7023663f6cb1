"""`--compute int8` runs each layer's token-wise work as one onnxruntime graph: it must compute what the
per-matrix path (one `Int8Matmul` per weight, norms, SiLU and RoPE in numpy) computes, on the bundled model's
weights."""

import dataclasses

import numpy as np
import pytest

from backend_engine.config import default_model_path
from backend_engine.model.gguf import load_gguf
from backend_engine.model.int8_matmul import Int8Matmul
from backend_engine.model.llama import ForwardBatch, LayerWeights, LlamaModel, PrefillSpan, hf_tensors_to_weights
from backend_engine.model.quant_blocks import BlockQuantized


@pytest.fixture(scope="module")
def blocks_and_model(cpu_backend):
    cfg, tensors, _ = load_gguf(default_model_path(), keep_blocks=True)
    model = LlamaModel(cfg, hf_tensors_to_weights(cfg, dict(tensors), cpu_backend), cpu_backend)
    return tensors, model


def per_matrix_layer(tensors: dict, i: int) -> LayerWeights:
    p = f"model.layers.{i}."
    return LayerWeights(
        attn_norm=tensors[p + "input_layernorm.weight"],
        wqkv=Int8Matmul(BlockQuantized.stack_rows([tensors[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])),
        wo=Int8Matmul(tensors[p + "self_attn.o_proj.weight"]),
        ffn_norm=tensors[p + "post_attention_layernorm.weight"],
        w_gate_up=Int8Matmul(BlockQuantized.stack_rows([tensors[p + f"mlp.{n}_proj.weight"] for n in ("gate", "up")])),
        w_down=Int8Matmul(tensors[p + "mlp.down_proj.weight"]),
    )


def relative(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


def rope_at(model: LlamaModel, positions: np.ndarray) -> dict[str, np.ndarray]:
    return {"positions": positions.astype(np.int64).reshape(-1, 1), "cos": model.cos, "sin": model.sin}


def numpy_rope(model: LlamaModel, qkv: np.ndarray, positions: np.ndarray) -> np.ndarray:
    return model._rope_qk(qkv, model.cos[positions][:, None, :], model.sin[positions][:, None, :])


# Both paths round activations to int8; a norm output that differs in its last float bit can round to the
# neighbouring code, which moves an output by ~1e-3 relative. A wrong weight, norm or gate order moves it by ~1.
SAME = 5e-3
# RoPE mixes each output with its partner in the other half of the head, which can carry such a flip too.
SAME_ROTATED = SAME * np.sqrt(2)


@pytest.mark.parametrize("rows", [1, 5])
def test_layer_graph_matches_the_per_matrix_path(blocks_and_model, rows):
    tensors, model = blocks_and_model
    stack = model.w.int8_layers
    assert stack is not None and model.w.layers == []  # the graphs hold the weights, once
    rng = np.random.default_rng(rows)
    h = rng.standard_normal((rows, model.cfg.hidden_size)).astype(np.float32)
    attn = 0.3 * rng.standard_normal((rows, model.cfg.hidden_size)).astype(np.float32)

    layer3, layer4 = per_matrix_layer(tensors, 3), per_matrix_layer(tensors, 4)
    want_h = h.copy()
    model._mlp(want_h, attn, layer3)
    positions = rng.integers(1, 2000, rows)  # far from 0, where RoPE leaves a row as it is
    want_qkv = numpy_rope(model, layer4.wqkv(model._rms(want_h, layer4.attn_norm)), positions)
    got_h, got_qkv = stack.after_attention(3, h, attn, rope_at(model, positions))

    assert relative(got_h, want_h) < SAME
    assert relative(got_qkv, want_qkv) < SAME_ROTATED
    layer0 = per_matrix_layer(tensors, 0)
    want_first = numpy_rope(model, layer0.wqkv(model._rms(h, layer0.attn_norm)), positions)
    assert relative(stack.first(h, rope_at(model, positions)), want_first) < SAME_ROTATED


def test_last_layer_graph_returns_the_residual_only(blocks_and_model):
    tensors, model = blocks_and_model
    last = model.cfg.num_layers - 1
    h = np.random.default_rng(0).standard_normal((2, model.cfg.hidden_size)).astype(np.float32)
    attn = np.zeros_like(h)
    want = h.copy()
    model._mlp(want, attn, per_matrix_layer(tensors, last))
    got, qkv = model.w.int8_layers.after_attention(last, h, attn, rope_at(model, np.arange(2)))
    assert qkv is None and relative(got, want) < SAME


def test_a_step_longer_than_the_position_table_runs_like_float32(cpu_backend):
    """RoPE is per row: a step of more tokens than the model has positions (two 40-token prompts against a
    64-position table) is still valid, and int8 must compute what float32 does, within int8 rounding."""
    logits = {}
    for keep_blocks in (False, True):
        cfg, tensors, _ = load_gguf(default_model_path(), keep_blocks=keep_blocks)
        cfg = dataclasses.replace(cfg, max_position=64)
        model = LlamaModel(cfg, hf_tensors_to_weights(cfg, dict(tensors), cpu_backend), cpu_backend)
        tables = [np.array([0, 1, 2]), np.array([3, 4, 5])]
        positions = np.concatenate([np.arange(40), np.arange(40)])
        slots = np.concatenate([t[positions[:40] // 16] * 16 + positions[:40] % 16 for t in tables])
        batch = ForwardBatch(
            input_ids=np.arange(100, 180),
            positions=positions,
            slot_mapping=slots,
            num_decodes=0,
            decode_block_tables=np.zeros((0, 1), np.int64),
            decode_context_lens=np.zeros(0, np.int64),
            prefills=[PrefillSpan(0, 40, 40, tables[0]), PrefillSpan(40, 40, 40, tables[1])],
            logits_indices=np.array([39, 79]),
        )
        logits[keep_blocks] = model.forward(batch, model.allocate_kv_cache(8, 16))
    int8, float32 = logits[True], logits[False]
    assert int8.shape == float32.shape == (2, 49152)
    assert (int8.argmax(-1) == float32.argmax(-1)).all()
    assert relative(int8, float32) < 0.1
