"""The HTTP/1.1 front door: uvicorn's httptools (llhttp) server, with the bounds an edge needs enforced as bytes arrive.

uvicorn's httptools protocol grows the request target and each header by concatenation, with no limit on either and
no deadline for a request head: one 256 MB header line cost 107 s of event loop, and a client trickling a byte now
and then held its connection forever. `BoundedProtocol` counts the head's bytes while they arrive and answers before
the parser holds more than the limits: 414 past `limits.max_url_bytes`, 431 past `limits.max_header_bytes`, 408
when the head is not complete within `limits.header_timeout` of the connection's first byte. A listener keeps at
most its `max_connections` open; one more gets 503 and is closed at once. One client address keeps at most
`limits.max_connections_per_client` of them (a trusted proxy's address, which carries many clients, is not
capped); one more gets 429, so a single client reconnecting as fast as connections are cut cannot hold them all.
Every answer is OpenAI-shaped and closes the connection. Parsing stays with llhttp: nothing here reads HTTP syntax.
A close that may leave the client's bytes unread (the answer came before the request's end) lingers, bounded, so
the client reads the answer instead of a reset (gateway/edge/lingering_close.py); until it really closes, a lingering
connection counts toward the caps. What llhttp parses but the gateway refuses: a Transfer-Encoding in an HTTP/1.0
request (400, closed: RFC 9112 has a server treat its framing as faulty), and an upgrade request with a body.

The other direction: a client that stops reading its answer parks the response's writes on flow control (uvicorn
waits for the transport to drain), where no timeout reaches, and the request kept its concurrency slot, its upstream
stream and the replica's KV for as long as the client liked. A connection whose writes stay paused for
`limits.send_timeout` is aborted; the request then ends as if the client had left (gateway/edge/client_exit.py).

`serve` binds the public listener and the admin listener (gateway/app.py routes each connection by the port it
arrived on) and runs one uvicorn server over both; with `listen.workers` above 1 each worker process runs one
(gateway/ops/workers.py), the admin listener only in worker 0. No WebSocket is served: an upgrade request stays HTTP, in
this protocol and its bounds. uvicorn's own proxy-header rewriting is off: the client's address is the socket peer,
and only gateway/edge/client_ip.py decides whether an X-Forwarded-For is believed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections import Counter
from collections.abc import Callable, Iterator
from ipaddress import IPv4Network, IPv6Network, ip_address
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import STATUS_LINE

from gateway.config import GatewayConfig, LimitsConfig
from gateway.edge.client_exit import CLIENT_GONE
from gateway.edge.lingering_close import LingeringCloseProtocol
from gateway.observability import log_writer

log = logging.getLogger(__name__)

BACKLOG = 2048
_HEADER_FRAMING = 4  # ": " and CRLF around each header line


class BoundedProtocol(LingeringCloseProtocol):
    """uvicorn's httptools protocol with the request head bounded in bytes and time, and connections per listener."""

    limits: LimitsConfig
    listener_caps: dict[int, int]  # local port -> most open connections
    open_connections: Counter[int]  # local port -> open now (one Counter per server: see protocol_class)
    uncapped_peers: list[IPv4Network | IPv6Network]  # trusted proxies: one address, many clients
    open_per_client: Counter[tuple[int, str]]  # (local port, peer address) -> open now

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._port: int | None = None  # the listener this connection arrived on; None: refused
        self._client_key: tuple[int, str] | None = None  # its count in open_per_client; None: not capped
        self._in_head = False
        self._head_fed = 0  # bytes received while the current head was incomplete
        self._url_bytes = 0
        self._refused = False
        self._read_no_more = False  # bytes that arrive are dropped unread: the connection ends after the answer
        self._head_started = 0.0  # loop time of the current head's first byte
        self._head_timer: asyncio.TimerHandle | None = None
        self._send_timer: asyncio.TimerHandle | None = None  # armed while the client is not reading

    # connections

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        sockname = transport.get_extra_info("sockname")
        port = sockname[1] if isinstance(sockname, tuple) else 0
        cap = self.listener_caps.get(port, self.limits.max_connections)
        if self.open_connections[port] >= cap:
            self.transport = transport
            self._refuse(
                503,
                "the gateway has too many open connections; retry shortly",
                "too_many_connections",
                extra_headers=(b"retry-after: 1\r\n",),
            )
            return
        client = self._capped_client(transport, port)
        if client is not None and self.open_per_client[client] >= self.limits.max_connections_per_client:
            self.transport = transport
            self._refuse(
                429,
                "too many open connections from this client; close some before opening more",
                "too_many_client_connections",
                extra_headers=(b"retry-after: 1\r\n",),
            )
            return
        if client is not None:
            self._client_key = client
            self.open_per_client[client] += 1
        self._port = port
        self.open_connections[port] += 1
        super().connection_made(transport)
        self._head_started = self.loop.time()  # a connection that never sends a byte gets the same deadline
        self._arm_head_timer()

    def _capped_client(self, transport: asyncio.Transport, port: int) -> tuple[int, str] | None:
        """The key this connection counts under per client address; None for a trusted proxy or a peer with no
        address (a Unix socket)."""
        peer = transport.get_extra_info("peername")
        if not isinstance(peer, tuple):
            return None
        try:
            address = ip_address(peer[0])
        except ValueError:
            return None
        if any(address in network for network in self.uncapped_peers):
            return None
        return port, peer[0]

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        self._cancel_send_timer()
        if self._client_key is not None:
            self.open_per_client[self._client_key] -= 1
            if not self.open_per_client[self._client_key]:
                del self.open_per_client[self._client_key]  # a client that left takes no memory with it
        if self._port is None:
            return
        self.open_connections[self._port] -= 1
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:  # the app asked to hear of it
            # (gateway/edge/client_exit.py)
            extensions: dict[str, Any] = cycle.scope.get("extensions") or {}
            client_gone = extensions.get(CLIENT_GONE)
            if client_gone is not None:
                client_gone()
        super().connection_lost(exc)

    # the answer, bounded in time while the client does not read it

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._send_timer is None:
            self._send_timer = self.loop.call_later(self.limits.send_timeout, self._send_timed_out)

    def resume_writing(self) -> None:
        self._cancel_send_timer()
        super().resume_writing()

    def _send_timed_out(self) -> None:
        self._send_timer = None
        log.info("client %s read nothing for %gs; connection dropped", self.client, self.limits.send_timeout)
        self.transport.abort()  # not close(): that would wait for the unread buffer to drain

    def _cancel_send_timer(self) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    # the request head, counted as it arrives

    def data_received(self, data: bytes) -> None:
        if self._refused or self._read_no_more or self.transport.is_closing():
            return
        super().data_received(data)
        if self._in_head and not self._refused:
            self._head_fed += len(data)
            if self._url_bytes > self.limits.max_url_bytes:
                self._refuse_url()
            elif self._head_fed > self.limits.max_url_bytes + self.limits.max_header_bytes:
                self._refuse_headers()
            else:
                # Armed only for a head that spans reads: most arrive whole, and a timer per request costs time.
                self._arm_head_timer()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True
        self._head_fed = self._url_bytes = 0
        self._head_started = self.loop.time()

    def on_url(self, url: bytes) -> None:
        self._url_bytes += len(url)
        if self._url_bytes <= self.limits.max_url_bytes:
            super().on_url(url)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._cancel_head_timer()
        # summed once here, not per header: data_received already stopped a head from growing past both limits
        header_bytes = 0
        for name, value in self.headers:  # a loop, not sum() over a generator: this runs for every request
            header_bytes += len(name) + len(value) + _HEADER_FRAMING
        if self._url_bytes > self.limits.max_url_bytes:
            self._refuse_url()
        elif header_bytes > self.limits.max_header_bytes:
            self._refuse_headers()
        elif self._transfer_encoding_before_1_1():
            self._refuse(
                400,
                "malformed HTTP request: Transfer-Encoding before HTTP/1.1; send HTTP/1.1, or a Content-Length",
                "invalid_http",
            )
        elif self.parser.should_upgrade():
            self._upgrade_requested()
        else:
            super().on_headers_complete()

    def _transfer_encoding_before_1_1(self) -> bool:
        """A request before HTTP/1.1 with a Transfer-Encoding (RFC 9112, 6.1: its framing is faulty, and the connection
        must close after the answer). HTTP/1.0 has no chunked coding, so a 1.0 hop in front of the gateway frames
        such a request by its Content-Length or its close while llhttp read it as chunked: the two disagree on
        where the body ends, which is how a request is smuggled. Read from llhttp's parse, not from the bytes."""
        before_1_1 = self.parser.get_http_version() in ("0.9", "1.0")  # llhttp parses a 0.9 request line too
        return before_1_1 and any(name == b"transfer-encoding" for name, _ in self.headers)

    def _upgrade_requested(self) -> None:
        """No protocol is switched to, but llhttp ends an upgrade request's message at its head and hands the bytes
        after it (in that read) to the protocol asked for: a body that came with the head was lost, a valid request
        answered as empty, and one that came in a later read was parsed as a request of its own (smuggled past a
        proxy that framed it as a body). With a body it is refused; without, served, then the connection closed."""
        if any(
            name == b"transfer-encoding" or (name == b"content-length" and value != b"0")
            for name, value in self.headers
        ):
            self._refuse(
                400,
                "the gateway switches to no other protocol; send the request without Upgrade and Connection: upgrade",
                "upgrade_not_supported",
            )
            return
        super().on_headers_complete()
        self.cycle.keep_alive = False
        self._read_no_more = True

    def may_have_unread_bytes(self) -> bool:
        """Also after an upgrade request: what the client sends behind it is dropped, not parsed."""
        return self._read_no_more or super().may_have_unread_bytes()

    def _unsupported_upgrade_warning(self) -> None:
        """uvicorn's warning (and its advice to install a WebSocket library) for each upgrade request: a client
        chooses how many; `_upgrade_requested` has answered it."""

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if not self._refused:
            super().on_message_complete()

    def send_400_response(self, msg: str) -> None:
        """llhttp refused the bytes (smuggling, bad framing): the same answer, in the gateway's error shape."""
        self._refuse(400, f"malformed HTTP request: {msg}", "invalid_http")

    # refusals

    def _refuse_url(self) -> None:
        self._refuse(414, f"request target exceeds the {self.limits.max_url_bytes}-byte limit", "uri_too_long")

    def _refuse_headers(self) -> None:
        self._refuse(
            431,
            f"request headers exceed the {self.limits.max_header_bytes}-byte limit",
            "request_header_fields_too_large",
        )

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.cycle is None or self.cycle.response_complete:  # no request being served: this head is late
            self._refuse(408, f"request head not complete within {self.limits.header_timeout:g}s", "header_timeout")

    def _refuse(self, status: int, message: str, code: str, extra_headers: tuple[bytes, ...] = ()) -> None:
        """Answer with an OpenAI-shaped error and close: after a refusal the connection's bytes mean nothing. The
        close lingers where the client may still be sending (gateway/edge/lingering_close.py); a connection refused at
        accept (503, 429) is closed at once: it is not counted, and one past the cap must not outlive its answer."""
        self._refused = True
        self._cancel_head_timer()
        if self.transport.is_closing():
            return
        body = json.dumps(
            {"error": {"message": message, "type": "invalid_request_error", "code": code, "param": None}}
        ).encode()
        head = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head += [
            b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body),
            b"connection: close\r\n",
            *extra_headers,
            b"\r\n",
            body,
        ]
        self.transport.write(b"".join(head))
        self.transport.close()

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_at(self._head_started + self.limits.header_timeout, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None


def protocol_class(
    limits: LimitsConfig, listener_caps: dict[int, int], uncapped_peers: list[IPv4Network | IPv6Network]
) -> type[BoundedProtocol]:
    """A protocol class bound to this server's limits and its own connection counts."""
    return type(
        "BoundedProtocol",
        (BoundedProtocol,),
        {
            "limits": limits,
            "listener_caps": listener_caps,
            "open_connections": Counter(),
            "uncapped_peers": list(uncapped_peers),
            "open_per_client": Counter(),
        },
    )


def bind(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """A listening socket; with `reuse_port`, a bound one of several (one per worker) that the kernel spreads
    connections over once each listens. uvicorn makes it listen after the app's start-up: a worker that is still
    starting (a restarted one) is given no connections to keep waiting."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    if not reuse_port:
        sock = socket.create_server((host, port), family=family, backlog=BACKLOG)
    else:
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    sock.setblocking(False)
    return sock


class _Server(uvicorn.Server):
    """uvicorn's server, telling `on_started` once its lifespan has started and its listeners accept, and writing
    the log lines still queued once it has shut down."""

    def __init__(self, config: uvicorn.Config, on_started: Callable[[], None] | None) -> None:
        super().__init__(config)
        self._on_started = on_started

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and self._on_started is not None:
            self._on_started()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """After shutting down on SIGTERM, uvicorn raises the signal again, which ends the process without running
        its atexit handlers: the access-log lines of the requests the shutdown ended were still queued for the
        writer thread (gateway/observability/log_writer.py) and were lost. They are written before that."""
        with super().capture_signals():
            try:
                yield
            finally:
                log_writer.drain()


def serve(
    app: Any,
    config: GatewayConfig,
    host: str,
    port: int,
    *,
    reuse_port: bool = False,
    on_started: Callable[[], None] | None = None,
) -> None:
    """Run `app` on the public listener and, when enabled, the admin listener, until SIGINT/SIGTERM.

    A worker (gateway/ops/workers.py) binds the public port with `reuse_port`, and its supervisor learns through
    `on_started` that it serves."""
    listeners = [bind(host, port, reuse_port)]
    caps = {listeners[0].getsockname()[1]: config.limits.max_connections}
    if config.admin.enabled:
        admin = bind(config.admin.host, config.admin.port)
        listeners.append(admin)
        caps[admin.getsockname()[1]] = config.admin.max_connections
    for sock in listeners:
        log.info("listening on %s:%d", *sock.getsockname()[:2])
    server_config = uvicorn.Config(
        app,
        loop="uvloop",
        http=protocol_class(config.limits, caps, config.trusted_proxies),
        # No WebSocket route is served. Left on, uvicorn hands an upgrade request's connection to its WebSocket
        # protocol, past BoundedProtocol: the connection was never counted closed, and max_connections upgrade
        # requests refused every later client with 503.
        ws="none",
        lifespan="on",
        proxy_headers=False,
        access_log=False,
        log_config=None,
        timeout_graceful_shutdown=10,
        backlog=BACKLOG,
    )
    _Server(server_config, on_started).run(sockets=listeners)
