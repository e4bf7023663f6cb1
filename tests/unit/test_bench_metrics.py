"""portcullis bench: metric math (vLLM definitions), percentiles, goodput, replica share, oracle prefix hits."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.bench.metrics import (
    RequestResult,
    measured_hit_rate,
    meets_slo,
    oracle_hit_rate,
    oracle_hits,
    replica_share,
    stats_ms,
    summarize,
)


def ok(index: int = 0, ttft: float = 0.1, e2el: float = 0.5, tokens: int | None = 5, itl=(), **kw) -> RequestResult:
    return RequestResult(
        index,
        0,
        index,
        0,
        success=True,
        status=200,
        ttft_s=ttft,
        e2el_s=e2el,
        itl_s=list(itl),
        completion_tokens=tokens,
        chunks=kw.pop("chunks", 0),
        **kw,
    )


def test_tpot_excludes_the_first_token():
    # 5 tokens: the first at 100 ms, the other 4 over the remaining 400 ms -> 100 ms each
    assert ok(ttft=0.1, e2el=0.5, tokens=5).tpot_s == pytest.approx(0.1)
    assert ok(ttft=0.1, e2el=0.5, tokens=1).tpot_s == 0.0
    # without usage, the text chunks count as tokens
    assert ok(ttft=0.2, e2el=0.5, tokens=None, chunks=4).tpot_s == pytest.approx(0.1)
    assert RequestResult(0, 0, 0, 0).tpot_s is None


def test_percentiles_interpolate_linearly_in_ms():
    stats = stats_ms([i / 1000 for i in range(1, 101)])  # 1..100 ms
    assert stats["mean"] == pytest.approx(50.5)
    assert stats["p50"] == pytest.approx(50.5)
    assert stats["p90"] == pytest.approx(90.1)
    assert stats["p99"] == pytest.approx(99.01)
    assert stats_ms([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_summary_counts_throughput_itl_and_excludes_failures():
    results = [
        ok(0, ttft=0.1, e2el=0.5, tokens=5, itl=[0.1, 0.1, 0.1, 0.1], prompt_tokens=100),
        ok(1, ttft=0.3, e2el=0.3, tokens=1, prompt_tokens=50),
        RequestResult(2, 0, 2, 0, status=500, error="HTTP 500: boom", prompt_tokens=999, ttft_s=9.0),
        RequestResult(3, 0, 3, 0, cancelled=True, error="cancelled"),
    ]
    s = summarize(results, duration_s=2.0)
    assert (s["completed"], s["failed"], s["cancelled"]) == (2, 1, 1)
    assert s["errors"] == {"HTTP 500: boom": 1}
    assert s["total_output_tokens"] == 6 and s["total_input_tokens"] == 150
    assert s["output_throughput"] == pytest.approx(3.0)
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["total_token_throughput"] == pytest.approx(78.0)
    assert s["ttft_ms"]["mean"] == pytest.approx(200.0)  # the failed request's 9 s is left out
    assert s["tpot_ms"]["mean"] == pytest.approx(100.0)  # the one-token request has no TPOT sample
    assert s["itl_ms"]["p50"] == pytest.approx(100.0)
    assert s["e2el_ms"]["p50"] == pytest.approx(400.0)
    assert s["goodput"] is None


def test_goodput_needs_every_slo():
    fast = ok(0, ttft=0.1, e2el=0.5, tokens=5)  # TTFT 100 ms, TPOT 100 ms
    slow_first = ok(1, ttft=0.6, e2el=1.0, tokens=5)  # TTFT 600 ms, TPOT 100 ms
    slow_decode = ok(2, ttft=0.1, e2el=2.1, tokens=5)  # TTFT 100 ms, TPOT 500 ms
    failed = RequestResult(3, 0, 3, 0, status=503, error="x")
    assert meets_slo(fast, 500, 200) and not meets_slo(slow_first, 500, 200) and not meets_slo(slow_decode, 500, 200)
    assert meets_slo(slow_decode, 500, None) and meets_slo(slow_first, None, 200)
    assert not meets_slo(failed, None, None)
    s = summarize([fast, slow_first, slow_decode, failed], duration_s=4.0, slo_ttft_ms=500, slo_tpot_ms=200)
    assert s["goodput"]["good_requests"] == 1
    assert s["goodput"]["request_goodput"] == pytest.approx(0.25)
    assert s["goodput"]["attainment"] == pytest.approx(1 / 3)
    assert summarize([fast, slow_first], 1.0, slo_ttft_ms=500)["goodput"]["good_requests"] == 1


def test_replica_share_from_header_else_none():
    rows = [ok(i, replica=name) for i, name in enumerate(["r0", "r1", "r0", "r0", None])]
    assert replica_share(rows) == {"r0": {"requests": 3, "share": 0.75}, "r1": {"requests": 1, "share": 0.25}}
    assert replica_share([ok(0), ok(1)]) is None
    assert summarize([ok(0)], 1.0)["replica_share"] is None


def test_measured_hit_rate_from_usage_cached_tokens():
    rows = [
        ok(0, prompt_tokens=100, cached_tokens=0),
        ok(1, prompt_tokens=100, cached_tokens=64),
        ok(2, prompt_tokens=100),
    ]  # no cached_tokens reported: left out
    assert measured_hit_rate(rows) == (pytest.approx(0.32), 64, 200)
    assert measured_hit_rate([ok(0, prompt_tokens=10)])[0] is None


def test_oracle_hits_on_a_hand_built_sequence():
    a = list(range(1, 11))  # 10 tokens, blocks of 4: [1-4] [5-8] + 2 left over
    prompts = [
        a,  # first: nothing earlier
        a[:8] + [99, 100],  # shares 8 tokens = 2 blocks with a
        a[:4] + [50, 51, 52, 53, 54],  # shares 1 block
        list(a),  # identical to a: the last token is always computed -> 2 blocks
        a[:8],  # exact prefix of 8: only (8 - 1) // 4 = 1 block may hit
        [7, 7, 7, 7, 7],  # nothing in common
        a[:8] + [99, 100, 101, 102, 5, 5, 5],  # 10 in common with prompt 2, but block 3 was never complete -> 8
        a[:3] + [0, 0],  # 3 in common: below a block
    ]
    assert oracle_hits(prompts, block_size=4) == [0, 8, 4, 8, 4, 0, 8, 0]
    assert oracle_hit_rate(prompts, block_size=4) == pytest.approx(32 / sum(map(len, prompts)))
    assert oracle_hit_rate([], 4) is None
    # block 3 of the 7th prompt is complete now: a prompt repeating it hits 3 blocks
    assert oracle_hits(prompts + [a[:8] + [99, 100, 101, 102, 0]], 4)[-1] == 12


def _brute_force(prompts: list[list[int]], block: int) -> list[int]:
    out = []
    for i, p in enumerate(prompts):
        best = 0
        for q in prompts[:i]:
            n = 0
            while n < min(len(p), len(q)) and p[n] == q[n]:
                n += 1
            best = max(best, min(n, len(p) - 1) // block * block)
        out.append(best)
    return out


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2), min_size=0, max_size=14), max_size=8), st.integers(1, 4))
def test_oracle_hits_equal_the_brute_force_longest_common_prefix(prompts, block):
    """Longest common prefix with any earlier prompt, in whole blocks of the earlier prompt, len - 1 cap."""
    assert oracle_hits(prompts, block) == _brute_force(prompts, block)


def test_oracle_with_cached_outputs_lets_the_next_turn_hit_the_reply():
    turn1 = list(range(1, 9))  # prompt of turn 1: 2 blocks of 4
    reply = [9, 10, 11, 12, 13]  # its output: one more full block once appended
    turn2 = turn1 + reply + [0, 0, 0]  # next turn = history + reply + new user message
    assert oracle_hits([turn1, turn2], 4) == [0, 8]
    assert oracle_hits([turn1, turn2], 4, cached=[turn1 + reply, turn2]) == [0, 12]


def test_per_tenant_breakdown():
    rows = [
        RequestResult(0, 0, 0, 0, success=True, ttft_s=0.1, e2el_s=0.2, prompt_tokens=100, cached_tokens=50),
        RequestResult(1, 0, 1, 0, success=True, ttft_s=0.3, e2el_s=0.4, prompt_tokens=100, cached_tokens=0),
        RequestResult(2, 1, 2, 0, status=429, error="limited"),
        RequestResult(3, 1, 3, 0, cancelled=True),
    ]
    tenants = summarize(rows, 1.0)["per_tenant"]
    assert tenants["0"] == {
        "requests": 2,
        "completed": 2,
        "failed": 0,
        "ttft_p50_ms": pytest.approx(200.0),
        "ttft_p99_ms": pytest.approx(298.0),
        "measured_hit_rate": pytest.approx(0.25),
    }
    assert tenants["1"] == {
        "requests": 1,
        "completed": 0,
        "failed": 1,
        "ttft_p50_ms": None,
        "ttft_p99_ms": None,
        "measured_hit_rate": None,
    }
