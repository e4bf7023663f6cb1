"""vLLM's block hashing as the gateway reproduces it, against an independent transcription of vLLM's code
(tests/vllm_kv_publisher.py, using pickle and cbor2 as vLLM does), hand-built CBOR, and vLLM's cached-token rule;
decoding of vLLM's event batches in both wire layouts; the pool settings that turn it on."""

from __future__ import annotations

import hashlib
import random

import msgpack
import pytest
import yaml

from gateway.config import ConfigError, GatewayConfig, load_config
from gateway.routing.pool import Pool
from gateway.routing.vllm_block_hash import VllmBlockHasher, event_key, reported_cached_tokens
from gateway.routing.vllm_events import decode_batch, rank_endpoint
from tests.vllm_kv_publisher import (
    VllmKvPublisher,
    all_blocks_cleared,
    as_int,
    block_removed,
    block_stored,
    vllm_block_hashes,
)

TOKENS = [random.Random(7).randrange(0, 150_000) for _ in range(16 * 5 + 9)]


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
@pytest.mark.parametrize("salt", [None, "tenant-a"])
@pytest.mark.parametrize("block_size", [16, 4])
def test_block_hashes_match_a_transcription_of_vllm(algo, salt, block_size):
    ours = VllmBlockHasher(algo, "1234", block_size).block_hashes(TOKENS, salt)
    theirs = vllm_block_hashes(TOKENS, block_size, algo, "1234", salt)
    assert ours == theirs and len(ours) == len(TOKENS) // block_size
    assert all(len(h) == 32 for h in ours)


def test_sha256_cbor_known_answer_built_by_hand():
    """Canonical CBOR of (parent, (tokens...), extra_keys), written out byte by byte, not by any CBOR library."""
    none_hash = hashlib.sha256(b"\x62" + b"42").digest()  # text string "42"
    tokens = [1, 100, 1000, 70000]
    token_bytes = b"\x84" + b"\x01" + b"\x18\x64" + b"\x19\x03\xe8" + b"\x1a\x00\x01\x11\x70"
    first_salted = hashlib.sha256(b"\x83\x58\x20" + none_hash + token_bytes + b"\x81\x64salt").digest()
    first_plain = hashlib.sha256(b"\x83\x58\x20" + none_hash + token_bytes + b"\xf6").digest()
    second = hashlib.sha256(b"\x83\x58\x20" + first_salted + token_bytes + b"\xf6").digest()  # salt: first block only
    hasher = VllmBlockHasher("sha256_cbor", "42", 4)
    assert hasher.block_hashes(tokens * 2, "salt") == [first_salted, second]
    assert hasher.block_hashes(tokens, None) == [first_plain]


def test_the_seed_and_the_salt_change_every_block():
    base = VllmBlockHasher("sha256", "1", 16).prompt_keys(TOKENS)
    assert set(base).isdisjoint(VllmBlockHasher("sha256", "2", 16).prompt_keys(TOKENS))
    assert set(base).isdisjoint(VllmBlockHasher("sha256", "1", 16).prompt_keys(TOKENS, "s"))
    assert VllmBlockHasher("sha256", "1", 16).prompt_keys(TOKENS[:40]) == base[:2]  # a prefix's keys are a prefix


def test_event_keys_are_vllms_int_form_whichever_form_the_event_carries():
    digest = vllm_block_hashes(TOKENS, 16, "sha256", "9")[0]
    assert event_key(digest) == as_int(digest) == event_key(as_int(digest))
    assert VllmBlockHasher("sha256", "9", 16).prompt_keys(TOKENS)[0] == as_int(digest)


@pytest.mark.parametrize(
    ("blocks", "prompt", "reported"),
    [(6, 100, 96), (6, 96, 80), (5, 96, 80), (3, 100, 48), (0, 100, 0), (1, 16, 0), (1, 17, 16), (2, 0, 0)],
)
def test_cached_tokens_follow_vllms_prompt_minus_one_rule(blocks, prompt, reported):
    assert reported_cached_tokens(blocks, prompt, 16) == reported


@pytest.mark.parametrize(("events_as_maps", "batch_as_map"), [(True, True), (True, False), (False, False)])
def test_batches_decode_in_every_vllm_layout(events_as_maps, batch_as_map):
    digests = vllm_block_hashes(TOKENS, 16, "sha256", "0")
    publisher = VllmKvPublisher("inproc://layout", events_as_maps=events_as_maps, batch_as_map=batch_as_map)
    try:
        payload = publisher.payload(
            [
                block_stored([as_int(d) for d in digests[:2]], TOKENS, 16),
                block_stored(digests[2:4], TOKENS[32:], 16, parent=as_int(digests[1])),  # digests as bytes
                block_stored([as_int(digests[4])], TOKENS[64:], 16, medium="CPU"),  # offloaded: not a GPU hit
                block_removed([as_int(digests[0])]),
                all_blocks_cleared(),
            ]
        )
    finally:
        publisher.close()
    batch = decode_batch(payload)
    keys = [as_int(d) for d in digests]
    assert batch.events == [
        {"type": "BlockStored", "block_hashes": keys[:2]},
        {"type": "BlockStored", "block_hashes": keys[2:4]},
        {"type": "BlockRemoved", "block_hashes": keys[:1]},
        {"type": "AllBlocksCleared", "block_hashes": []},
    ]
    assert batch.data_parallel_rank == 0


@pytest.mark.parametrize(
    "payload",
    [b"\xc1", msgpack.packb(5), msgpack.packb([1.0, [["Unknown", [1]]]]), msgpack.packb({"events": [{"x": 1}]})],
)
def test_malformed_batches_are_refused(payload):
    with pytest.raises(ValueError):
        decode_batch(payload)


def test_other_kv_cache_groups_are_not_prefix_hits():
    event = {"type": "BlockStored", "block_hashes": [5], "medium": "GPU", "group_idx": 1}
    assert decode_batch(msgpack.packb({"ts": 0.0, "events": [event]})).events == []


def test_data_parallel_ranks_publish_on_vllms_offset_endpoints():
    assert rank_endpoint("tcp://10.0.0.1:5557", 0) == "tcp://10.0.0.1:5557"
    assert rank_endpoint("tcp://10.0.0.1:5557", 3) == "tcp://10.0.0.1:5560"
    assert rank_endpoint("inproc://kv", 2) == "inproc://kv_dp2"
    with pytest.raises(ValueError):
        rank_endpoint("ipc:///tmp/kv", 1)


def _vllm_pool(replicas: list[dict], **events) -> dict:
    kv_events = {"source": "vllm", "hash_seed_env": "TEST_VLLM_SEED", **events}
    return {"name": "vllm", "routing": "kv_events", "replicas": replicas, "kv_events": kv_events}


def _config_error(data: dict, tmp_path) -> str:
    path = tmp_path / "portcullis.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    return str(info.value)


def test_a_vllm_source_without_endpoints_names_the_key_path(tmp_path):
    replicas = [{"url": "http://a:8000", "kv_events": "tcp://a:5557"}, {"url": "http://b:8000"}]
    message = _config_error({"pools": [_vllm_pool(replicas)]}, tmp_path)
    assert "pools[0]" in message and "replicas[1].kv_events" in message and "replicas[0]" not in message


def test_vllm_source_settings_are_checked(tmp_path):
    ok = [{"url": "http://a:8000", "kv_events": "tcp://a:5557"}]
    assert "hash_seed_env" in _config_error({"pools": [_vllm_pool(ok, hash_seed_env=None)]}, tmp_path)
    assert "routing: kv_events" in _config_error({"pools": [{**_vllm_pool(ok), "routing": "least_load"}]}, tmp_path)
    bad = [{"url": "http://a:8000", "kv_events": "a:5557"}]
    assert "pools[0].replicas[0].kv_events" in _config_error({"pools": [_vllm_pool(bad)]}, tmp_path)
    orphan = [{"url": "http://a:8000", "kv_events_replay": "tcp://a:5558"}]
    assert "kv_events_replay" in _config_error({"pools": [{"name": "p", "replicas": orphan}]}, tmp_path)


def test_the_hash_seed_comes_from_the_environment(monkeypatch):
    replicas = [{"url": "http://a:8000", "kv_events": "tcp://a:5557", "kv_events_replay": "tcp://a:5558"}]
    config = GatewayConfig.model_validate({"pools": [_vllm_pool(replicas, hash_algo="sha256_cbor")]}).pools[0]
    monkeypatch.delenv("TEST_VLLM_SEED", raising=False)
    with pytest.raises(ConfigError, match="TEST_VLLM_SEED is not set"):
        Pool(config)
    monkeypatch.setenv("TEST_VLLM_SEED", "77")
    pool = Pool(config)
    shape = pool.request_shape(len(TOKENS), 10, TOKENS)
    assert shape.block_hashes == [as_int(d) for d in vllm_block_hashes(TOKENS, 16, "sha256_cbor", "77")]
    assert pool.predicted_cached_tokens(5, len(TOKENS)) == 80
    assert [(s.endpoint, s.replay) for s in pool.vllm_subscriptions] == [("tcp://a:5557", "tcp://a:5558")]


def test_engine_pools_keep_the_engines_hashing_and_count():
    from backend_engine.block_hash import hash_prompt_blocks

    config = GatewayConfig.model_validate(
        {"pools": [{"name": "e", "routing": "kv_events", "replicas": [{"url": "http://a:1"}]}]}
    )
    pool = Pool(config.pools[0])
    assert pool.request_shape(len(TOKENS), 1, TOKENS).block_hashes == hash_prompt_blocks(TOKENS, 16)
    assert pool.predicted_cached_tokens(5, 80) == 80 and pool.vllm_subscriptions == []
