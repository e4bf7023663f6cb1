"""A gateway pool of two "vLLM" replicas: real HTTP upstreams (tests/fake_upstream.py) and, for each, a fake vLLM
KV-event publisher on a real ZMQ socket (tests/vllm_kv_publisher.py; vLLM cannot run here). Replica a publishes
vLLM main's map layout and has a replay socket; replica b publishes the older array layout and has none.

Prompts go in as token ids (/v1/completions), so the ids the gateway hashes are exactly the ones the publisher's
own transcription of vLLM's hashing stores; what a replica "would report" is vLLM's cached-token rule.
"""

from __future__ import annotations

import contextlib
import json
import random
import time

import httpx
import pytest

from tests.conftest import free_port
from tests.vllm_kv_publisher import (
    VllmKvPublisher,
    all_blocks_cleared,
    as_int,
    block_removed,
    block_stored,
    reported_cached_tokens,
    vllm_block_hashes,
)

MODEL = "SmolLM2-135M-Instruct"  # the default model entry: the bundled tokenizer takes token-id prompts as they are
SEED, ALGO, BLOCK = "4242", "sha256_cbor", 16
SETTLE = 0.5  # seconds for a published batch to reach the gateway's index


def prompt(n: int, seed: int) -> list[int]:
    return [random.Random(seed).randrange(100, 40_000) for _ in range(n)]


class Replica:
    def __init__(self, upstream, publisher: VllmKvPublisher) -> None:
        self.url, self.publisher = upstream.url, publisher

    def store(self, ids: list[int], lose: bool = False) -> int:
        """BlockStored for every full block of `ids`; returns the number of blocks."""
        digests = vllm_block_hashes(ids, BLOCK, ALGO, SEED)
        event = block_stored([as_int(d) for d in digests], ids, BLOCK)
        (self.publisher.lose if lose else self.publisher.publish)(event)
        return len(digests)

    def remove(self, ids: list[int]) -> None:
        self.publisher.publish(block_removed([as_int(d) for d in vllm_block_hashes(ids, BLOCK, ALGO, SEED)]))


@contextlib.contextmanager
def started_fleet(launcher):
    """Two fake replicas with their publishers, and a gateway routing on their events."""
    endpoints = {name: f"tcp://127.0.0.1:{free_port()}" for name in ("a", "a_replay", "b")}
    publishers = [
        VllmKvPublisher(endpoints["a"], endpoints["a_replay"], topic="kv", events_as_maps=True, batch_as_map=True),
        VllmKvPublisher(endpoints["b"], None, topic="kv", events_as_maps=False, batch_as_map=False),
    ]
    try:
        upstreams = [launcher.fake_upstream("a"), launcher.fake_upstream("b")]
        pool = {
            "name": "vllm",
            "routing": "kv_events",
            "scrape_interval": 5,
            "health": {"failures_to_eject": 1000},  # the fake upstreams serve no /metrics
            "replicas": [
                {"url": upstreams[0].url, "kv_events": endpoints["a"], "kv_events_replay": endpoints["a_replay"]},
                {"url": upstreams[1].url, "kv_events": endpoints["b"]},
            ],
            "kv_events": {"source": "vllm", "topic": "kv", "hash_algo": ALGO, "hash_seed_env": "TEST_VLLM_SEED"},
        }
        gw = launcher.gateway({"telemetry": {"replica_header": True}, "pools": [pool]}, env={"TEST_VLLM_SEED": SEED})
        for publisher in publishers:
            publisher.wait_for_subscriber()
        yield gw, Replica(upstreams[0], publishers[0]), Replica(upstreams[1], publishers[1])
    finally:
        for publisher in publishers:
            publisher.close()


@pytest.fixture(scope="module")
def fleet(module_launcher):
    """The module's fleet, for the tests that keep their publishers open: each uses prompts of its own, and a gap it
    makes is numbered from where the publisher stands."""
    with started_fleet(module_launcher) as started:
        yield started


@pytest.fixture
def own_fleet(launcher):
    """A fleet of the test's own, for a test that closes a publisher."""
    with started_fleet(launcher) as started:
        yield started


def complete(gw, ids: list[int]) -> tuple[str, int]:
    """Send a token-id prompt; (the replica it went to, the predicted_cached_tokens the access log records)."""
    response = httpx.post(gw.url + "/v1/completions", timeout=30, json={"model": MODEL, "prompt": ids, "max_tokens": 4})
    assert response.status_code == 200, response.text
    request_id = response.headers["x-request-id"]
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        for line in gw.output().splitlines():
            if request_id in line and '"trace_id"' in line:
                return response.headers["x-portcullis-replica"], json.loads(line)["predicted_cached_tokens"]
        time.sleep(0.05)
    raise AssertionError(f"no access-log line for {request_id}")


def test_stored_blocks_route_there_with_vllms_cached_count_and_removal_drops_them(fleet):
    gw, a, b = fleet
    p1, p2 = prompt(100, 1), prompt(96, 2)  # 96 tokens: all six blocks stored, vLLM still recomputes the last
    stored_b, stored_a = b.store(p1), a.store(p2)
    time.sleep(SETTLE)
    assert complete(gw, p1) == (b.url, reported_cached_tokens(stored_b, len(p1), BLOCK)) == (b.url, 96)
    assert complete(gw, p2) == (a.url, reported_cached_tokens(stored_a, len(p2), BLOCK)) == (a.url, 80)

    b.remove(p1)
    a.publisher.publish(all_blocks_cleared())
    time.sleep(SETTLE)
    assert complete(gw, p1)[1] == 0
    assert complete(gw, p2)[1] == 0


def test_a_sequence_gap_is_replayed_where_a_replay_socket_exists_and_resets_where_not(fleet):
    gw, a, b = fleet
    p3, p4, p5, p6 = (prompt(70, seed) for seed in (3, 4, 5, 6))
    a.store(p4)
    b.store(p5)
    time.sleep(SETTLE)
    lost = a.publisher.seq
    missed = a.store(p3, lose=True)  # numbered and buffered, never sent: the next batch shows a gap
    a.store(p4)
    b.store(p4, lose=True)
    b.store(p6)
    time.sleep(SETTLE)
    assert complete(gw, p3) == (a.url, reported_cached_tokens(missed, len(p3), BLOCK))  # replayed
    assert lost in a.publisher.replay_requests  # the batch after the last one applied
    assert complete(gw, p5)[1] == 0  # b forgot what it held before the gap
    assert complete(gw, p6) == (b.url, 64)


def test_a_dropped_publisher_forgets_its_replicas_blocks(own_fleet):
    gw, a, b = own_fleet
    p7 = prompt(50, 7)
    b.store(p7)
    time.sleep(SETTLE)
    assert complete(gw, p7) == (b.url, 48)
    b.publisher.close()
    time.sleep(SETTLE)
    assert complete(gw, p7)[1] == 0
