"""The WAF corpus harness judges each CRS stage on what the gateway's HTTP server would hand on, refusing what the
server refuses (tests/waf_corpus/wire.py replays the bytes through the same parsers in-process). Here the same bytes
go to a real gateway process over a socket: the harness's verdict must match the server's, or its 'refused' column
counts requests the gateway would in fact serve."""

from __future__ import annotations

import socket

from tests.conftest import pool
from tests.waf_corpus.wire import served

HEAD = b"Host: localhost\r\nUser-Agent: wire-check\r\n"
REQUESTS = [
    b"|GET / HTTP/1.1\r\n" + HEAD + b"\r\n",
    b"REALLYLONGUNREALMETHOD / HTTP/1.1\r\n" + HEAD + b"\r\n",
    b"GET http://localhost HTTP/1.1\r\n" + HEAD + b"\r\n",
    b"GET / HTTP/4.0\r\n" + HEAD + b"\r\n",
    b"GET / HTTP/2\r\n" + HEAD + b"\r\n",
    b"CONNECT localhost:80 HTTP/1.1\r\n" + HEAD + b"\r\n",
    b"POST /v1/models HTTP/1.1\r\n" + HEAD + b"Content-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    b"POST /v1/models HTTP/1.1\r\n" + HEAD + b"Content-Length: abc\r\n\r\n",
    b"GET /v1/models\r\n" + HEAD + b"\r\n",
    b"GET /v1/models HTTP/1.0\r\n\r\n",
    b"GET /v1/models?a=%2 HTTP/1.1\r\n" + HEAD + b"\r\n",
    b"GET /v1/models HTTP/1.1\r\n" + HEAD + b"\r\n",
]


def status_of(host: str, port: int, raw: bytes) -> int:
    with socket.create_connection((host, port), timeout=10) as conn:
        conn.sendall(raw)
        status_line = conn.recv(64).split(b"\r\n", 1)[0]
    return int(status_line.split()[1])


def test_the_harness_refuses_exactly_what_a_gateway_process_refuses(gateway, fake_upstream) -> None:
    gw = gateway({"pools": [pool("main", fake_upstream().url)]})
    host, port = gw.url.rsplit("/", 1)[-1].rsplit(":", 1)
    disagree = []
    for raw in REQUESTS:
        refused_live = status_of(host, int(port), raw) == 400
        if refused_live != (served(raw) is None):
            disagree.append((raw.split(b"\r\n", 1)[0], "gateway refused" if refused_live else "gateway served"))
    assert not disagree
