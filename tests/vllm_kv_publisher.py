"""A stand-in for a vLLM replica's KV-event publisher, for tests: vLLM itself cannot run here (no GPU, no vLLM).

Built from vLLM's `vllm/distributed/kv_events.py` (`ZmqEventPublisher`, `KVEventBatch`, `BlockStored`,
`BlockRemoved`, `AllBlocksCleared`; vllm-project/vllm main at commit 0181ea3, and b4e69e0 for the older layout):

- a PUB-compatible socket sends `[topic, seq (8-byte big-endian), payload]` (XPUB here, which is PUB on the wire,
  so a test can wait until the gateway's subscription arrived); numbering starts at 0, as `itertools.count()` does;
- a ROUTER replay socket answers `[identity, b"", start seq]` with `[identity, b"", seq, payload]` for each buffered
  batch from `start`, then `[identity, b"", -1 as 8 signed big-endian bytes, b""]`;
- the payload is laid out as msgspec's msgpack encoder lays out those structs: events as maps tagged by "type"
  (after vllm-project/vllm#42892) or as arrays `[tag, field, ...]` (before it, `array_like=True`), in declaration
  order with default-valued fields omitted (trailing ones only, for arrays); the batch as a map (main) or an array.

Block hashes for a prompt come from `vllm_block_hashes`, a minimal transcription of vLLM's
`vllm/v1/core/kv_cache_utils.py` (`init_none_hash`, `hash_block_tokens`, `maybe_convert_block_hash`) and
`vllm/utils/hashing.py` (`sha256`, `sha256_cbor`), written apart from the gateway's module under test and using
cbor2, the library vLLM uses.
"""

from __future__ import annotations

import hashlib
import pickle
import threading
import time
from collections import deque
from typing import Any

import cbor2
import msgpack
import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def _hash_fn(algo: str):
    if algo == "sha256":
        return lambda value: hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()
    if algo == "sha256_cbor":
        return lambda value: hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()
    raise ValueError(algo)


def vllm_block_hashes(
    token_ids: list[int], block_size: int, algo: str, seed: str, cache_salt: str | None = None
) -> list[bytes]:
    """vLLM's full-block digests of a prompt, with PYTHONHASHSEED=seed."""
    hash_fn = _hash_fn(algo)
    parent = hash_fn(seed)  # NONE_HASH
    out = []
    for start in range(0, len(token_ids) // block_size * block_size, block_size):
        extra = (cache_salt,) if start == 0 and cache_salt else None
        parent = hash_fn((parent, tuple(token_ids[start : start + block_size]), extra))
        out.append(parent)
    return out


def as_int(digest: bytes) -> int:
    """`maybe_convert_block_hash` with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1 (vLLM's default)."""
    return int.from_bytes(digest, byteorder="big") & ((1 << 64) - 1)


def reported_cached_tokens(stored_blocks: int, prompt_tokens: int, block_size: int) -> int:
    """vLLM's `get_computed_blocks`: a hit covers at most prompt_tokens - 1 tokens, in whole blocks."""
    return min(stored_blocks, (prompt_tokens - 1) // block_size) * block_size


class Event:
    """One KV event as msgspec would see the struct: its tag and fields in declaration order, with defaults."""

    def __init__(self, tag: str, fields: list[tuple[str, Any, Any]]) -> None:
        self.tag = tag
        self.fields = fields  # (name, value, default or REQUIRED)

    def encoded(self, as_map: bool) -> Any:
        if as_map:
            out: dict[str, Any] = {"type": self.tag}
            out.update({name: value for name, value, default in self.fields if value != default})
            return out
        kept = list(self.fields)
        while kept and kept[-1][1] == kept[-1][2]:  # array_like + omit_defaults: only trailing defaults go
            kept.pop()
        return [self.tag, *(value for _, value, _ in kept)]


REQUIRED = object()


def block_stored(
    hashes: list[Any], token_ids: list[int], block_size: int, parent: Any = None, medium: str | None = "GPU"
) -> Event:
    blocks = len(hashes)
    return Event(
        "BlockStored",
        [
            ("block_hashes", hashes, REQUIRED),
            ("parent_block_hash", parent, REQUIRED),
            ("token_ids", token_ids[: blocks * block_size], REQUIRED),
            ("block_size", block_size, REQUIRED),
            ("lora_id", None, REQUIRED),
            ("medium", medium, REQUIRED),
            ("lora_name", None, REQUIRED),
            ("extra_keys", [None] * blocks, None),
            ("group_idx", 0, None),
            ("kv_cache_spec_kind", "full_attention", None),
            ("kv_cache_spec_sliding_window", None, None),
        ],
    )


def block_removed(hashes: list[Any], medium: str | None = "GPU") -> Event:
    return Event(
        "BlockRemoved", [("block_hashes", hashes, REQUIRED), ("medium", medium, REQUIRED), ("group_idx", 0, None)]
    )


def all_blocks_cleared() -> Event:
    return Event("AllBlocksCleared", [])


class VllmKvPublisher:
    """Binds `endpoint` (and `replay_endpoint`); `publish` sends one batch, `lose` numbers and buffers one without
    sending it (what a subscriber sees when a message is dropped)."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        events_as_maps: bool = True,
        batch_as_map: bool = True,
        data_parallel_rank: int = 0,
    ) -> None:
        self.context = zmq.Context()
        self.pub = self.context.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(endpoint)
        self.topic = topic.encode()
        self.events_as_maps, self.batch_as_map, self.rank = events_as_maps, batch_as_map, data_parallel_rank
        self.seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=10_000)
        self.replay_requests: list[int] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._replay_thread: threading.Thread | None = None
        if replay_endpoint:
            router = self.context.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.bind(replay_endpoint)
            self._replay_thread = threading.Thread(target=self._serve_replay, args=(router,), daemon=True)
            self._replay_thread.start()

    def payload(self, events: list[Event], ts: float | None = None) -> bytes:
        encoded = [e.encoded(self.events_as_maps) for e in events]
        ts = time.time() if ts is None else ts
        batch: Any = (
            {"ts": ts, "events": encoded, "data_parallel_rank": self.rank}
            if self.batch_as_map
            else [ts, encoded, self.rank]
        )
        return msgpack.packb(batch, use_bin_type=True)

    def wait_for_subscriber(self, timeout: float = 10.0) -> None:
        """Until a subscriber's subscription to this topic arrives (XPUB hands it over)."""
        if not self.pub.poll(int(timeout * 1000)):
            raise TimeoutError("no subscriber")
        message = self.pub.recv()
        assert message[:1] == b"\x01" and message[1:] == self.topic, message

    def publish(self, *events: Event) -> int:
        return self._number(events, send=True)

    def lose(self, *events: Event) -> int:
        return self._number(events, send=False)

    def _number(self, events: tuple[Event, ...], send: bool) -> int:
        payload = self.payload(list(events))
        with self._lock:
            seq = self.seq
            self.seq += 1
            self.buffer.append((seq, payload))
        if send:
            self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    def _serve_replay(self, router: zmq.Socket) -> None:
        try:
            while not self._stop.is_set():
                if not router.poll(50):
                    continue
                frames = router.recv_multipart()
                if len(frames) != 3:
                    continue
                client, _, start_bytes = frames
                start = int.from_bytes(start_bytes, "big")
                self.replay_requests.append(start)
                with self._lock:
                    batches = [(seq, payload) for seq, payload in self.buffer if seq >= start]
                for seq, payload in batches:
                    router.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])
                router.send_multipart([client, b"", END_SEQ, b""])
        finally:
            router.close(linger=0)

    def close(self) -> None:
        if self.context.closed:
            return
        self._stop.set()
        if self._replay_thread is not None:
            self._replay_thread.join(timeout=2)
        self.pub.close(linger=0)
        self.context.term()
