"""The cache-aware routing cost: expected prefill work before a request's first token, in prompt tokens."""

from __future__ import annotations

from backend_engine.block_hash import hash_prompt_blocks
from gateway.config import AffinityConfig, PoolConfig
from gateway.routing.policies import ExpectedTtft, PrefixAffinity, RouteRequest, expected_prefill
from gateway.routing.pool import Pool
from gateway.routing.prefix_index import PrefixIndex
from gateway.routing.replica import KvHold, Replica

BLOCK = 16


def prompt(tokens: int, start: int = 0) -> RouteRequest:
    """A request for a prompt of `tokens` tokens (whole blocks) with 16 tokens of output."""
    ids = list(range(start, start + tokens))
    return RouteRequest(hash_prompt_blocks(ids, BLOCK), tokens // BLOCK, 1, tokens, BLOCK)


def scorer(decode_weight: float = 10.0) -> tuple[ExpectedTtft, PrefixIndex]:
    index = PrefixIndex(10_000)
    return ExpectedTtft(index, AffinityConfig(decode_weight=decode_weight)), index


def queue_prefill(replica: Replica, tokens: int) -> KvHold:
    """A request this gateway routed to `replica` whose first token has not come yet."""
    hold = KvHold()
    hold.move(replica, 0, tokens)
    return hold


def test_a_cached_prefix_wins_until_the_queue_ahead_costs_more_than_it_saves():
    policy, index = scorer()
    holder, idle = Replica(url="http://holder"), Replica(url="http://idle")
    request = prompt(1024)
    index.add(request.block_hashes[:60], holder.url)  # 960 of 1,024 tokens cached: saves 960 tokens of prefill
    assert policy.rank([holder, idle], request).replicas[0] is holder  # 64 vs 1,024
    queue_prefill(holder, 900)  # 64 + 900 = 964 < 1,024: still worth the wait
    assert policy.rank([holder, idle], request).replicas[0] is holder
    queue_prefill(holder, 100)  # 64 + 1,000 = 1,064 > 1,024: the idle replica is sooner
    assert policy.rank([idle, holder], request).replicas[0] is idle
    assert policy.rank([holder, idle], request).replicas[0] is idle


def test_the_queue_is_counted_in_tokens_not_requests():
    policy, _ = scorer()
    few_long, many_short = Replica(url="http://few-long"), Replica(url="http://many-short")
    queue_prefill(few_long, 2000)
    for _ in range(5):
        queue_prefill(many_short, 100)  # five requests, but 500 tokens of work
    assert policy.rank([few_long, many_short], prompt(256)).replicas[0] is many_short


def test_first_token_takes_a_request_out_of_the_queue_once():
    replica = Replica(url="http://r")
    hold = queue_prefill(replica, 700)
    hold.prefill_done()
    hold.prefill_done()
    assert (replica.prefilling, replica.prefill_tokens) == (0, 0)
    hold.release()
    assert (replica.prefilling, replica.prefill_tokens, replica.reserved_blocks) == (0, 0, 0)


def test_routing_moves_an_admitted_hold_with_its_prefill():
    a, b = Replica(url="http://a"), Replica(url="http://b")
    hold = KvHold()
    hold.move(a, 10)  # admission: blocks only
    assert (a.reserved_blocks, a.prefill_tokens) == (10, 0)
    hold.move(b, 4, 300)  # routing chose b
    assert (a.reserved_blocks, a.prefilling, b.reserved_blocks, b.prefilling, b.prefill_tokens) == (0, 0, 4, 1, 300)
    hold.release()  # the request ended before any token (an error): nothing is left counted
    assert (b.reserved_blocks, b.prefilling, b.prefill_tokens) == (0, 0, 0)


def test_decoding_sequences_slow_the_prefill_by_their_calibrated_weight():
    policy, index = scorer(decode_weight=10.0)
    holder, idle = Replica(url="http://holder"), Replica(url="http://idle")
    request = prompt(512)
    index.add(request.block_hashes, holder.url)  # all 512 tokens cached there
    holder.observe(running=50, waiting=0, kv_usage=0.0, total_blocks=0)  # 50 streams x 10 = 500 < 512
    assert policy.rank([idle, holder], request).replicas[0] is holder
    holder.observe(running=52, waiting=0, kv_usage=0.0, total_blocks=0)  # 520 > 512
    assert policy.rank([holder, idle], request).replicas[0] is idle


def test_scraped_load_is_corrected_by_what_this_gateway_sent_since():
    replica = Replica(url="http://r")
    queue_prefill(replica, 300)
    replica.outstanding = 1
    replica.observe(running=3, waiting=1, kv_usage=0.2, total_blocks=100)  # ours is the one waiting
    assert (replica.foreign_waiting, replica.decoding) == (0, 3)
    replica.observe(running=3, waiting=4, kv_usage=0.2, total_blocks=100)  # three more from someone else
    assert (replica.foreign_waiting, replica.decoding) == (3, 3)
    request = prompt(256)
    assert expected_prefill(replica, request, 0, 10.0) == 256 + 300 + 3 * 256 + 3 * 10


def test_without_scrape_data_the_cost_uses_this_gateways_own_counts():
    """No scrape has answered (no totals, no load): every replica fits, and only local figures count."""
    policy, index = scorer()
    cold, holder = Replica(url="http://cold"), Replica(url="http://holder")
    request = prompt(320)
    index.add(request.block_hashes, holder.url)
    assert cold.free_blocks is None and holder.free_blocks is None
    assert policy.rank([cold, holder], request).replicas[0] is holder
    queue_prefill(holder, 400)
    assert policy.rank([holder, cold], request).replicas[0] is cold


def test_a_replica_without_room_for_the_request_goes_last_whatever_it_caches():
    policy, index = scorer()
    full, roomy = Replica(url="http://full"), Replica(url="http://roomy")
    request = prompt(320)
    index.add(request.block_hashes, full.url)
    full.observe(running=0, waiting=0, kv_usage=1.0, total_blocks=100)
    roomy.observe(running=0, waiting=0, kv_usage=0.5, total_blocks=100)
    assert [r.url for r in policy.rank([full, roomy], request).replicas] == ["http://roomy", "http://full"]


def test_equal_costs_take_turns():
    policy, index = scorer()
    pool = [Replica(url=f"http://r{i}") for i in range(3)]
    request = prompt(160)
    firsts = [policy.rank(pool, request).replicas[0].url for _ in range(6)]
    assert firsts == ["http://r0", "http://r1", "http://r2"] * 2
    for replica in pool[:2]:
        index.add(request.block_hashes, replica.url)  # two equal holders: they alternate, the third never wins
    firsts = [policy.rank(pool, request).replicas[0].url for _ in range(6)]
    assert set(firsts) == {"http://r0", "http://r1"} and firsts[0] != firsts[1]


def test_pools_score_by_expected_ttft_unless_configured_for_the_rules():
    replicas = [{"url": "http://a"}, {"url": "http://b"}]
    for routing in ("prefix_affinity", "kv_events"):
        pool = Pool(PoolConfig(name="p", replicas=replicas, routing=routing))
        assert isinstance(pool.policy, ExpectedTtft)
        request = pool.request_shape(100, 16, list(range(100)))
        assert (request.prompt_tokens, request.block_size, len(request.block_hashes)) == (100, 16, 6)
    rules = Pool(PoolConfig(name="p", replicas=replicas, routing="kv_events", affinity={"scorer": "rules"}))
    assert isinstance(rules.policy, PrefixAffinity)


def test_under_cache_pressure_a_miss_also_pays_for_the_prefixes_it_evicts():
    """Both replicas are full of cached blocks; the holder has one cold prefill queued. Without counting eviction
    the empty-queued replica wins (64 + 1,000 > 1,024); counting the 1,040 tokens the cold copy would push out of
    the other replica's cache, the holder is cheaper."""
    policy, index = scorer()
    holder, other = Replica(url="http://holder"), Replica(url="http://other")
    request = prompt(1024)
    index.add(request.block_hashes[:60], holder.url)
    index.add(prompt(1600, start=50_000).block_hashes, other.url)  # another tenant's 100 blocks fill `other`
    for replica in (holder, other):
        replica.observe(running=0, waiting=0, kv_usage=0.0, total_blocks=100)
    queue_prefill(holder, 1000)
    assert policy.rank([other, holder], request).replicas[0] is holder
    roomy = Replica(url="http://roomy")
    roomy.observe(running=0, waiting=0, kv_usage=0.0, total_blocks=1000)  # a cold replica with room: nothing evicted
    assert policy.rank([holder, roomy], request).replicas[0] is roomy


def test_a_decision_fed_index_forgets_what_a_full_replica_must_have_evicted():
    index = PrefixIndex(10_000)
    first, second = prompt(320), prompt(320, start=9_000)  # 20 blocks each
    index.add(first.block_hashes, "r", replica_capacity=30)
    index.add(second.block_hashes, "r", replica_capacity=30)
    assert index.blocks_held("r") == 30
    assert index.matched_blocks(first.block_hashes) == {}  # its leading blocks were the least recently routed
    assert index.matched_blocks(second.block_hashes) == {"r": 20}
    index.clear("r")
    assert index.blocks_held("r") == 0 and len(index) == 0
