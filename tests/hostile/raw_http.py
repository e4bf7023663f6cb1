"""Raw-socket HTTP/1.1 for the hostile tests: a client that misbehaves byte by byte, as no HTTP library would let it.

It only writes bytes and reads what comes back until the server closes; the status line and JSON body are split
with the standard library's own parser (http.client), never by hand.
"""

from __future__ import annotations

import http.client
import io
import json
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


class _Bytes:
    """What http.client.HTTPResponse reads from: a socket stand-in over bytes already received."""

    def __init__(self, data: bytes) -> None:
        self._file = io.BytesIO(data)

    def makefile(self, mode: str) -> io.BytesIO:
        return self._file
