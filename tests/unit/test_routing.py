"""Routing: replica ordering policies, the prefix index, cache-aware scoring and its balance rule, health."""

from __future__ import annotations

import asyncio
import time
import typing
from collections import Counter

import pytest
from aiohttp import web

from backend_engine.block_hash import hash_prompt_blocks
from gateway.config import AffinityConfig, PoolConfig
from gateway.routing.kv_events import apply_batch
from gateway.routing.policies import LeastLoad, LeastOutstanding, PrefixAffinity, RoundRobin, RouteRequest
from gateway.routing.pool import Pool, Pools
from gateway.routing.prefix_index import PrefixIndex
from gateway.routing.recent_share import RecentShare
from gateway.routing.replica import Replica
from gateway.routing.scraper import engine_load

NO_REQUEST = RouteRequest()


def replicas(n: int) -> list[Replica]:
    return [Replica(url=f"http://r{i}") for i in range(n)]


def test_round_robin_rotates_the_first_choice_and_keeps_the_rest_as_fallbacks():
    pool, policy = replicas(3), RoundRobin()
    firsts = [policy.rank(pool, NO_REQUEST).replicas[0].url for _ in range(6)]
    assert firsts == ["http://r0", "http://r1", "http://r2"] * 2
    assert sorted(r.url for r in policy.rank(pool, NO_REQUEST).replicas) == [r.url for r in pool]


@pytest.mark.parametrize("routing", typing.get_args(PoolConfig.model_fields["routing"].annotation))
def test_every_policy_ranks_each_replica_once_and_rotates_among_equals(routing):
    """The contract the route stage relies on: a full ordering of the replicas, and idle equals taking turns."""
    pool = Pool(PoolConfig(name="p", replicas=[{"url": f"http://r{i}"} for i in range(3)], routing=routing))
    request = pool.request_shape(40, 16, list(range(40)))
    firsts = []
    for _ in range(3):
        ranked = pool.policy.rank(pool.replicas, request)
        assert sorted(r.url for r in ranked.replicas) == [r.url for r in pool.replicas]
        firsts.append(ranked.replicas[0].url)
    assert sorted(firsts) == [r.url for r in pool.replicas]


def test_least_outstanding_prefers_idle_replicas_and_spreads_ties():
    pool = [Replica(url="http://busy", outstanding=5), Replica(url="http://a"), Replica(url="http://b")]
    policy = LeastOutstanding()
    assert {policy.rank(pool, NO_REQUEST).replicas[0].url for _ in range(4)} == {"http://a", "http://b"}
    assert all(policy.rank(pool, NO_REQUEST).replicas[-1].url == "http://busy" for _ in range(3))


def test_least_load_uses_scraped_load_corrected_by_local_sends():
    a, b = replicas(2)
    a.observe(running=4, waiting=2, kv_usage=0.5, total_blocks=100)
    b.observe(running=1, waiting=0, kv_usage=0.1, total_blocks=100)
    assert LeastLoad().rank([a, b], NO_REQUEST).replicas[0] is b
    b.outstanding += 7  # sent since b's scrape: b is now the busier one
    assert b.load == 8 and LeastLoad().rank([a, b], NO_REQUEST).replicas[0] is a


def test_prefix_index_matches_leading_blocks_per_replica_and_evicts_lru():
    index = PrefixIndex(capacity=6)
    prompt = hash_prompt_blocks(list(range(64)), 16)  # 4 blocks
    index.add(prompt, "A")
    index.add(prompt[:2], "B")
    assert index.matched_blocks(prompt) == {"A": 4, "B": 2}
    other = hash_prompt_blocks(list(range(100, 164)), 16)
    index.add(other, "C")  # 4 more hashes over capacity 6: the least recently used go
    assert len(index) == 6
    assert index.matched_blocks(other) == {"C": 4}
    index.remove(prompt[1:2], "A")  # an evicted middle block breaks the chain
    assert index.matched_blocks(prompt).get("A", 0) <= 1


def test_kv_event_batches_feed_and_clear_the_index():
    index = PrefixIndex(100)
    hashes = hash_prompt_blocks(list(range(48)), 16)
    apply_batch(index, "E", {"seq": 1, "events": [{"type": "BlockStored", "block_hashes": hashes}]})
    assert index.matched_blocks(hashes) == {"E": 3}
    apply_batch(index, "E", {"seq": 2, "events": [{"type": "BlockRemoved", "block_hashes": hashes[2:]}]})
    assert index.matched_blocks(hashes) == {"E": 2}
    apply_batch(index, "E", {"seq": 3, "events": [{"type": "AllBlocksCleared"}]})
    assert index.matched_blocks(hashes) == {}


def _affinity(**overrides) -> tuple[PrefixAffinity, PrefixIndex]:
    index = PrefixIndex(1000)
    return PrefixAffinity(index, AffinityConfig(**overrides)), index


def test_affinity_routes_to_the_replica_holding_the_prefix_and_learns():
    policy, index = _affinity()
    pool = replicas(3)
    tokens = list(range(320))
    request = RouteRequest(hash_prompt_blocks(tokens, 16), prompt_blocks=20, decode_blocks=2)
    first = policy.rank(pool, request).replicas[0]
    policy.learn(request, first)
    for _ in range(5):
        ranked = policy.rank(pool, request)
        assert ranked.replicas[0] is first
        assert ranked.cached_blocks == {first.url: 20}
        assert ranked.blocks_needed(first, request) == 2  # only decode blocks left to allocate


def test_affinity_gives_way_to_load_so_a_hot_prefix_cannot_pile_up():
    policy, index = _affinity(balance_abs_threshold=4, balance_rel_threshold=1.5)
    hot, cold = replicas(2)
    request = RouteRequest(hash_prompt_blocks(list(range(160)), 16), prompt_blocks=10, decode_blocks=1)
    index.add(request.block_hashes, hot.url)
    hot.outstanding = 4
    assert policy.rank([hot, cold], request).replicas[0] is hot  # within thresholds: the cache wins
    hot.outstanding = 9
    assert policy.rank([hot, cold], request).replicas[0] is cold  # 9 > 0 + 4 and 9 > 1.5 x 0


def test_affinity_copies_a_hot_prefix_instead_of_piling_onto_its_holder():
    """Every request shares one prefix and finishes at once (no in-flight load): the holder takes its bounded
    share, then the prefix spreads, and over many decisions no replica exceeds max_share x the mean."""
    policy, index = _affinity(max_share=1.25, share_window=40)
    pool = replicas(4)
    request = RouteRequest(hash_prompt_blocks(list(range(320)), 16), prompt_blocks=20, decode_blocks=1)
    chosen = []
    for _ in range(200):
        replica = policy.rank(pool, request).replicas[0]
        policy.learn(request, replica)
        chosen.append(replica.url)
    first = chosen[0]
    assert chosen[:4] == [first] * 4  # the holder keeps it until it is past its share
    for end in range(40, 201, 10):  # every full window
        counts = Counter(chosen[end - 40 : end])
        assert len(counts) == 4 and max(counts.values()) <= 1.25 * 40 / 4 + 1, counts


def test_recent_share_forgets_decisions_older_than_its_window():
    share = RecentShare(window=8)
    for url in "aaaaaabb":
        share.add(url)
    assert share.over("a", replicas=2, max_share=1.25)  # 6 + 1 of 9 > ceil(1.25 x 4.5)
    assert not share.over("b", replicas=2, max_share=1.25)
    for url in "bbbb":
        share.add(url)  # the window is now a, a and six b
    assert not share.over("a", replicas=2, max_share=1.25) and share.over("b", replicas=2, max_share=1.25)


def test_affinity_needs_room_for_the_rest_and_a_real_share_of_the_prompt():
    policy, index = _affinity(match_threshold=0.5)
    hot, cold = replicas(2)
    request = RouteRequest(hash_prompt_blocks(list(range(160)), 16), prompt_blocks=10, decode_blocks=4)
    index.add(request.block_hashes, hot.url)
    hot.observe(running=1, waiting=0, kv_usage=0.98, total_blocks=100)  # 2 free blocks < 4 needed
    cold.observe(running=1, waiting=0, kv_usage=0.10, total_blocks=100)
    assert policy.rank([hot, cold], request).replicas[0] is cold
    hot.observe(running=1, waiting=0, kv_usage=0.50, total_blocks=100)
    assert policy.rank([hot, cold], request).replicas[0] is hot
    index.clear(hot.url)
    index.add(request.block_hashes[:4], hot.url)  # 4 of 10 blocks: under the threshold, treated as cold
    assert policy.rank([hot, cold], request).replicas[0] is cold  # cold is less busy (10 vs 50 blocks in use)


def test_passive_ejection_and_readmission():
    replica = Replica(url="http://r")
    for _ in range(2):
        replica.record(False, failures_to_eject=3, eject_seconds=0.2)
    assert replica.available()
    replica.record(False, failures_to_eject=3, eject_seconds=0.2)
    assert not replica.available() and replica.state == "ejected"
    time.sleep(0.25)
    assert replica.available()
    replica.record(True, 3, 0.2)
    assert replica.failures == 0


def test_ejected_replicas_are_ranked_last_but_not_dropped():
    pool = Pool(
        PoolConfig(
            name="p",
            replicas=[{"url": "http://a"}, {"url": "http://b"}],
            routing="round_robin",
            health={"failures_to_eject": 1, "eject_seconds": 60},
        )
    )
    try:
        pool.record(pool.replicas[0], ok=False)
        for _ in range(3):
            assert [r.url for r in pool.rank(NO_REQUEST).replicas] == ["http://b", "http://a"]
    finally:
        asyncio.run(pool.aclose())


def test_pools_without_scraping_probe_their_health_path():
    """A real HTTP server on loopback answers /health with 200, then 503, then 200 again: the replica is ejected
    after `failures_to_eject` failed probes, before any request finds it down, and re-admitted on the next good one."""

    async def scenario() -> None:
        status = {"code": 200, "probes": 0}

        async def health(request: web.Request) -> web.Response:
            status["probes"] += 1
            return web.Response(status=status["code"])

        app = web.Application()
        app.router.add_get("/health", health)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        pool = Pool(
            PoolConfig(
                name="p",
                replicas=[{"url": f"http://127.0.0.1:{port}"}],
                routing="round_robin",
                health={"path": "/health", "interval": 0.05, "failures_to_eject": 2, "eject_seconds": 60},
            )
        )
        replica = pool.replicas[0]

        async def until(condition) -> None:
            for _ in range(200):
                if condition():
                    return
                await asyncio.sleep(0.025)
            raise AssertionError("timed out")

        try:
            pool.start()
            await until(lambda: status["probes"] >= 2)
            assert replica.available()
            status["code"] = 503
            await until(lambda: not replica.available())
            status["code"] = 200
            await until(replica.available)
        finally:
            await pool.aclose()
            await runner.cleanup()

    asyncio.run(scenario())


def test_request_shape_hashes_exactly_like_the_engine():
    pool = Pool(PoolConfig(name="p", replicas=[{"url": "http://a"}], routing="prefix_affinity", block_size=16))
    try:
        ids = list(range(1000, 1040))
        shape = pool.request_shape(40, 100, ids)
        assert shape.block_hashes == hash_prompt_blocks(ids, 16) and len(shape.block_hashes) == 2
        assert (shape.prompt_blocks, shape.decode_blocks) == (3, 7)
        assert pool.request_shape(40, 100, None).block_hashes == []
    finally:
        asyncio.run(pool.aclose())


def test_engine_metrics_are_parsed_into_load():
    text = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 2.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="m"} 0.25
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",num_gpu_blocks="4096"} 1.0
"""
    assert engine_load(text) == (3, 2, 0.25, 4096)


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


# Shaped like the example output in SGLang's docs/references/production_metrics.md, with the labels its
# python/sglang/srt/metrics/collector.py gives the scheduler gauges (a second tensor-parallel rank repeats rank 0).
SGLANG_METRICS = """# HELP sglang:num_running_reqs The number of running requests
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{engine_type="unified",model_name="Qwen/Qwen3-8B",pp_rank="0",tp_rank="0"} 162.0
sglang:num_running_reqs{engine_type="unified",model_name="Qwen/Qwen3-8B",pp_rank="0",tp_rank="1"} 162.0
# HELP sglang:num_used_tokens The number of used tokens
# TYPE sglang:num_used_tokens gauge
sglang:num_used_tokens{engine_type="unified",model_name="Qwen/Qwen3-8B",pp_rank="0",tp_rank="0"} 123859.0
# HELP sglang:token_usage The token usage
# TYPE sglang:token_usage gauge
sglang:token_usage{engine_type="unified",model_name="Qwen/Qwen3-8B",pp_rank="0",tp_rank="0"} 0.28
# HELP sglang:num_queue_reqs The number of requests in the waiting queue
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{engine_type="unified",model_name="Qwen/Qwen3-8B",pp_rank="0",tp_rank="0"} 2826.0
# HELP sglang:max_total_num_tokens Maximum total number of tokens in the KV cache pool.
# TYPE sglang:max_total_num_tokens gauge
sglang:max_total_num_tokens{engine_type="unified",model_name="Qwen/Qwen3-8B",pp_rank="0",tp_rank="0"} 442357.0
"""


def test_sglang_metrics_are_parsed_into_load():
    assert engine_load(SGLANG_METRICS, block_size=16) == (162, 2826, 0.28, 442357 // 16)
    underscored = SGLANG_METRICS.replace("sglang:", "sglang_")  # the spelling some SGLang releases expose
    assert engine_load(underscored, block_size=32) == (162, 2826, 0.28, 442357 // 32)


def test_vllms_older_kv_usage_name_and_data_parallel_engines():
    text = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 4.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:gpu_cache_usage_perc{engine="1",model_name="m"} 0.25
"""
    assert engine_load(text) == (7, 1, 0.375, 0)
