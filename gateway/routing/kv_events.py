"""Follow an engine's KV-event stream (`GET /v1/kv_events`, NDJSON batches) into the prefix index.

The first batch is a snapshot (all cleared, then every cached block); later batches are numbered. A gap in the
numbers, a dropped connection or a malformed line makes the follower forget that replica's blocks and
resubscribe, so the index never believes in blocks the engine may have evicted while nobody was listening.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import aiohttp

from gateway.routing.prefix_index import PrefixIndex
from gateway.routing.replica import Replica

log = logging.getLogger(__name__)

RETRY_SECONDS = 1.0


def apply_batch(index: PrefixIndex, replica: str, batch: dict[str, Any]) -> None:
    for event in batch.get("events", ()):
        kind = event.get("type")
        if kind == "BlockStored":
            index.add(event.get("block_hashes") or (), replica)
        elif kind == "BlockRemoved":
            index.remove(event.get("block_hashes") or (), replica)
        elif kind == "AllBlocksCleared":
            index.clear(replica)


async def follow(session: aiohttp.ClientSession, replica: Replica, index: PrefixIndex) -> None:
    """Runs until cancelled, resubscribing after every break."""
    while True:
        try:
            await _follow_once(session, replica, index)
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError) as exc:
            log.info("kv events from %s interrupted: %s", replica.url, exc)
        index.clear(replica.url)
        await asyncio.sleep(RETRY_SECONDS)


async def _follow_once(session: aiohttp.ClientSession, replica: Replica, index: PrefixIndex) -> None:
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=2.0, sock_read=30.0)  # heartbeats every 5 s
    async with session.get(
        replica.url + "/v1/kv_events", params={"heartbeat": 5}, timeout=timeout, raise_for_status=True
    ) as response:
        last: int | None = None
        async for line in response.content:
            if not line.strip():
                continue
            batch = json.loads(line)
            seq = batch["seq"]
            if batch.get("snapshot"):
                index.clear(replica.url)
            elif batch.get("heartbeat"):
                if last is not None and seq != last:
                    raise ValueError(f"missed batches {last + 1}..{seq}")
                continue
            elif last is not None and seq != last + 1:
                raise ValueError(f"expected batch {last + 1}, got {seq}")
            apply_batch(index, replica.url, batch)
            last = seq
