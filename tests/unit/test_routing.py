"""Replica ordering policies and model-to-pool selection."""

from __future__ import annotations

import asyncio

from gateway.config import PoolConfig
from gateway.routing.pool import Pool, Pools, Replica, least_outstanding, round_robin


def test_round_robin_rotates_the_first_choice_and_keeps_the_rest_as_fallbacks():
    replicas = [Replica(url=f"http://r{i}") for i in range(3)]
    order = round_robin()
    firsts = [order(replicas)[0].url for _ in range(6)]
    assert firsts == ["http://r0", "http://r1", "http://r2"] * 2
    assert sorted(r.url for r in order(replicas)) == [r.url for r in replicas]


def test_least_outstanding_prefers_idle_replicas_and_spreads_ties():
    replicas = [Replica(url="http://busy", outstanding=5), Replica(url="http://a"), Replica(url="http://b")]
    order = least_outstanding()
    firsts = {order(replicas)[0].url for _ in range(4)}
    assert firsts == {"http://a", "http://b"}
    assert all(order(replicas)[-1].url == "http://busy" for _ in range(3))


def _pool(name: str, models: list[str]) -> Pool:
    return Pool(PoolConfig(name=name, replicas=[{"url": "http://x"}], models=models))


def test_explicit_model_lists_win_over_catch_all_pools():
    pools = Pools([_pool("any", []), _pool("gpt", ["gpt-4o"])])
    try:
        assert pools.for_model("gpt-4o").name == "gpt"
        assert pools.for_model("llama").name == "any"
        assert Pools([_pool("gpt", ["gpt-4o"])]).for_model("llama") is None
    finally:
        asyncio.run(pools.aclose())
