"""Raw-socket HTTP/1.1 for the hostile tests: a client that misbehaves byte by byte, as no HTTP library would let it.

It only writes bytes and reads what comes back until the server closes; the status line and JSON body are split
with the standard library's own parser (http.client), never by hand.
"""

from __future__ import annotations

import http.client
import io
import json
import select
import socket
import time
from dataclasses import dataclass
from urllib.parse import urlsplit


@dataclass
class Answer:
    status: int
    headers: http.client.HTTPMessage
    body: bytes

    def error(self) -> dict:
        return json.loads(self.body)["error"]


def connect(url: str, timeout: float = 10.0, source: str | None = None) -> socket.socket:
    """`source`: the local address to connect from (another loopback address is another client)."""
    parts = urlsplit(url)
    return socket.create_connection(
        (parts.hostname, parts.port), timeout=timeout, source_address=(source, 0) if source else None
    )


def read_answer(sock: socket.socket, timeout: float = 10.0) -> Answer | None:
    """Everything the server sends until it closes (or `timeout` passes); None when it sent nothing."""
    data = read_all(sock, timeout)
    if not data:
        return None
    return parse_answer(data)


def parse_answer(data: bytes) -> Answer:
    """The first answer in `data`."""
    response = http.client.HTTPResponse(_Bytes(data))
    response.begin()
    return Answer(response.status, response.headers, response.read())


def read_all(sock: socket.socket, timeout: float = 10.0) -> bytes:
    """The bytes the server sends until it closes (or `timeout` passes)."""
    sock.settimeout(timeout)
    data = b""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return data


def send_ignoring_reset(sock: socket.socket, data: bytes) -> bool:
    """Send; False when the server already closed the connection (what a refused client sees)."""
    try:
        sock.sendall(data)
        return True
    except (BrokenPipeError, ConnectionResetError):
        return False


def send_all_then_read(sock: socket.socket, data: bytes, timeout: float = 10.0) -> bytes:
    """A client that writes the rest of its request before it reads, as most HTTP clients do: `data` in 64 KB
    writes, then everything the server sends until its FIN. A reset fails the test, on either side: it is what lost an
    answer sent before the request's end."""
    for start in range(0, len(data), 65536):
        try:
            sock.sendall(data[start : start + 65536])
        except (BrokenPipeError, ConnectionResetError) as e:
            raise AssertionError(f"the connection was reset with {len(data) - start} bytes left to send: {e!r}") from e
    sock.settimeout(timeout)
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except ConnectionResetError as e:
        raise AssertionError(f"a reset instead of the answer's end, after {received[:200]!r}") from e
    except TimeoutError as e:
        raise AssertionError(f"the connection stayed open after {received[:200]!r}") from e
    return received


@dataclass
class Cutoff:
    """What a client that never stops sending saw; times in seconds from its start."""

    data: bytes  # what the server sent
    eof: float | None  # when the server's FIN came (the answer's end); None: it never did
    cut: float | None  # when a reset ended the sending; None: it never did
    sent_after_eof: int  # bytes sent after the FIN came


def send_until_cut(sock: socket.socket, piece: bytes, pause: float = 0.0, timeout: float = 15.0) -> Cutoff:
    """Send `piece` over and over (as fast as the socket takes it, or every `pause` seconds), reading what comes back,
    until the connection is reset or `timeout` passes."""
    sock.setblocking(False)
    started = time.monotonic()
    data, eof, cut, after_eof = b"", None, None, 0
    while cut is None and time.monotonic() - started < timeout:
        readable, writable, _ = select.select([sock] if eof is None else [], [sock], [], 0.1)
        now = time.monotonic() - started
        try:
            if readable:
                chunk = sock.recv(65536)
                data += chunk
                if not chunk:
                    eof = now
            if writable:
                sent = sock.send(piece)
                if eof is not None:
                    after_eof += sent
        except BlockingIOError:
            pass
        except (BrokenPipeError, ConnectionResetError):
            cut = now
        if pause:
            time.sleep(pause)
    return Cutoff(data, eof, cut, after_eof)


class _Bytes:
    """What http.client.HTTPResponse reads from: a socket stand-in over bytes already received."""

    def __init__(self, data: bytes) -> None:
        self._file = io.BytesIO(data)

    def makefile(self, mode: str) -> io.BytesIO:
        return self._file
