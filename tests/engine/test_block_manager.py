"""Block manager on its own: no model, plain sequences."""

from backend_engine.block_hash import hash_prompt_blocks
from backend_engine.block_manager import BlockManager
from backend_engine.sequence import SamplingParams, Sequence


def _seq(i, ids, salt=None):
    return Sequence(i, f"r{i}", list(ids), SamplingParams(), cache_salt=salt)


def _run(bm, seq):
    """Admit with prefix hits, allocate everything, pretend the forward pass ran, register blocks."""
    hits = bm.match_prefix(seq)
    bm.allocate_prefix(seq, hits)
    assert bm.ensure_slots(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.commit_computed(seq)
    return len(hits)


def test_prefix_hit_and_events():
    bm = BlockManager(8, 4)
    a = _seq(0, range(10))
    assert _run(bm, a) == 0
    ev = bm.drain_events()
    assert [e["type"] for e in ev] == ["BlockStored", "BlockStored"]
    assert [e["block_hashes"][0] for e in ev] == hash_prompt_blocks(list(range(10)), 4)
    assert ev[1]["parent_block_hash"] == ev[0]["block_hashes"][0]
    bm.free_sequence(a)
    assert bm.num_free_blocks == 8  # free, but contents kept
    b = _seq(1, list(range(8)) + [99, 98, 97])
    assert _run(bm, b) == 2
    assert b.num_cached_tokens == 8
    assert bm.prefix_hits == 8 and bm.prefix_queries == 21


def test_salt_isolates_tenants():
    bm = BlockManager(8, 4)
    a = _seq(0, range(9), salt="t1")
    _run(bm, a)
    bm.free_sequence(a)
    assert _run(bm, _seq(1, range(9), salt="t2")) == 0
    assert _run(bm, _seq(2, range(9), salt="t1")) == 2


def test_full_prompt_hit_leaves_a_token_to_compute():
    bm = BlockManager(8, 4)
    a = _seq(0, range(8))
    _run(bm, a)
    bm.free_sequence(a)
    b = _seq(1, range(8))
    assert len(bm.match_prefix(b)) == 1  # last block recomputed so the model yields logits


def test_hit_verified_against_stored_ids():
    bm = BlockManager(8, 4)
    a = _seq(0, range(9))
    _run(bm, a)
    bm.free_sequence(a)
    first = bm.cached[a.block_hashes[0]]
    bm.blocks[first].token_ids = (7, 7, 7, 7)  # as if another prompt collided on this hash
    assert bm.match_prefix(_seq(1, range(9))) == []


def test_lru_eviction_order_and_removed_events():
    bm = BlockManager(4, 4)
    a = _seq(0, range(100, 108))  # 2 blocks
    _run(bm, a)
    bm.free_sequence(a)
    b = _seq(1, range(200, 208))
    _run(bm, b)
    bm.free_sequence(b)
    bm.drain_events()
    # All 4 blocks free and cached. A needs 2 new blocks: the least recently freed (a's) go first,
    # tail block before the prefix it extends.
    c = _seq(2, range(300, 308))
    _run(bm, c)
    removed = [e["block_hashes"][0] for e in bm.drain_events() if e["type"] == "BlockRemoved"]
    assert removed == [a.block_hashes[1], a.block_hashes[0]]
    bm.free_sequence(c)
    assert _run(bm, _seq(3, list(range(200, 208)) + [1])) == 2  # b survived


def test_allocation_fails_cleanly_when_full():
    bm = BlockManager(2, 4)
    a = _seq(0, range(8))
    assert bm.ensure_slots(a, 8)
    b = _seq(1, range(4))
    assert not bm.ensure_slots(b, 4)
    assert b.block_table == []
    assert bm.usage() == 1.0
