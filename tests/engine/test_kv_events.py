"""The KV-event bus as a router meets it: batches published from the engine's thread, read on an event loop."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from backend_engine.kv_events import KVEventBus


def _stored(h: int) -> list[dict[str, Any]]:
    return [
        {"type": "BlockStored", "block_hashes": [h], "parent_block_hash": None, "token_ids": None, "block_size": 16}
    ]


async def _read_after(bus: KVEventBus, published: int) -> list[dict[str, Any]]:
    """Subscribe, let the engine's thread publish `published` batches unread, then read up to the first heartbeat."""
    batches = bus.batches(heartbeat=0.2)
    snapshot = await anext(batches)
    engine = threading.Thread(target=lambda: [bus.publish(_stored(h)) for h in range(published)])
    engine.start()
    engine.join()
    await asyncio.sleep(0.05)  # the offers the thread scheduled run on this loop
    seen = [snapshot]
    async for batch in batches:
        seen.append(batch)
        if batch.get("heartbeat"):
            break
    await batches.aclose()
    return seen


def test_a_heartbeat_reveals_batches_dropped_for_a_reader_too_far_behind():
    seen = asyncio.run(_read_after(KVEventBus(block_size=16, max_queue=2), published=5))
    *live, heartbeat = seen[1:]
    assert [b["seq"] for b in live] == [1, 2]  # the queue held two; 3..5 were dropped
    assert heartbeat["seq"] == 5  # a follower that saw 2 sees the gap and resubscribes, though nothing follows


def test_a_heartbeat_after_every_batch_arrived_numbers_the_last_one():
    seen = asyncio.run(_read_after(KVEventBus(block_size=16), published=5))
    assert [b["seq"] for b in seen[1:]] == [1, 2, 3, 4, 5, 5]  # no false gap: a follower keeps its index


def test_a_reader_that_leaves_is_unsubscribed():
    bus = KVEventBus(block_size=16)
    asyncio.run(_read_after(bus, published=1))
    assert not bus._subs  # a publish after it offers to no dead loop


def test_a_batch_offered_as_the_heartbeat_wait_ends_is_sent_not_claimed_by_a_heartbeat():
    """The engine thread's offer can land in the loop iteration whose timer ends the heartbeat wait: the batch is
    then queued, not yet sent, and a heartbeat numbered with it would tell the follower it was lost (it resubscribes
    and forgets the replica's blocks for nothing)."""

    async def read() -> list[dict[str, Any]]:
        bus = KVEventBus(block_size=16)
        loop = asyncio.get_running_loop()
        batches = bus.batches(heartbeat=0.5)
        await anext(batches)  # the snapshot
        waiting = asyncio.ensure_future(anext(batches))
        await asyncio.sleep(0)  # the wait's timer is set
        [sub] = bus._subs
        batch = {"seq": 1, "ts": 0.0, "events": _stored(1)}
        loop.call_at(loop.time() + 0.5001, bus._offer, sub, batch)  # as the engine thread's call_soon_threadsafe
        first = await waiting
        second = await anext(batches)
        await batches.aclose()
        return [first, second]

    first, second = asyncio.run(read())
    assert first["seq"] == 1 and not first.get("heartbeat"), "a heartbeat claimed the batch before it was sent"
    assert second["seq"] == 1 and second.get("heartbeat")
