"""`--compute int8`'s decode attention graph against attention written out one sequence and one head at a time:
grouped KV heads, blocks gathered through each sequence's own table, and nothing read past a sequence's end."""

import numpy as np
import pytest

from backend_engine.model.decode_attention import DecodeAttention

HEAD_DIM, BLOCK = 64, 16


def reference(q: np.ndarray, cache: np.ndarray, tables: np.ndarray, lengths: np.ndarray, heads: int) -> np.ndarray:
    kv_heads = cache.shape[1]
    group = heads // kv_heads
    out = np.zeros((len(q), heads * HEAD_DIM), np.float64)
    for i, (table, n) in enumerate(zip(tables, lengths)):
        keys = cache[0][:, table].reshape(kv_heads, -1, HEAD_DIM)[:, :n].astype(np.float64)
        values = cache[1][:, table].reshape(kv_heads, -1, HEAD_DIM)[:, :n].astype(np.float64)
        for h in range(heads):
            dots = keys[h // group] @ q[i, h * HEAD_DIM : (h + 1) * HEAD_DIM] / np.sqrt(HEAD_DIM)
            p = np.exp(dots - dots.max())
            out[i, h * HEAD_DIM : (h + 1) * HEAD_DIM] = (p / p.sum()) @ values[h // group]
    return out


@pytest.mark.parametrize(
    ("num_sequences", "heads", "kv_heads"),
    [(8, 9, 3), (13, 9, 3), (8, 8, 2)],  # the bundled model's heads, and groups of another size than their count
)
def test_graph_matches_attention_written_out(num_sequences, heads, kv_heads):
    rng = np.random.default_rng(num_sequences)
    blocks, max_blocks = 64, 5
    cache = rng.standard_normal((2, kv_heads, blocks, BLOCK, HEAD_DIM)).astype(np.float32)
    tables = np.stack([rng.choice(blocks, max_blocks, replace=False) for _ in range(num_sequences)]).astype(np.int64)
    lengths = rng.integers(1, max_blocks * BLOCK + 1, num_sequences)
    lengths[0] = max_blocks * BLOCK  # one sequence fills its last block
    lengths[1] = 1
    bias = np.where(np.arange(max_blocks * BLOCK)[None, :] >= lengths[:, None], -1e30, 0).astype(np.float32)
    q = rng.standard_normal((num_sequences, heads * HEAD_DIM)).astype(np.float32)

    got = DecodeAttention(heads, kv_heads, HEAD_DIM).attend(q, cache, tables, bias)

    want = reference(q, cache, tables, lengths, heads)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
