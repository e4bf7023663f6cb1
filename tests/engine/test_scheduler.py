"""The scheduler on its own: a real BlockManager and plain sequences, no model.

`_forward` stands in for the engine's step: the scheduled tokens get KV, full blocks enter the prefix
cache, and a sequence whose chunk reached its end samples one more token.
"""

from backend_engine.block_manager import BlockManager
from backend_engine.scheduler import ScheduledBatch, Scheduler
from backend_engine.sequence import SamplingParams, Sequence, SequenceStatus

SAMPLED = 9999  # the token every fake forward pass "samples"


def _seq(i: int, ids: list[int] | range) -> Sequence:
    return Sequence(i, f"r{i}", list(ids), SamplingParams())


def _forward(bm: BlockManager, batch: ScheduledBatch) -> None:
    for seq, n in batch.items:
        seq.num_computed_tokens += n
        bm.commit_computed(seq)
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(SAMPLED)


def _scheduler(num_blocks: int, *seqs: Sequence, prefix_caching: bool = True) -> tuple[BlockManager, Scheduler]:
    """A KV cache of `num_blocks` 4-token blocks, with the sequences added in order."""
    bm = BlockManager(num_blocks, 4, enable_prefix_caching=prefix_caching)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    for seq in seqs:
        sched.add(seq)
    return bm, sched


def _prefill_and_finish(sched: Scheduler, seq: Sequence) -> None:
    """Run a prompt through prefill and end it, leaving its full blocks in the prefix cache (when it is on)."""
    sched.add(seq)
    _step(sched)
    sched.finish(seq)


def _step(sched: Scheduler) -> list[tuple[str, int]]:
    """Schedule and run one step; the (request id, new tokens) it scheduled, in batch order."""
    batch = sched.schedule()
    _forward(sched.bm, batch)
    return [(s.request_id, n) for s, n in batch.items]


def test_admission_is_first_come_first_served_up_to_max_num_seqs():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=100)
    a, b, c = _seq(0, range(5)), _seq(1, range(100, 105)), _seq(2, range(200, 205))
    for s in (a, b, c):
        sched.add(s)
    assert _step(sched) == [("r0", 5), ("r1", 5)]
    assert list(sched.waiting) == [c] and c.status == SequenceStatus.WAITING
    assert _step(sched) == [("r0", 1), ("r1", 1)]  # two running: c still waits
    sched.finish(a)
    assert a.status == SequenceStatus.FINISHED and a.block_table == []
    assert _step(sched) == [("r1", 1), ("r2", 5)]


def test_head_of_queue_is_never_overtaken():
    bm, sched = _scheduler(4)
    sched.add(_seq(0, range(5)))  # 2 blocks, leaving 2
    _step(sched)
    big, small = _seq(1, range(100, 113)), _seq(2, range(200, 203))  # 4 blocks, 1 block
    sched.add(big)
    sched.add(small)
    assert _step(sched) == [("r0", 1)]  # small would fit, but big came first
    assert list(sched.waiting) == [big, small]
    assert bm.num_free_blocks == 2


def test_token_budget_chunks_a_long_prompt_without_stalling_decodes():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=8)
    decoding = _seq(0, range(3))
    sched.add(decoding)
    _step(sched)
    long = _seq(1, range(100, 120))
    sched.add(long)
    assert _step(sched) == [("r0", 1), ("r1", 7)]
    assert _step(sched) == [("r0", 1), ("r1", 7)]
    assert _step(sched) == [("r0", 1), ("r1", 6)]  # the last chunk reaches the end: long samples
    assert long.num_output_tokens == 1
    assert _step(sched) == [("r0", 1), ("r1", 1)]
    assert decoding.num_output_tokens == 5  # one token every step


def test_a_long_prompt_waits_behind_a_full_budget():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=8)
    sched.add(_seq(0, range(12)))
    sched.add(_seq(1, range(100, 103)))
    assert _step(sched) == [("r0", 8)]
    assert _step(sched) == [("r0", 4), ("r1", 3)]  # what the first chunk left of the budget


def test_kv_pressure_preempts_the_newest_sequence_which_resumes_from_its_cached_prefix():
    a, b = _seq(0, range(7)), _seq(1, range(100, 107))
    bm, sched = _scheduler(4, a, b)
    assert _step(sched) == [("r0", 7), ("r1", 7)]  # all 4 blocks taken
    c = _seq(2, range(200, 203))
    sched.add(c)
    assert _step(sched) == [("r0", 1), ("r1", 1)]  # 8 tokens each: still 2 blocks each; none for c
    batch = sched.schedule()  # a's 9th token needs a third block
    assert [(s.request_id, n) for s, n in batch.items] == [("r0", 1)]
    assert batch.num_preempted == 1 and sched.num_preemptions == 1 and b.num_preemptions == 1
    assert b.status == SequenceStatus.WAITING and b.num_computed_tokens == 0 and b.block_table == []
    assert list(sched.waiting) == [b, c] and sched.running == [a]  # b goes back to the front
    assert len(a.block_table) == 3 and bm.num_free_blocks == 1
    _forward(bm, batch)
    # b's first block survived in the prefix cache (a took its second, the one freed first), but b
    # would need 2 blocks beyond it.
    assert _step(sched) == [("r0", 1)]
    sched.finish(a)
    assert _step(sched) == [("r1", 5), ("r2", 3)]  # b: 9 tokens, the first 4 from the cache
    assert b.num_computed_tokens == 9
    assert b.num_cached_tokens == 0  # the reported hit is the one at first admission


def test_the_newest_sequence_preempts_itself_when_only_it_must_grow():
    a, b = _seq(0, range(5)), _seq(1, range(100, 107))
    _, sched = _scheduler(4, a, b)
    _step(sched)
    assert _step(sched) == [("r0", 1), ("r1", 1)]
    batch = sched.schedule()  # b's 9th token needs a third block; a still fits in its two
    assert [(s.request_id, n) for s, n in batch.items] == [("r0", 1)]
    assert batch.num_preempted == 1 and sched.running == [a] and list(sched.waiting) == [b]


def test_prefix_cache_hit_skips_the_cached_blocks():
    bm, sched = _scheduler(16)
    a = _seq(0, range(10))
    sched.add(a)
    _step(sched)
    first_blocks = a.block_table[:2]
    sched.finish(a)
    b = _seq(1, list(range(8)) + [50, 51, 52])
    sched.add(b)
    assert _step(sched) == [("r1", 3)]
    assert b.num_cached_tokens == 8 and b.block_table[:2] == first_blocks
    assert bm.prefix_hits == 8 and bm.prefix_queries == 10 + 11


def test_without_prefix_caching_the_whole_prompt_is_computed():
    _, sched = _scheduler(16, prefix_caching=False)
    _prefill_and_finish(sched, _seq(0, range(10)))
    b = _seq(1, list(range(8)) + [50, 51, 52])
    sched.add(b)
    assert _step(sched) == [("r1", 11)]
    assert b.num_cached_tokens == 0


def test_cached_blocks_in_the_free_list_are_not_room_for_new_ones():
    bm, sched = _scheduler(3)
    _prefill_and_finish(sched, _seq(0, range(9)))  # 3 free blocks, the first 2 holding a cached prefix
    too_big = _seq(1, list(range(8)) + [60, 61, 62, 63, 64])  # 2 hits + 2 new blocks > 3 - 2
    sched.add(too_big)
    assert _step(sched) == []
    assert list(sched.waiting) == [too_big]
    sched.finish(too_big)
    fits = _seq(2, list(range(8)) + [70])  # 2 hits + 1 new block
    sched.add(fits)
    assert _step(sched) == [("r2", 1)]
    assert bm.num_free_blocks == 0


def test_finishing_a_waiting_sequence_drops_it():
    sched = Scheduler(BlockManager(16, 4), max_num_seqs=8, max_num_batched_tokens=100)
    a = _seq(0, range(5))
    sched.add(a)
    sched.finish(a)
    assert a.status == SequenceStatus.FINISHED
    assert not sched.has_work() and _step(sched) == []


def test_a_prefill_cap_bounds_the_prompt_a_step_computes_beside_decodes():
    """The cap applies only where a step also carries decodes: alone, a prompt takes the whole budget."""
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=16)
    first = _seq(0, range(20))
    sched.add(first)
    batch = sched.schedule(prefill_cap=5)
    assert [(s.request_id, n) for s, n in batch.items] == [("r0", 16)]  # no decodes yet: the budget
    _forward(sched.bm, batch)
    assert _step(sched) == [("r0", 4)]  # its last chunk, then it decodes
    sched.add(_seq(1, range(100, 120)))
    chunks = []
    for _ in range(4):
        batch = sched.schedule(prefill_cap=5)
        _forward(sched.bm, batch)
        chunks.append([(s.request_id, n) for s, n in batch.items])
    assert chunks == [[("r0", 1), ("r1", 5)]] * 4
