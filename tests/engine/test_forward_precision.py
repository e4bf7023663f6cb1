"""The forward pass on a tiny random Llama: chunked prefill and batched decode agree with one full
prefill, and the mixed-precision layout the CUDA path uses (float16 weights and KV cache, float32
activations) runs through numpy and stays close to float32."""

import numpy as np
import pytest

from backend_engine.backend import ArrayBackend
from backend_engine.model.llama import ForwardBatch, LlamaConfig, LlamaModel, PrefillSpan, hf_tensors_to_weights

CFG = dict(
    vocab_size=101,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rope_theta=10000.0,
    max_position=256,
    tie_embeddings=True,
)
BS = 4


def _model(dtype):
    rng = np.random.default_rng(0)
    c = LlamaConfig(**CFG)
    H, I, q, kv = c.hidden_size, c.intermediate_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim  # noqa: E741 - the paper's names
    t = {
        "model.embed_tokens.weight": rng.standard_normal((c.vocab_size, H)),
        "model.norm.weight": 1 + 0.1 * rng.standard_normal(H),
    }
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        t.update(
            {
                p + "input_layernorm.weight": 1 + 0.1 * rng.standard_normal(H),
                p + "post_attention_layernorm.weight": 1 + 0.1 * rng.standard_normal(H),
                p + "self_attn.q_proj.weight": rng.standard_normal((q, H)) / 8,
                p + "self_attn.k_proj.weight": rng.standard_normal((kv, H)) / 8,
                p + "self_attn.v_proj.weight": rng.standard_normal((kv, H)) / 8,
                p + "self_attn.o_proj.weight": rng.standard_normal((H, q)) / 8,
                p + "mlp.gate_proj.weight": rng.standard_normal((I, H)) / 8,
                p + "mlp.up_proj.weight": rng.standard_normal((I, H)) / 8,
                p + "mlp.down_proj.weight": rng.standard_normal((H, I)) / 10,
            }
        )
    t = {k: v.astype(np.float32) for k, v in t.items()}
    be = ArrayBackend(xp=np, device="cpu", weight_dtype=dtype)
    return LlamaModel(c, hf_tensors_to_weights(c, t, be), be)


def _prefill(m, ids, table, start=0, cache=None):
    """Tokens ids[start:] given ids[:start] already cached; returns logits of the last token."""
    n = len(ids) - start
    pos = np.arange(start, len(ids))
    b = ForwardBatch(
        np.array(ids[start:]),
        pos,
        table[pos // BS] * BS + pos % BS,
        0,
        np.zeros((0, 1), np.int64),
        np.zeros(0, np.int64),
        [PrefillSpan(0, n, len(ids), table)],
        np.array([n - 1]),
    )
    return m.forward(b, cache)[0]


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_chunked_and_batched_agree_with_full_prefill(dtype):
    m = _model(dtype)
    rng = np.random.default_rng(5)
    seqs = [list(rng.integers(0, 101, n)) for n in (13, 7, 22)]
    tables = [np.array([0, 1, 2, 3, 4, 5]), np.array([6, 7, 8, 9]), np.array([10, 11, 12, 13, 14, 15, 16])]
    full = [_prefill(m, s, t, 0, m.allocate_kv_cache(17, BS)) for s, t in zip(seqs, tables)]

    cache = m.allocate_kv_cache(17, BS)
    # chunked: all but the last token of each sequence, in two chunks ...
    for s, t in zip(seqs, tables):
        _prefill(m, s[:5], t, 0, cache)
        _prefill(m, s[:-1], t, 5, cache)
    # ... then the last tokens of all three as one batched decode step.
    lens = np.array([len(s) for s in seqs])
    pos = lens - 1
    bt = np.stack([np.pad(t, (0, 7 - len(t))) for t in tables])
    slots = np.array([t[p // BS] * BS + p % BS for t, p in zip(tables, pos)])
    b = ForwardBatch(np.array([s[-1] for s in seqs]), pos, slots, 3, bt, lens, [], np.arange(3))
    dec = m.forward(b, cache)
    tol = 1e-4 if dtype == np.float32 else 2e-2
    for i in range(3):
        np.testing.assert_allclose(dec[i], full[i], atol=tol * np.abs(full[i]).max())
        assert dec[i].dtype == np.float32


def test_float16_layout_close_to_float32():
    ids = list(np.random.default_rng(9).integers(0, 101, 20))
    table = np.arange(6)
    a = _prefill(_model(np.float32), ids, table, 0, _model(np.float32).allocate_kv_cache(6, BS))
    m16 = _model(np.float16)
    cache = m16.allocate_kv_cache(6, BS)
    assert cache[0].dtype == np.float16 and m16.w.layers[0].wqkv.dtype == np.float16
    b = _prefill(m16, ids, table, 0, cache)
    assert np.argmax(a) == np.argmax(b)
    assert np.abs(a - b).max() < 2e-2 * np.abs(a).max()
