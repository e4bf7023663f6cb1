"""Noticing a client that leaves before its answer starts, so the work done for it (and the upstream call) stops.

An ASGI app learns of a disconnect only by calling `receive()`, which first hands out the request body; the parse
stage reads that body. `ClientWatch` stands between the two: it passes the body on, and once the body is complete
it keeps listening for `http.disconnect`. `unless_client_leaves` runs a request's work in its own task and cancels
it when the client goes first; the cancellation closes the upstream connection (gateway/upstream.py), and the end of
request hooks then free the client's slots. Once a stream's answer has started, Starlette's StreamingResponse
listens for the disconnect itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from starlette.requests import ClientDisconnect
from starlette.types import Message, Receive

T = TypeVar("T")


class ClientWatch:
    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self._body_read = asyncio.Event()

    async def receive(self) -> Message:
        """The ASGI receive channel for the request's own reader (the body, then a disconnect)."""
        message = await self._receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            self._body_read.set()
        return message

    async def _departure(self) -> None:
        await self._body_read.wait()  # never compete with the body's reader for its messages
        while (await self._receive())["type"] != "http.disconnect":
            pass

    async def unless_client_leaves(self, work: Coroutine[Any, Any, T]) -> T:
        """Await `work`; if the client disconnects first, cancel it, let it clean up, and raise ClientDisconnect."""
        task = asyncio.ensure_future(work)
        departure = asyncio.ensure_future(self._departure())
        try:
            await asyncio.wait((task, departure), return_when=asyncio.FIRST_COMPLETED)
        finally:
            departure.cancel()
            if not task.done():
                task.cancel()  # the client left, or this request is being cancelled itself
                await asyncio.wait((task,))  # its cleanup (closing the upstream connection) runs before we go on
        if task.cancelled():
            raise ClientDisconnect()
        return task.result()
