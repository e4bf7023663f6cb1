"""portcullis bench: the request sequence is a pure function of the seed and the workload options."""

from __future__ import annotations

import dataclasses
import statistics
from collections import Counter, defaultdict

import pytest

from gateway.bench.runner import BenchConfig, conversation_messages, plan_fingerprint
from gateway.bench.workload import WORDS, WorkloadSpec, arrival_times, build_plan

SHARED = WorkloadSpec(
    workload="shared-prefix",
    tenants=4,
    system_prompt_len=200,
    conversations=6,
    turns=3,
    user_len=20,
    num_requests=40,
    request_rate=5.0,
    seed=7,
)


def test_same_seed_same_sequence_other_seed_other_sequence():
    for spec in (SHARED, WorkloadSpec(workload="random", num_requests=30, range_ratio=0.5, request_rate=2.0)):
        assert build_plan(spec) == build_plan(dataclasses.replace(spec))
        other = build_plan(dataclasses.replace(spec, seed=spec.seed + 1))
        assert [p.user for p in other] != [p.user for p in build_plan(spec)]
        assert [p.arrival_s for p in other] != [p.arrival_s for p in build_plan(spec)]
        assert plan_fingerprint(build_plan(spec)) == plan_fingerprint(build_plan(dataclasses.replace(spec)))
        assert plan_fingerprint(other) != plan_fingerprint(build_plan(spec))


def test_more_requests_append_without_changing_earlier_ones():
    short, long = build_plan(dataclasses.replace(SHARED, num_requests=20)), build_plan(SHARED)
    assert long[:20] == short


def test_bench_config_carries_the_same_plan_whatever_the_target():
    a = BenchConfig(**dataclasses.asdict(SHARED), base_url="http://a", concurrency=4)
    b = dataclasses.replace(a, base_url="http://b", name="b", concurrency=None, output_len=8)
    assert build_plan(a.workload_spec()) == build_plan(b.workload_spec()) == build_plan(SHARED)


def test_shared_prefix_conversations_tenants_and_turns():
    plan = build_plan(SHARED)
    assert len(plan) == 40 and [p.index for p in plan] == list(range(40))
    by_conv = defaultdict(list)
    for p in plan:
        by_conv[p.conversation].append(p)
    for turns in by_conv.values():
        assert [p.turn for p in turns] == list(range(len(turns)))  # sequential, none skipped
        assert len(turns) <= SHARED.turns
        assert len({p.tenant for p in turns}) == 1 and len({p.system for p in turns}) == 1
    systems = {p.tenant: p.system for p in plan}
    assert len(set(systems.values())) == len(systems) == SHARED.tenants  # one distinct prompt per tenant
    assert all(len(s.split()) == 200 for s in systems.values())
    assert all(set(s.split()) <= set(WORDS) for s in systems.values())
    # conversations interleave: the first 6 requests are 6 different conversations
    assert len({p.conversation for p in plan[:6]}) == 6
    # a finished conversation is replaced in its slot: 6 rounds of 6 finish 12 conversations, 4 more start
    assert len(by_conv) == 16 and sorted(len(t) for t in by_conv.values()) == [1] * 4 + [3] * 12
    assert max(by_conv) == len(by_conv) - 1


def test_default_request_count_is_conversations_times_turns():
    spec = dataclasses.replace(SHARED, num_requests=None)
    plan = build_plan(spec)
    assert len(plan) == 18 and len({p.conversation for p in plan}) == 6
    assert Counter(p.turn for p in plan) == {0: 6, 1: 6, 2: 6}
    assert len(build_plan(WorkloadSpec())) == 100


def test_hot_tenant_share_skews_conversations():
    spec = dataclasses.replace(SHARED, tenants=8, conversations=400, turns=1, num_requests=400, hot_tenant_share=0.5)
    counts = Counter(p.tenant for p in build_plan(spec))
    assert 0.4 < counts[0] / 400 < 0.6
    assert all(counts[t] < counts[0] / 3 for t in range(1, 8))
    even = Counter(p.tenant for p in build_plan(dataclasses.replace(spec, hot_tenant_share=None)))
    assert set(even.values()) == {50}


def test_poisson_arrivals():
    times = arrival_times(3, 4000, 20.0)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert times[0] == 0.0 and all(g >= 0 for g in gaps)
    assert statistics.mean(gaps) == pytest.approx(1 / 20, rel=0.08)
    assert statistics.stdev(gaps) == pytest.approx(1 / 20, rel=0.1)  # exponential: stdev = mean
    assert arrival_times(3, 5, None) == [0.0] * 5


def test_random_workload_lengths_and_no_shared_leading_text():
    spec = WorkloadSpec(workload="random", num_requests=50, input_len=100, range_ratio=0.2)
    plan = build_plan(spec)
    lengths = [len(p.user.split()) for p in plan]
    assert min(lengths) >= 80 and max(lengths) <= 120 and len(set(lengths)) > 5
    assert all(p.system is None and p.turn == 0 for p in plan)
    assert len({p.user.split()[0] for p in plan}) == 50


def test_conversation_history_uses_the_replies_returned():
    plan = build_plan(SHARED)
    by_turn = {(p.conversation, p.turn): p for p in plan}
    third = next(p for p in plan if p.turn == 2)
    replies = {(third.conversation, 0): "first reply", (third.conversation, 1): "second reply"}
    messages = conversation_messages(by_turn, replies, third)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert messages[0]["content"] == third.system
    assert messages[1]["content"] == by_turn[(third.conversation, 0)].user
    assert [messages[2]["content"], messages[4]["content"]] == ["first reply", "second reply"]
    assert messages[-1]["content"] == third.user


@pytest.mark.parametrize(
    "bad",
    [
        dict(workload="nope"),
        dict(tenants=0),
        dict(hot_tenant_share=1.5),
        dict(request_rate=0.0),
        dict(num_requests=0),
        dict(range_ratio=1.0),
    ],
)
def test_invalid_options_are_rejected(bad):
    with pytest.raises(ValueError):
        WorkloadSpec(**bad)
