"""Prompt chunks' causal attention, grouped: numpy's (float32) and onnxruntime's (int8) against attention written out
one chunk, query and head at a time, over chunks of unequal lengths, some after a cached prefix, whose blocks sit out
of order in a cache whose unwritten slots hold large garbage (a slot read that should be masked moves every row)."""

import numpy as np
import pytest

from backend_engine.model.llama import QUERY_RUN, PrefillGroup, PrefillSpan, group_spans, query_runs
from backend_engine.model.prefill_attention import PrefillAttention

BLOCK = 16


def reference(q: np.ndarray, cache: np.ndarray, span: PrefillSpan, heads: int) -> np.ndarray:
    kv_heads, hd = cache.shape[1], cache.shape[-1]
    group = heads // kv_heads
    first = span.context_len - span.num_tokens
    keys = cache[0][:, span.block_table].reshape(kv_heads, -1, hd).astype(np.float64)
    values = cache[1][:, span.block_table].reshape(kv_heads, -1, hd).astype(np.float64)
    out = np.zeros((span.num_tokens, heads * hd))
    for j in range(span.num_tokens):
        seen = first + j + 1
        row = q[span.start + j].astype(np.float64)
        for h in range(heads):
            dots = keys[h // group, :seen] @ row[h * hd : (h + 1) * hd] / np.sqrt(hd)
            p = np.exp(dots - dots.max())
            out[j, h * hd : (h + 1) * hd] = (p / p.sum()) @ values[h // group, :seen]
    return out


def chunks(rng: np.random.Generator, blocks: int) -> tuple[list[PrefillSpan], np.ndarray]:
    """(new tokens, cached before them): one long prompt (attending in runs), short ones of several lengths and three
    of one, two after a cached prefix, one of a single block exactly; each chunk's slots written with data, the rest
    of the cache left as garbage."""
    shapes = [(300, 0), (7, 0), (33, 0), (16, 0), (40, 25), (2, 61), (19, 0), (19, 0), (19, 0), (64, 0)]
    order = rng.permutation(blocks)
    spans, start, used = [], 0, 0
    written = np.zeros(blocks * BLOCK, bool)
    for new, cached in shapes:
        context = new + cached
        table = order[used : used + -(-context // BLOCK)]
        used += len(table)
        slots = table[np.arange(context) // BLOCK] * BLOCK + np.arange(context) % BLOCK
        written[slots] = True
        spans.append(PrefillSpan(start, new, context, table))
        start += new
    return spans, written


@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (8, 2)])
def test_grouped_attention_matches_attention_written_out(loaded, heads, kv_heads):
    rng = np.random.default_rng(heads)
    hd, blocks = 64, 64
    spans, written = chunks(rng, blocks)
    cache = rng.standard_normal((2, kv_heads, blocks * BLOCK, hd)).astype(np.float32)
    cache[:, :, ~written] = 1e3
    cache = cache.reshape(2, kv_heads, blocks, BLOCK, hd)
    q = rng.standard_normal((sum(sp.num_tokens for sp in spans), heads * hd)).astype(np.float32)
    sizes = [len(g) for g in group_spans(spans)]
    assert min(sizes) == 1 and max(sizes) > 1, "the chunks should make groups of one and of several"
    groups = [PrefillGroup.of(g, BLOCK, np.asarray) for g in group_spans(spans)]

    graph = PrefillAttention(heads, kv_heads, hd)
    numpy_model = loaded.model  # the float32 model: numpy's path, for the bundled model's heads
    for name, attend in [("onnxruntime", lambda g: graph.attend(q, cache, g))] + (
        [("numpy", lambda g: numpy_model._prefill_attention(q, cache, g))] if heads == numpy_model.cfg.num_heads else []
    ):
        got = np.full_like(q, np.nan)
        for group in groups:
            got[group.rows] = attend(group)
        for sp in spans:
            want = reference(q, cache, sp, heads)
            np.testing.assert_allclose(
                got[sp.start : sp.start + sp.num_tokens], want, rtol=1e-4, atol=1e-5, err_msg=name
            )


def test_groups_keep_padding_bounded():
    """A long chunk does not pad short ones to its length; chunks of one size share one group."""
    table = np.arange(40)
    spans = [PrefillSpan(0, 120, 120, table), *(PrefillSpan(120 + 14 * i, 14, 14, table) for i in range(8))]
    groups = group_spans(spans)
    assert [len(g) for g in groups] == [1, 8]
    assert groups[0][0].num_tokens == 120


def test_a_long_chunk_attends_in_runs_each_over_the_keys_it_may_see():
    """300 new tokens after 40 cached: runs of at most QUERY_RUN queries, each ending its keys at its last query."""
    runs = query_runs(PrefillSpan(10, 300, 340, np.arange(22)))
    assert [(r.start, r.num_tokens, r.context_len) for r in runs] == [
        (10, QUERY_RUN, 40 + QUERY_RUN),
        (10 + QUERY_RUN, QUERY_RUN, 40 + 2 * QUERY_RUN),
        (10 + 2 * QUERY_RUN, 300 - 2 * QUERY_RUN, 340),
    ]
