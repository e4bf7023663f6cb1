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


def test_a_decode_step_in_one_graph_computes_what_the_layer_graphs_do(blocks_and_model, monkeypatch):
    """A step of decode rows alone runs as one graph (int8_decode_step.py), which attends to each row's cached
    tokens and to its own new K and V before they are stored. Two prompts of different lengths are prefilled into a
    cache whose unwritten slots hold large garbage (a slot read that should be masked moves every logit), then one
    decode step of both runs each way from the same cache: the same next tokens, logits and stored K and V within
    int8 rounding, which 30 layers amplify (~2-4 % of the largest logit, as a 1e-6 change of the embeddings does)."""
    _, model = blocks_and_model
    assert model.w.int8_decode is not None
    lengths, bs = (37, 20), 16
    tables = [np.array([5, 2, 7]), np.array([0, 3])]  # out of order, as a reused cache hands blocks out
    cache = model.allocate_kv_cache(8, bs)
    for layer in cache:
        layer.fill(1e3)
    prompts = [np.random.default_rng(n).integers(1000, 20000, n) for n in lengths]
    positions = np.concatenate([np.arange(n) for n in lengths])
    model.forward(
        ForwardBatch(
            input_ids=np.concatenate(prompts),
            positions=positions,
            slot_mapping=np.concatenate(
                [t[np.arange(n) // bs] * bs + np.arange(n) % bs for t, n in zip(tables, lengths)]
            ),
            num_decodes=0,
            decode_block_tables=np.zeros((0, 1), np.int64),
            decode_context_lens=np.zeros(0, np.int64),
            prefills=[
                PrefillSpan(0, lengths[0], lengths[0], tables[0]),
                PrefillSpan(lengths[0], lengths[1], lengths[1], tables[1]),
            ],
            logits_indices=np.array([lengths[0] - 1, sum(lengths) - 1]),
        ),
        cache,
    )
    width = max(len(t) for t in tables)
    step = ForwardBatch(
        input_ids=np.array([4097, 12000]),
        positions=np.array(lengths),
        slot_mapping=np.array([t[n // bs] * bs + n % bs for t, n in zip(tables, lengths)]),
        num_decodes=2,
        decode_block_tables=np.stack([np.pad(t, (0, width - len(t))) for t in tables]),
        decode_context_lens=np.array(lengths) + 1,
        logits_indices=np.arange(2),
    )
    one_graph_cache = [layer.copy() for layer in cache]
    got = model.forward(step, one_graph_cache)
    monkeypatch.setattr(model.w, "int8_decode", None)
    want = model.forward(step, cache)

    assert got.shape == want.shape == (2, 49152)
    assert (got.argmax(-1) == want.argmax(-1)).all()
    assert relative(got, want) < 0.1
    slots = step.slot_mapping
    for li in (0, model.cfg.num_layers - 1):
        stored = [
            c[li].reshape(2, model.cfg.num_kv_heads, -1, model.cfg.head_dim)[:, :, slots]
            for c in (one_graph_cache, cache)
        ]
        assert relative(stored[0], stored[1]) < (1e-5 if li == 0 else 0.1)  # layer 0's K and V precede any attention
    untouched = np.ones(8 * bs, bool)
    untouched[slots] = False
    for mine, theirs in zip(one_graph_cache, cache):
        np.testing.assert_array_equal(
            mine.reshape(2, -1, 8 * bs, model.cfg.head_dim)[:, :, untouched],
            theirs.reshape(2, -1, 8 * bs, model.cfg.head_dim)[:, :, untouched],
        )
