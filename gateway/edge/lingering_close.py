"""Lingering close: an answer sent before the request was read to its end reaches a client that is still sending.

A server that answers early (413 for a body past its limit, 408 at a body or head deadline, 414/431 for a head past
its limits, 400 for bad framing, or any answer given before its body was read) and then closes its socket while the
client's bytes still arrive loses that answer: Linux answers a close() with unread bytes in the receive buffer, and
each segment that arrives after it, with a reset (RST) in place of the FIN. A client still writing its request gets
ECONNRESET or EPIPE on its next send and never reads the answer waiting in its receive buffer, and a reset drops
whatever of the answer the server's kernel had not sent yet. nginx's `lingering_close` exists for this.

So a close that may leave the client's bytes unread lingers instead: the answer is flushed and followed by a FIN
(`write_eof`), and the bytes that still come are read and dropped unparsed until the client ends its side (EOF), or
sends nothing for `LingerBounds.idle`, or `LingerBounds.total` has passed, or it sent `LingerBounds.max_bytes`: a
client that never stops costs bounded time and CPU, then is closed (reset, if it still sends). A close between
requests, with nothing unread (keep-alive timeout, an answer to a request read whole), is a plain close.

`LingeringCloseProtocol` is uvicorn's httptools protocol with this on every close of its connection: its transport is
wrapped, so uvicorn's closes (an answer with `connection: close`, a 400, the keep-alive timeout, shutdown) and a
subclass's own all go through one place. It also ends a connection whose answer went out before its request's body
was read, which uvicorn kept open to read and drop the rest of that body for as long as the client sent it. While it
lingers, the connection is closing to the protocol (nothing more is parsed, written or served, and the requests'
state is let go) but not closed: `connection_lost` comes when the socket closes, so connection counts and uvicorn's
graceful shutdown still see it. The gateway's front door (gateway/edge/http_server.py) and the bundled engine's server
(backend_engine/http/server.py) both serve with it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, ClassVar

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from gateway.edge.one_write import OneWriteCycle


@dataclass(frozen=True)
class LingerBounds:
    """How long, and how much, a lingering connection is read before it is closed (nginx: lingering_time 30 s,
    lingering_timeout 5 s; tighter here: an error answer is small and arrives in a round trip)."""

    total: float = 3.0  # seconds from the answer to the close, however the client goes on
    idle: float = 1.0  # seconds the client may send nothing
    max_bytes: int = 4 << 20  # bytes read and dropped


class LingeringCloseProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol whose closes linger while the client's bytes may still be unread."""

    linger_bounds: ClassVar[LingerBounds] = LingerBounds()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._partial_request = False  # bytes arrived that no complete request accounts for (yet)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(_LingeringTransport(transport, self))

    def data_received(self, data: bytes) -> None:
        self._partial_request = True
        super().data_received(data)

    def on_message_complete(self) -> None:
        self._partial_request = False
        super().on_message_complete()

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        if type(self.cycle) is RequestResponseCycle:  # the request's own cycle (not one a subclass refused with)
            self.cycle.__class__ = _EarlyAnswerCycle

    def on_response_complete(self) -> None:
        """An answer went out before its request's body was read (a 413 for the declared length, a 404, a health
        check sent with a body): uvicorn read on only to drop the body, and each byte put off the keep-alive timeout,
        so a client trickling a body held the connection for ever. The connection ends with the answer instead."""
        # with nothing queued behind it, the request answered is the last one parsed
        if not self.transport.is_closing() and not self.pipeline and self.cycle.more_body:
            self.transport.close()
        super().on_response_complete()

    def lingers_on_close(self) -> bool:
        """Whether a close now lingers: the answer is written whole (a half-written one is no answer to deliver),
        and bytes of the client's may be unread."""
        return (self.cycle is None or self.cycle.response_complete) and self.may_have_unread_bytes()

    def may_have_unread_bytes(self) -> bool:
        """A request not read to its end, or requests queued behind the one answered (reading paused for them)."""
        return self._partial_request or bool(self.pipeline)

    def lingering(self) -> None:
        """The close lingers: no request of this connection is served any more, and what they hold (the body's bytes
        read past the answer, requests queued behind it) is let go now, not when the socket closes."""
        self.cycle = None  # type: ignore[assignment]
        self.pipeline.clear()


class _EarlyAnswerCycle(OneWriteCycle):
    """uvicorn's request cycle (a fixed-length answer in one write: gateway/edge/one_write.py), whose answer says
    `connection: close` when its head goes out before the request's body was read to its end: `on_response_complete`
    ends such a connection, and a client told so opens a new one for its next request instead of sending it into a
    connection that is closing."""

    async def send(self, message: Any) -> None:
        if message["type"] == "http.response.start" and self.more_body:
            self.keep_alive = False
        await super().send(message)


class _LingeringTransport(asyncio.Transport):
    """The protocol's view of its socket: everything passes through, except a close that lingers.

    `write`, `writelines` and `is_closing`, which every answer calls, are the socket's own methods, set on the
    instance (no Python call between uvicorn and the socket), until the close lingers and `_lingering` replaces them.
    """

    __slots__ = ("_transport", "_protocol", "_linger", "write", "writelines", "is_closing")

    def __init__(self, transport: asyncio.Transport, protocol: LingeringCloseProtocol) -> None:
        super().__init__()
        self._transport = transport
        self._protocol = protocol
        self._linger: _Linger | None = None
        self.write = transport.write  # type: ignore[method-assign]
        self.writelines = transport.writelines  # type: ignore[method-assign]
        self.is_closing = transport.is_closing  # type: ignore[method-assign]

    def close(self) -> None:
        if self._linger is not None:
            return  # it closes when the lingering ends
        transport = self._transport
        if (
            not transport.is_closing()
            and transport.get_protocol() is self._protocol  # not handed to another protocol (a WebSocket)
            and transport.can_write_eof()
            and self._protocol.lingers_on_close()
        ):
            self._linger = _Linger(transport, self._protocol)
            self._lingering()
            self._protocol.lingering()
        else:
            transport.close()

    def _lingering(self) -> None:
        """From the answer's FIN on, nothing may be written, and the connection is closing to the protocol."""
        self.write = _written_nowhere  # type: ignore[method-assign]
        self.writelines = _written_nowhere  # type: ignore[method-assign,assignment]
        self.is_closing = _closing  # type: ignore[method-assign]

    def abort(self) -> None:
        self._transport.abort()

    def write_eof(self) -> None:
        if self._linger is None:
            self._transport.write_eof()

    def can_write_eof(self) -> bool:
        return self._transport.can_write_eof()

    def pause_reading(self) -> None:
        if self._linger is None:  # lingering reads on, whatever the protocol asked before
            self._transport.pause_reading()

    def resume_reading(self) -> None:
        if self._linger is None:
            self._transport.resume_reading()

    def is_reading(self) -> bool:
        return self._transport.is_reading()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._transport.set_write_buffer_limits(high, low)

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size()

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._transport.get_write_buffer_limits()

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._transport.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._transport.get_protocol()


def _written_nowhere(data: object) -> None:
    """A write after the answer's FIN: dropped."""


def _closing() -> bool:
    return True


class _Linger(asyncio.Protocol):
    """The socket's protocol from the answer's FIN to its close: it drops what the client still sends, within the
    bounds, and then tells the HTTP protocol its connection is lost. The HTTP protocol parses nothing more."""

    def __init__(self, transport: asyncio.Transport, protocol: LingeringCloseProtocol) -> None:
        self._transport = transport
        self._protocol: LingeringCloseProtocol | None = protocol
        self._loop = protocol.loop
        self._bounds = bounds = protocol.linger_bounds
        self._bytes_left = bounds.max_bytes
        now = self._loop.time()
        self._last_read = now
        self._deadline = now + bounds.total
        transport.set_protocol(self)
        transport.write_eof()  # after the answer still buffered, if any
        transport.resume_reading()  # flow control may have paused it: unread bytes are what resets
        self._timer = self._loop.call_at(min(self._deadline, now + bounds.idle), self._check)

    def data_received(self, data: bytes) -> None:
        self._bytes_left -= len(data)
        if self._bytes_left < 0:
            self._end()
        else:
            self._last_read = self._loop.time()  # the timer reads it when due: no timer moved per read

    def eof_received(self) -> bool:
        self._timer.cancel()
        self._transport.close()  # nothing unread: the answer is flushed, then a clean close
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._timer.cancel()
        protocol, self._protocol = self._protocol, None
        if protocol is not None:
            protocol.connection_lost(exc)

    def _check(self) -> None:
        due = min(self._deadline, self._last_read + self._bounds.idle)
        if self._loop.time() >= due:
            self._end()
        else:
            self._timer = self._loop.call_at(due, self._check)

    def _end(self) -> None:
        """A bound is reached. A client that has not read the answer by now is not reading it: what is still
        buffered of it is dropped, where close() would wait for it without end."""
        self._timer.cancel()
        if self._transport.get_write_buffer_size():
            self._transport.abort()
        else:
            self._transport.close()
