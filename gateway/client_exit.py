"""Noticing a client that leaves before its answer starts, so the work done for it (and the upstream call) stops.

An ASGI app learns of a disconnect only by calling `receive()`, which first hands out the request body; the parse
stage reads that body. `ClientWatch` stands between the two: it passes the body on, and once the body is complete
it keeps listening for `http.disconnect`, in a watcher task that cancels the request's own task when the client
goes first; `unless_client_leaves` turns that cancellation into ClientDisconnect. The cancellation closes the
upstream connection (gateway/upstream.py), and the end-of-request hooks then free the client's slots. Once a stream's answer has started, Starlette's StreamingResponse
listens for the disconnect itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

from starlette.requests import ClientDisconnect
from starlette.types import Message, Receive

T = TypeVar("T")


class ClientWatch:
    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self._body_read = asyncio.Event()
        self._left = False

    async def receive(self) -> Message:
        """The ASGI receive channel for the request's own reader (the body, then a disconnect)."""
        message = await self._receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            self._body_read.set()
        return message

    async def _cancel_on_departure(self, task: asyncio.Task[Any]) -> None:
        await self._body_read.wait()  # never compete with the body's reader for its messages
        while (await self._receive())["type"] != "http.disconnect":
            pass
        self._left = True
        task.cancel()

    async def unless_client_leaves(self, work: Awaitable[T]) -> T:
        """Await `work` in this task; if the client disconnects first, cancel it (it cleans up as it unwinds) and
        raise ClientDisconnect. One watcher task a request, no second task for the work: this runs on every call."""
        task = asyncio.current_task()
        assert task is not None
        watcher = asyncio.get_running_loop().create_task(self._cancel_on_departure(task))
        try:
            return await work
        except asyncio.CancelledError:
            if not self._left:
                raise  # the server's own cancellation (shutdown): not ours to turn into anything else
            task.uncancel()
            raise ClientDisconnect() from None
        finally:
            watcher.cancel()
