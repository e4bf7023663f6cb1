"""Batching, prefix caching, preemption, chunked prefill and sampling on the real model."""

import numpy as np
import pytest

from backend_engine.block_hash import hash_prompt_blocks
from backend_engine.sequence import SamplingParams

from .conftest import reference

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def _prompts(loaded, n):
    texts = [
        "Write a haiku about the sea.",
        "List three prime numbers.",
        "Why is the sky blue?",
        "Translate 'cat' to Spanish.",
        "What is 7 times 8?",
        "Name a famous painter.",
        "Describe a cat in one sentence.",
        "Give me a synonym for happy.",
        "What is an atom?",
    ]
    return [loaded.tokenizer.encode(t) for t in texts[:n]]


def test_alone_equals_inside_batch(make_engine, loaded):
    eng = make_engine()
    target = reference()["cases"][4]["prompt_ids"]
    alone = eng.generate([target], GREEDY)[0].output_token_ids
    batch = eng.generate(_prompts(loaded, 8) + [target], GREEDY)
    assert batch[-1].output_token_ids == alone
    assert all(s.num_output_tokens == 24 for s in batch)


def test_shared_prefix_is_cached_and_output_unchanged(make_engine):
    eng = make_engine()
    rng = np.random.default_rng(1)
    prefix = [int(x) for x in rng.integers(200, 40000, 200)]
    a = prefix + [504, 3575, 282]
    b = prefix + [1780, 314, 260, 3575]
    cold_b = make_engine().generate([b], GREEDY)[0]
    assert cold_b.num_cached_tokens == 0
    first = eng.generate([a], GREEDY)[0]
    assert first.num_cached_tokens == 0
    warm_b = eng.generate([b], GREEDY)[0]
    assert warm_b.num_cached_tokens == 192  # 12 full 16-token blocks of the 200-token prefix
    assert warm_b.output_token_ids == cold_b.output_token_ids
    assert eng.block_manager.prefix_hits >= 192


def test_preemption_under_tiny_kv_budget(make_engine, loaded):
    bpt = loaded.model.kv_bytes_per_token()
    tiny = make_engine(kv_cache_bytes=bpt * 16 * 12)  # 12 blocks = 192 tokens for 6 sequences
    big = make_engine()
    prompts = _prompts(loaded, 6)
    sp = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    want = [s.output_token_ids for s in big.generate(prompts, sp)]
    got = tiny.generate(prompts, sp)
    assert tiny.scheduler.num_preemptions > 0
    assert [s.output_token_ids for s in got] == want
    assert tiny.block_manager.usage() == 0.0


def test_chunked_prefill_matches_and_does_not_stall_decodes(make_engine, loaded):
    eng = make_engine(max_num_batched_tokens=64)
    long_prompt = [int(x) for x in np.random.default_rng(2).integers(200, 40000, 300)]
    short = _prompts(loaded, 1)[0]
    ref_long = make_engine().generate([long_prompt], GREEDY)[0].output_token_ids
    s = eng.add_request("short", short, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    for _ in range(3):
        eng.step()
    before = s.num_output_tokens
    lng = eng.add_request("long", long_prompt, GREEDY)
    steps = 0
    while lng.num_output_tokens == 0:
        eng.step()
        steps += 1
    assert steps >= 5  # 300 tokens in chunks of <= 63 next to the decode
    assert s.num_output_tokens - before >= steps  # the decode advanced every step
    while not lng.is_finished:
        eng.step()
    assert lng.output_token_ids == ref_long


@pytest.mark.parametrize("stall", [0.0, 1e-9])
def test_a_prompt_beside_decoding_streams_is_cut_to_the_stall_bound(make_engine, loaded, stall):
    """A step that carries decodes computes `max_decode_stall` seconds of a new prompt at the engine's measured
    rate, at least a block (a bound this short leaves one block); with the bound off, the whole budget."""
    eng = make_engine(max_decode_stall=stall)
    rng = np.random.default_rng(3)
    first, second = ([int(x) for x in rng.integers(200, 40000, 300)] for _ in range(2))
    eng.generate([first], SamplingParams(max_tokens=1, temperature=0))  # a measured step, alone: whole budget
    stream = eng.add_request("stream", _prompts(loaded, 1)[0], SamplingParams(max_tokens=40, ignore_eos=True))
    while stream.num_output_tokens == 0:
        eng.step()
    new = eng.add_request("new", second, GREEDY)
    chunks = []
    while new.num_output_tokens == 0:
        before = new.num_computed_tokens
        eng.step()
        chunks.append(new.num_computed_tokens - before)
    assert chunks == ([300] if stall == 0 else [16] * 18 + [12]), chunks


def test_prompt_blocks_hash_like_the_gateway_predicts(make_engine):
    eng = make_engine()
    events = []
    eng.kv_event_sink = events.extend
    prompt = list(range(1000, 1040))
    eng.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
    stored = [e["block_hashes"][0] for e in events if e["type"] == "BlockStored"]
    assert stored[:2] == hash_prompt_blocks(prompt, 16)


def test_sampling_seed_reproducible_and_varies(engine, loaded):
    p = _prompts(loaded, 1)
    sp = lambda seed: SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, top_k=50, seed=seed)  # noqa: E731
    a = engine.generate(p, sp(7))[0].output_token_ids
    b = engine.generate(p, sp(7))[0].output_token_ids
    c = engine.generate(p, sp(8))[0].output_token_ids
    assert a == b
    assert a != c


def test_top_k_one_and_tiny_top_p_are_greedy(engine, loaded):
    p = _prompts(loaded, 1)
    g = engine.generate(p, SamplingParams(max_tokens=12, temperature=0))[0].output_token_ids
    assert engine.generate(p, SamplingParams(max_tokens=12, temperature=0.8, top_k=1))[0].output_token_ids == g
    assert (
        engine.generate(p, SamplingParams(max_tokens=12, temperature=0.8, top_p=1e-6, seed=3))[0].output_token_ids == g
    )


def test_stop_conditions(engine):
    case = reference()["cases"][1]  # "The capital of France is" -> " Paris.\n\nThe answer is: ..."
    s = engine.generate([case["prompt_ids"]], SamplingParams(max_tokens=30, temperature=0, stop=["\n\n"]))[0]
    assert s.output_text == " Paris." and s.finish_reason == "stop" and s.stop_reason == "\n\n"
    s = engine.generate([case["prompt_ids"]], SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[30]))[0]
    assert s.output_token_ids == [7042, 30] and s.stop_reason == 30
    s = engine.generate([case["prompt_ids"]], SamplingParams(max_tokens=3, temperature=0))[0]
    assert s.num_output_tokens == 3 and s.finish_reason == "length"
    s = engine.generate([case["prompt_ids"]], SamplingParams(max_tokens=60, temperature=0))[0]
    assert s.finish_reason == "stop" and s.output_token_ids[-1] == 2  # EOS


def test_invalid_requests_rejected(engine):
    with pytest.raises(ValueError):
        engine.add_request("bad1", [], SamplingParams())
    with pytest.raises(ValueError):
        engine.add_request("bad2", [10**9], SamplingParams())
    with pytest.raises(ValueError):
        engine.add_request("bad3", [1, 2], SamplingParams(top_p=0))
    with pytest.raises(ValueError):
        engine.add_request("bad4", [1] * 20000, SamplingParams())


def test_abort_frees_blocks(make_engine):
    eng = make_engine()
    eng.add_request("x", list(range(500, 560)), SamplingParams(max_tokens=100))
    eng.step()
    assert eng.block_manager.usage() > 0
    assert eng.abort("x")
    assert eng.block_manager.usage() == 0.0 and not eng.has_unfinished()


def test_sequence_longer_than_cache_stops_at_length(make_engine, loaded):
    bpt = loaded.model.kv_bytes_per_token()
    eng = make_engine(kv_cache_bytes=bpt * 16 * 4)  # 64 tokens in all
    assert eng.max_model_len == 64
    s = eng.generate([list(range(300, 340))], SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))[0]
    assert s.finish_reason == "length" and s.num_tokens == 64


def _resident_fraction(array: np.ndarray) -> float:
    """The share of `array`'s memory pages the kernel has mapped in (mincore(2)), whole pages only."""
    import ctypes
    import mmap

    page = mmap.PAGESIZE
    start = -(-array.ctypes.data // page) * page
    end = (array.ctypes.data + array.nbytes) // page * page
    pages = (end - start) // page
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(end - start), vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec) / pages


def test_kv_cache_memory_is_in_place_before_the_first_request(make_engine):
    """A fresh block must not pay the kernel's first-touch page faults inside a request's prefill."""
    eng = make_engine(kv_cache_bytes=128 << 20)
    assert min(_resident_fraction(layer) for layer in eng.kv_cache) == 1.0
