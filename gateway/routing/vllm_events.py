"""Follow vLLM replicas' KV-event publishers (ZMQ) into the prefix index, for pools with `kv_events.source: vllm`.

Wire format, from vLLM's `vllm/distributed/kv_events.py` (`ZmqEventPublisher`, `KVEventBatch`, `BlockStored`,
`BlockRemoved`, `AllBlocksCleared`; vllm-project/vllm main as of commit 0181ea3, and the older layout at b4e69e0):

- PUB socket, multipart messages `[topic, seq (8-byte big-endian), msgpack payload]`; the SUB side filters by topic.
- The payload is a msgspec-encoded `KVEventBatch` (ts, events, data_parallel_rank). Releases before
  vllm-project/vllm#42892 encode every struct `array_like` (events are `[tag, field, ...]` in declaration order,
  trailing defaults omitted); since then events are maps tagged by `"type"` (and on main the batch is a map too).
  All of these are read; unknown fields are ignored.
- Block hashes are 64-bit ints (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1, vLLM's default) or raw digests: both are
  keyed by `vllm_block_hash.event_key`. Only events for the GPU prefix cache count (`medium` GPU or absent,
  `group_idx` 0 or absent): blocks offloaded elsewhere or held by other KV-cache groups are not a prefix hit here.
- The optional ROUTER replay socket answers `[b"", start seq]` (from a DEALER) with `[b"", seq, payload]` for every
  buffered batch from `start` on, then `[b"", -1 (signed, 8 bytes), b""]`.

Sequence rules, as the engine follower's: a gap asks the replay socket for the missing batches when one is
configured; otherwise (or when the replay buffer no longer reaches back far enough) the replica's blocks are
forgotten and following resumes at the batch in hand. A sequence number that goes backwards is a restarted
publisher: forget and resume. A dropped publisher (ZMQ reports the disconnect) forgets the replica's blocks; when it
is back and a replay socket is configured, the replay buffer (vLLM keeps the last `buffer_steps` batches) rebuilds
what it can, the nearest thing to a snapshot vLLM offers. Data-parallel ranks publish on separate sockets
(vLLM adds the rank to the port); each rank is followed on its own, and any rank's reset forgets the whole replica.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack  # type: ignore[import-untyped]  # no stubs or py.typed
import zmq
import zmq.asyncio

from gateway.routing.kv_events import apply_batch
from gateway.routing.prefix_index import PrefixIndex
from gateway.routing.vllm_block_hash import event_key

log = logging.getLogger(__name__)

RETRY_SECONDS = 1.0
REPLAY_TIMEOUT = 2.0
MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # one batch; a larger one is refused by ZMQ itself
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_GPU = (None, "GPU")
# positions after the tag in array-encoded events (vLLM's field declaration order)
_ARRAY_FIELDS = {
    "BlockStored": {"block_hashes": 1, "medium": 6, "group_idx": 9},
    "BlockRemoved": {"block_hashes": 1, "medium": 2, "group_idx": 3},
    "AllBlocksCleared": {},
}


@dataclass(slots=True)
class Batch:
    """A decoded KVEventBatch in the engine follower's shape (`kv_events.apply_batch`)."""

    events: list[dict[str, Any]] = field(default_factory=list)
    data_parallel_rank: int | None = None


def rank_endpoint(endpoint: str, rank: int) -> str:
    """The endpoint data-parallel rank `rank` uses, by vLLM's `offset_endpoint_port` rule."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return f"{base}:{int(port) + rank}"
    raise ValueError(f"{endpoint}: vLLM offsets only tcp:// and inproc:// endpoints by data-parallel rank")


def decode_batch(payload: bytes) -> Batch:
    """One KVEventBatch payload, array- or map-encoded; raises ValueError if it is neither."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (msgpack.UnpackException, ValueError) as exc:
        raise ValueError(f"undecodable batch: {exc}") from None
    if isinstance(raw, dict):
        events, rank = raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, list) and len(raw) >= 2:
        events, rank = raw[1], (raw[2] if len(raw) > 2 else None)
    else:
        raise ValueError("a batch is [ts, events, rank?] or {ts, events, data_parallel_rank}")
    if not isinstance(events, list):
        raise ValueError("a batch's events are a list")
    batch = Batch(data_parallel_rank=rank if isinstance(rank, int) else None)
    for event in events:
        kind, fields = _event_fields(event)
        if fields.get("medium") not in _GPU or fields.get("group_idx") not in (None, 0):
            continue
        hashes = fields.get("block_hashes") or []
        if not isinstance(hashes, list) or not all(isinstance(h, int | bytes) for h in hashes):
            raise ValueError(f"{kind}: block_hashes are ints or bytes")
        batch.events.append({"type": kind, "block_hashes": [event_key(h) for h in hashes]})
    return batch


def _event_fields(event: Any) -> tuple[str, dict[str, Any]]:
    if isinstance(event, dict):
        kind = event.get("type")
        if kind in _ARRAY_FIELDS:
            return kind, event
    elif isinstance(event, list) and event and event[0] in _ARRAY_FIELDS:
        kind = event[0]
        return kind, {name: event[i] for name, i in _ARRAY_FIELDS[kind].items() if i < len(event)}
    raise ValueError(f"not a KV event: {str(event)[:80]}")


@dataclass(slots=True)
class Subscription:
    """One publisher of one replica: its PUB endpoint and, optionally, its replay ROUTER endpoint."""

    replica: str  # the replica's url, the index's name for it
    endpoint: str
    replay: str | None
    topic: str


async def follow(sub: Subscription, index: PrefixIndex) -> None:
    """Runs until cancelled, resubscribing after every break."""
    context = zmq.asyncio.Context.instance()
    while True:
        try:
            await _Follower(sub, index, context).run()
        except (zmq.ZMQError, ValueError) as exc:
            log.info("kv events from %s (%s) interrupted: %s", sub.replica, sub.endpoint, exc)
        index.clear(sub.replica)
        await asyncio.sleep(RETRY_SECONDS)


class _Follower:
    def __init__(self, sub: Subscription, index: PrefixIndex, context: zmq.asyncio.Context) -> None:
        self.sub, self.index, self.context = sub, index, context
        self.topic = sub.topic.encode()
        self.last: int | None = None  # the last batch applied; None: nothing since the replica's blocks were forgotten

    async def run(self) -> None:
        socket = self.context.socket(zmq.SUB)
        socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        socket.setsockopt(zmq.LINGER, 0)
        monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            socket.setsockopt(zmq.SUBSCRIBE, self.topic)
            socket.connect(self.sub.endpoint)
            poller = zmq.asyncio.Poller()
            poller.register(socket, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
            while True:
                ready = dict(await poller.poll())
                if monitor in ready:
                    await monitor.recv_multipart()  # only disconnects are monitored
                    log.info("kv event publisher %s dropped", self.sub.endpoint)
                    self._forget()
                if socket in ready:
                    await self._receive(await socket.recv_multipart())
        finally:
            socket.disable_monitor()
            monitor.close(linger=0)
            socket.close(linger=0)

    async def _receive(self, frames: Sequence[bytes]) -> None:
        if len(frames) != 3 or frames[0] != self.topic or len(frames[1]) != 8:
            return  # another topic sharing the prefix, or not a vLLM message
        seq = int.from_bytes(frames[1], "big")
        if self.last is not None and seq <= self.last:
            if seq == self.last:
                return  # a duplicate
            self._forget()  # the counter went back: a new publisher process
        if self.last is None and self.sub.replay:
            await self._catch_up(0, seq, frames[2])
        elif self.last is not None and seq > self.last + 1:
            if self.sub.replay:
                await self._catch_up(self.last + 1, seq, frames[2])
            else:
                log.info("kv events from %s: missed batches %d..%d", self.sub.endpoint, self.last + 1, seq - 1)
                self._forget()
                self._apply(seq, frames[2])
        else:
            self._apply(seq, frames[2])

    async def _catch_up(self, start: int, seq: int, payload: bytes) -> None:
        """Replay from `start` (live batch `seq` in hand); forget first when the buffer does not reach `start`."""
        batches = await self._replay(start)
        if start and (not batches or batches[0][0] != start):
            log.info("kv events from %s: replay does not reach back to batch %d", self.sub.endpoint, start)
            self._forget()
        for replayed, replayed_payload in batches:
            if self.last is None or replayed > self.last:
                self._apply(replayed, replayed_payload)
        if self.last is None or seq > self.last:
            self._apply(seq, payload)

    async def _replay(self, start: int) -> list[tuple[int, bytes]]:
        dealer = self.context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        dealer.setsockopt(zmq.LINGER, 0)
        batches: list[tuple[int, bytes]] = []
        try:
            dealer.connect(self.sub.replay or "")
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                frames = await asyncio.wait_for(dealer.recv_multipart(), REPLAY_TIMEOUT)
                if len(frames) != 3 or len(frames[1]) != 8:
                    raise ValueError("malformed replay message")
                if frames[1] == END_SEQ:
                    return batches
                batches.append((int.from_bytes(frames[1], "big"), frames[2]))
        except TimeoutError:
            log.info("kv event replay %s did not answer in %ss", self.sub.replay, REPLAY_TIMEOUT)
            return []
        finally:
            dealer.close(linger=0)

    def _apply(self, seq: int, payload: bytes) -> None:
        """Apply batch `seq`; a malformed one raises ValueError (the replica is then forgotten and resubscribed)."""
        batch = decode_batch(payload)
        apply_batch(self.index, self.sub.replica, {"events": batch.events})
        self.last = seq

    def _forget(self) -> None:
        self.index.clear(self.sub.replica)
        self.last = None
