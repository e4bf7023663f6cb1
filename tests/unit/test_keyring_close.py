"""A key ring closes while its poll is inside a store call, even where the store's client turns the cancellation into
an error of its own (redis-py may answer a cancelled command with a connection error): the poller would otherwise
take it for a failed poll and go on polling, and closing would wait for it for ever."""

from __future__ import annotations

import asyncio

from gateway.config import AuthConfig, StoreConfig
from gateway.keystore.changes import Changes
from gateway.keystore.keyring import KeyRing
from gateway.keystore.records import KeyRecord
from gateway.observability.telemetry import Metrics


class CancelSwallowingStore:
    """A key store whose reads after the first hang until cancelled, and whose first cancelled read raises a
    connection error instead (a fake: the behaviour of a client library, not of a store); later ones are cancelled."""

    name = "fake"

    def __init__(self) -> None:
        self.reads = 0
        self.swallowed = False

    async def changes(self, since: int) -> Changes:
        self.reads += 1
        if self.reads > 1:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                if self.swallowed:
                    raise
                self.swallowed = True
                raise ConnectionError("connection closed by the client") from None
        return Changes("epoch", 0, [])

    async def put(self, record: KeyRecord) -> None:
        raise NotImplementedError

    async def get(self, key_id: str) -> KeyRecord | None:
        return None

    async def records(self, tenant: str | None = None) -> list[KeyRecord]:
        return []

    async def aclose(self) -> None:
        pass


def test_a_ring_closes_while_its_poll_waits_on_a_store_that_swallows_the_cancellation() -> None:
    store = CancelSwallowingStore()

    async def scenario() -> None:
        ring = KeyRing(AuthConfig(), store, StoreConfig(poll_interval=0.01), Metrics().key_store_synced)
        await ring.start()
        while store.reads < 2:  # the poll is inside its store call
            await asyncio.sleep(0.01)
        closing = asyncio.create_task(ring.aclose())
        await asyncio.wait([closing], timeout=2.0)  # not wait_for: closing suppresses the cancellation it would send
        assert closing.done(), "closing waits for a poller that went on polling"
        assert store.swallowed

    asyncio.run(scenario())
