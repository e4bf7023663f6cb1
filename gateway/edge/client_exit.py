"""Noticing a client that leaves before its answer starts, so the work done for it (and the upstream call) stops.

An ASGI app hears of a disconnect only by calling `receive()` again after the body, which takes a watcher task per
request: that task cost a tenth of the proxy's throughput. The server already knows, for free: its protocol sees the
connection go (gateway/edge/http_server.py). So `unless_client_leaves` leaves a callback in the request's scope
(`CLIENT_GONE` under `extensions`), the protocol calls it when the connection is lost before the response is
complete, and the callback cancels the request's task; that cancellation, and no other, becomes ClientDisconnect.
It closes the upstream connection (gateway/relay/upstream.py), and the end-of-request hooks then free the client's
slots.

Once the answer has started, the same callback marks the client gone and `sending`'s writes raise ClientDisconnect:
the server drops writes to a lost connection without a word, and a stream would otherwise go on reading its
upstream's answer into the void as fast as the upstream sent it (Starlette's own disconnect listener only cancels at
the stream's next wait, which a fast upstream may never make it take).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import ClientDisconnect
from starlette.types import Message, Scope, Send

T = TypeVar("T")

CLIENT_GONE = "portcullis.client_gone"  # scope["extensions"] key: called by the server when the client is gone


class ClientWatch:
    def __init__(self, scope: Scope) -> None:
        self._scope = scope
        self._left = False

    async def unless_client_leaves(self, work: Awaitable[T]) -> T:
        """Await `work` in this task; if the client disconnects first, cancel it (it cleans up as it unwinds) and
        raise ClientDisconnect."""
        task = asyncio.current_task()
        assert task is not None

        def gone() -> None:
            self._left = True
            task.cancel()

        extensions = self._scope.setdefault("extensions", {})
        extensions[CLIENT_GONE] = gone
        try:
            return await work
        except asyncio.CancelledError:
            if not self._left:
                raise  # the server's own cancellation (shutdown): not ours to turn into anything else
            task.uncancel()
            raise ClientDisconnect() from None
        finally:
            extensions.pop(CLIENT_GONE, None)

    def sending(self, send: Send) -> Send:
        """`send`, raising ClientDisconnect once the client is gone (module docstring)."""

        def gone() -> None:
            self._left = True

        self._scope.setdefault("extensions", {})[CLIENT_GONE] = gone

        async def send_while_connected(message: Message) -> None:
            if self._left:
                raise ClientDisconnect()
            await send(message)
            if self._left:  # the write waited for a client that was then dropped (http_server.py's send_timeout)
                raise ClientDisconnect()

        return send_while_connected
