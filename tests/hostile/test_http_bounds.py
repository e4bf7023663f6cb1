"""Bounded reads at the socket: request target, header bytes, head and body deadlines, connections per listener.

Each limit is hit through a real gateway process over raw sockets, and each answer must be the gateway's own
OpenAI-shaped error, quickly, with the connection closed and the gateway still serving others.
"""

from __future__ import annotations

import gzip
import http.client
import json
import select
import time

import httpx
import pytest

from gateway.edge.lingering_close import LingerBounds
from tests.conftest import chat_body, pool
from tests.hostile.raw_http import (
    connect,
    parse_answer,
    read_all,
    read_answer,
    send_all_then_read,
    send_ignoring_reset,
    send_until_cut,
)

LIMITS = {
    "max_url_bytes": 4096,
    "max_header_bytes": 8192,
    "header_timeout": 2.0,
    "body_idle_timeout": 2.0,
    "body_timeout": 4.0,
    "max_connections": 8,
}


@pytest.fixture
def gw(fake_upstream, gateway):
    return gateway({"pools": [pool("main", fake_upstream().url)], "limits": LIMITS})


def head(path: str = "/v1/chat/completions", extra: bytes = b"") -> bytes:
    return f"POST {path} HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n".encode() + extra


def assert_healthy(gw) -> None:
    assert httpx.get(gw.url + "/healthz", timeout=5).json() == {"status": "ok"}


def test_a_long_request_target_gets_414(gw):
    sock = connect(gw.url)
    send_ignoring_reset(sock, b"GET /v1/models?" + b"a" * 200_000 + b" HTTP/1.1\r\nhost: gw\r\n\r\n")
    answer = read_answer(sock)
    assert answer is not None and answer.status == 414
    assert answer.error()["code"] == "uri_too_long" and "4096" in answer.error()["message"]
    assert_healthy(gw)


def test_header_bytes_past_the_limit_get_431_even_when_trickled_in_small_pieces(gw):
    sock = connect(gw.url)
    send_ignoring_reset(sock, head())
    started = time.monotonic()
    sent = 0
    while sent < 4_000_000 and send_ignoring_reset(sock, b"x-pad: " + b"p" * 1000 + b"\r\n"):
        sent += 1009  # the server answers long before 4 MB, and drops what follows until it closes
    answer = read_answer(sock)
    assert answer is not None and answer.status == 431
    assert answer.error()["code"] == "request_header_fields_too_large"
    assert time.monotonic() - started < 10
    assert_healthy(gw)


def test_one_huge_header_line_is_refused_without_reading_it_all(gw):
    sock = connect(gw.url)
    send_ignoring_reset(sock, head(extra=b"x-big: "))
    accepted = 0
    for _ in range(1024):  # up to 64 MB of one header value, 64 KB at a time
        if not send_ignoring_reset(sock, b"v" * 65536):
            break
        accepted += 1
    answer = read_answer(sock)
    assert answer is not None and answer.status == 431
    # past the answer, its close lingers: a few MB more read and dropped (LingerBounds.max_bytes), then a reset
    assert accepted < 1024, "the gateway kept reading a header past its limit"
    assert_healthy(gw)


def test_a_slowloris_head_gets_408_at_the_header_deadline(gw):
    sock = connect(gw.url)
    send_ignoring_reset(sock, head())
    started = time.monotonic()
    answer = None
    while time.monotonic() - started < 8:  # a header byte every half second: never complete
        if not send_ignoring_reset(sock, b"x") or select.select([sock], [], [], 0.5)[0]:
            break  # the answer came (or the connection was cut)
    answer = read_answer(sock, timeout=2)
    assert answer is not None and answer.status == 408, "a trickled head was never cut off"
    assert answer.error()["code"] == "header_timeout"
    assert time.monotonic() - started < 6


def test_a_connection_that_sends_nothing_is_closed_at_the_header_deadline(gw):
    sock = connect(gw.url)
    started = time.monotonic()
    answer = read_answer(sock, timeout=8)
    assert answer is not None and answer.status == 408
    assert time.monotonic() - started < 6


def test_a_stalled_body_gets_408(gw):
    sock = connect(gw.url)
    send_ignoring_reset(sock, head(extra=b'content-length: 500\r\n\r\n{"model": '))
    started = time.monotonic()
    answer = read_answer(sock, timeout=8)
    assert answer is not None and answer.status == 408
    assert answer.error()["code"] == "body_timeout"
    assert time.monotonic() - started < 6


def test_a_body_trickled_inside_each_idle_wait_gets_408_at_the_body_deadline(gw):
    sock = connect(gw.url)
    send_ignoring_reset(sock, head(extra=b"content-length: 100000\r\n\r\n"))
    started = time.monotonic()
    while time.monotonic() - started < 12:  # a body byte every half second: never stalled, never complete
        if not send_ignoring_reset(sock, b" ") or select.select([sock], [], [], 0.5)[0]:
            break  # the answer came (or the connection was cut)
    answer = read_answer(sock, timeout=2)
    assert answer is not None and answer.status == 408, "a trickled body was never cut off"
    assert answer.error()["code"] == "body_timeout" and "within 4s" in answer.error()["message"]
    assert time.monotonic() - started < 10
    waited = time.monotonic()
    assert read_all(sock, timeout=3) == b"" and time.monotonic() - waited < 2.5, "the connection stayed open"
    assert_healthy(gw)


def test_connections_past_the_listener_cap_are_refused_and_the_rest_served(gw):
    held = [connect(gw.url) for _ in range(LIMITS["max_connections"])]
    time.sleep(0.3)
    extra = connect(gw.url)
    answer = read_answer(extra, timeout=5)
    assert answer is not None and answer.status == 503
    assert answer.error()["code"] == "too_many_connections"
    for sock in held:
        sock.close()
    time.sleep(0.3)
    response = httpx.post(gw.url + "/v1/chat/completions", json=chat_body(), timeout=10)
    assert response.status_code == 200


def health_from(gw, source: str) -> int | None:
    """GET /healthz over a new connection from the local address `source`: its status, None if none came."""
    sock = connect(gw.url, source=source)
    sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: gw\r\nconnection: close\r\n\r\n")
    answer = read_answer(sock, timeout=5)
    return answer.status if answer else None


def test_one_client_address_cannot_hold_every_connection(fake_upstream, gateway):
    gw = gateway({"pools": [pool("main", fake_upstream().url)], "limits": {**LIMITS, "max_connections_per_client": 3}})
    held = [connect(gw.url) for _ in range(3)]
    time.sleep(0.3)
    answer = read_answer(connect(gw.url), timeout=5)
    assert answer is not None and answer.status == 429 and answer.headers["retry-after"] == "1"
    assert answer.error()["code"] == "too_many_client_connections"
    assert health_from(gw, "127.0.0.2") == 200  # another client still gets in
    for sock in held:
        sock.close()
    time.sleep(0.3)
    assert health_from(gw, "127.0.0.1") == 200  # closed connections are counted out


def test_a_trusted_proxy_carries_many_clients_and_is_not_capped_per_address(fake_upstream, gateway):
    limits = {**LIMITS, "max_connections_per_client": 3}
    gw = gateway({"pools": [pool("main", fake_upstream().url)], "limits": limits, "trusted_proxies": ["127.0.0.1/32"]})
    held = [connect(gw.url) for _ in range(5)]
    time.sleep(0.3)
    assert health_from(gw, "127.0.0.1") == 200
    for sock in held:
        sock.close()


def test_malformed_http_is_answered_in_the_gateway_error_shape(gw):
    sock = connect(gw.url)
    send_ignoring_reset(
        sock,
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-length: 5\r\n"
        b"transfer-encoding: chunked\r\n\r\n0\r\n\r\n",
    )
    answer = read_answer(sock)
    assert answer is not None and answer.status == 400
    assert answer.error()["code"] == "invalid_http"


@pytest.mark.parametrize("version", [b"1.0", b"0.9"])
def test_transfer_encoding_before_http_1_1_is_refused_and_the_connection_closed(gw, version):
    """RFC 9112, 6.1: a request before HTTP/1.1 with a Transfer-Encoding has faulty framing (a 1.0 hop in front reads
    its body otherwise than chunked), and the connection closes after the answer; asked to stay open, it does not."""
    body = json.dumps(chat_body()).encode()
    request = (
        b"POST /v1/chat/completions HTTP/" + version + b"\r\nhost: gw\r\nconnection: keep-alive\r\n"
        b"content-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
        + b"%x\r\n" % len(body)
        + body
        + b"\r\n0\r\n\r\n"
    )
    data = send_all_then_read(connect(gw.url), request, timeout=5)  # fails unless the gateway closes
    assert data.count(b"HTTP/1.1 ") == 1, data
    answer = parse_answer(data)
    assert answer.status == 400 and answer.error()["code"] == "invalid_http", data
    assert answer.headers["connection"] == "close"
    # HTTP/1.0 with its own framing is still served
    plain = b"POST /v1/chat/completions HTTP/1.0\r\nhost: gw\r\ncontent-type: application/json\r\n"
    served = parse_answer(send_all_then_read(connect(gw.url), plain + b"content-length: %d\r\n\r\n" % len(body) + body))
    assert served.status == 200, served.body


def read_status(sock) -> bytes:
    """The status line of the answer, without waiting for the server to close."""
    sock.settimeout(5)
    data = b""
    while b"\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return data.split(b"\r\n", 1)[0]


def test_websocket_upgrade_requests_do_not_use_up_the_connection_cap(gw):
    """uvicorn handed a WebSocket upgrade to its own WebSocket protocol, past the listener's bookkeeping: every such
    connection stayed counted open after it closed, and max_connections of them refused every client with 503."""
    upgrade = (
        b"GET /healthz HTTP/1.1\r\nhost: gw\r\nconnection: upgrade\r\nupgrade: websocket\r\n"
        b"sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\nsec-websocket-version: 13\r\n\r\n"
    )
    for _ in range(2 * LIMITS["max_connections"]):
        with connect(gw.url) as sock:
            sock.sendall(upgrade)
            status = read_status(sock)
            assert not status.startswith(b"HTTP/1.1 503"), "upgrade requests used up the listener's connections"
    time.sleep(0.3)
    assert_healthy(gw)
    response = httpx.post(gw.url + "/v1/chat/completions", json=chat_body(), timeout=10)
    assert response.status_code == 200


def test_an_upgrade_request_is_served_as_http_or_refused_never_misread(gw):
    """llhttp ends an upgrade request at its head and hands the bytes after it to the protocol asked for: a body that
    came with the head was dropped (a valid request answered 400 invalid_json), one that came later was parsed as a
    request of its own (two answers to one request), and a request pipelined behind it went unanswered."""
    h2c = b"connection: Upgrade, HTTP2-Settings\r\nupgrade: h2c\r\nhttp2-settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n"
    smuggled = b"GET /v1/models HTTP/1.1\r\nhost: gw\r\n\r\n"
    sock = connect(gw.url)
    sock.sendall(head(extra=h2c + b"content-length: %d\r\n\r\n" % len(smuggled)))
    time.sleep(0.3)
    send_ignoring_reset(sock, smuggled)  # the body, in a read of its own
    started = time.monotonic()
    data = read_all(sock, timeout=8)
    assert data.count(b"HTTP/1.1 ") == 1, f"the body was answered as a request of its own: {data!r}"
    answer = parse_answer(data)
    assert answer.status == 400 and answer.error()["code"] == "upgrade_not_supported"
    assert time.monotonic() - started < 4  # under the 5 s keep-alive a misread connection waited

    # without a body it is served as plain HTTP; the connection closes after it, pipelined bytes unread
    sock = connect(gw.url)
    sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: gw\r\n" + h2c + b"\r\n" + smuggled)
    started = time.monotonic()
    answer = read_answer(sock, timeout=8)
    assert answer is not None and answer.status == 200 and answer.headers["connection"] == "close"
    assert time.monotonic() - started < 4  # under the 5 s keep-alive a misread connection waited
    assert "No supported WebSocket library" not in gw.output()


def test_a_body_trickled_after_its_answer_does_not_hold_the_connection(gw):
    """A request answered without its body being read (/healthz, a 404, a 413 for its declared length): uvicorn went
    on reading the body only to drop it, and each byte put off the keep-alive timeout, so a client sending a byte a
    second held the connection for ever, past every deadline (the head was complete, and nothing read the body)."""
    for request, status in (
        (b"GET /healthz HTTP/1.1\r\nhost: gw\r\ncontent-length: 100000000\r\n\r\n", 200),
        (head(extra=b"content-length: 100000000\r\n\r\n"), 413),
        (b"POST /nowhere HTTP/1.1\r\nhost: gw\r\ntransfer-encoding: chunked\r\n\r\n10000000\r\n", 404),
    ):
        sock = connect(gw.url)
        sock.sendall(request)
        sock.settimeout(0.05)
        started = time.monotonic()
        data, ended, closed = b"", None, None
        while closed is None and time.monotonic() - started < 12:
            if not send_ignoring_reset(sock, b"x"):
                closed = time.monotonic() - started
            try:
                chunk = sock.recv(65536)
                if not chunk and ended is None:
                    ended = time.monotonic() - started  # the server's FIN: it reads nothing more
                data += chunk
            except TimeoutError:
                pass
            except ConnectionResetError:
                closed = time.monotonic() - started
            time.sleep(0.3)
        sock.close()
        assert parse_answer(data).status == status
        assert ended is not None and ended < 2, f"{request[:20]!r}: no end of the answer's connection after it"
        assert closed is not None and closed < 9, f"{request[:20]!r}: a trickled body held the connection open"
    assert_healthy(gw)


GZIPPED_CHAT = gzip.compress(json.dumps(chat_body()).encode())


@pytest.mark.parametrize(
    "start, body, status",
    [
        (b"GET /healthz HTTP/1.1\r\nhost: gw\r\ncontent-length: 64\r\n\r\n", b"x" * 64, 200),
        (head(extra=b"content-encoding: gzip\r\ncontent-length: %d\r\n\r\n" % len(GZIPPED_CHAT)), GZIPPED_CHAT, 415),
    ],
    ids=["health-check-with-a-body", "415-compressed"],
)
def test_an_answer_sent_before_its_body_says_connection_close_and_one_sent_after_keeps_the_connection(
    gw, start, body, status
):
    """An answer that goes out before its request's body has arrived ends the connection: without `connection:
    close` in it, a keep-alive client sent its next request into a connection that was closing and got a reset."""
    sock = connect(gw.url)
    sock.sendall(start)  # the head alone: the answer comes before the body
    early = parse_answer(read_all(sock, timeout=5))
    sock.close()
    assert early.status == status and early.headers["connection"] == "close"
    sock = connect(gw.url)
    sock.sendall(start + body)  # the whole request: answered after its end, the connection is kept
    response = http.client.HTTPResponse(sock)
    response.begin()
    response.read()
    assert response.status == status and response.headers.get("connection") != "close"
    sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: gw\r\n\r\n")  # the next request on the same connection
    again = http.client.HTTPResponse(sock)
    again.begin()
    assert again.status == 200 and json.loads(again.read()) == {"status": "ok"}
    sock.close()


LINGER = LingerBounds()  # the gateway's own bounds on a lingering close (gateway/edge/lingering_close.py)
MIB = 1 << 20


@pytest.mark.parametrize(
    "start, trickled, more, status, code",
    [
        (b"GET /v1/models?" + b"a" * 8192, None, b"a", 414, "uri_too_long"),
        (head(extra=b"x-big: "), None, b"v", 431, "request_header_fields_too_large"),
        (head(extra=b"content-length: 100000000\r\n\r\n"), None, b" ", 413, "request_too_large"),
        (head(), b"x", b"x", 408, "header_timeout"),
        (head(extra=b"content-length: 3000000\r\n\r\n{"), b" ", b" ", 408, "body_timeout"),
    ],
    ids=["414-target", "431-headers", "413-body", "408-head-deadline", "408-body-deadline"],
)
def test_a_client_still_sending_its_request_reads_the_whole_answer_then_the_end(
    gw, start, trickled, more, status, code
):
    """The gateway answered before the request's end and closed with the client's bytes unread: Linux resets such a
    connection, and a client still writing its request (as most do before they read) got ECONNRESET or EPIPE instead
    of the answer. The close now lingers: the answer, a FIN, and the client's further bytes read and dropped."""
    sock = connect(gw.url)
    sock.sendall(start)
    if trickled is not None:  # a byte at a time until the deadline's answer is there (unread)
        started = time.monotonic()
        while not select.select([sock], [], [], 0.25)[0]:
            assert time.monotonic() - started < 10, "no answer at the deadline"
            sock.sendall(trickled)
    data = send_all_then_read(sock, more * MIB)  # 1 MiB more than the socket buffers hold, then read
    answer = parse_answer(data)  # the whole answer: a truncated body fails here
    assert answer.status == status and answer.error()["code"] == code, data
    sock.close()
    assert_healthy(gw)


@pytest.mark.parametrize("piece, pause", [(b"v" * 65536, 0.0), (b"v" * 1024, 0.05)], ids=["blasting", "trickling"])
def test_a_client_that_never_stops_sending_reads_its_answer_and_is_cut_off_within_the_linger_bounds(gw, piece, pause):
    """After the answer the client's bytes are read only to be dropped: a client that never stops costs at most
    `LINGER.max_bytes` (one sending as fast as it can) or `LINGER.total` seconds (one that trickles inside the idle
    wait), then is reset. Before either, it reads the whole answer and the FIN after it."""
    sock = connect(gw.url)
    sock.sendall(head(extra=b"x-big: "))  # then one header value for ever: 431 once past the limit
    run = send_until_cut(sock, piece, pause)
    sock.close()
    answer = parse_answer(run.data)
    assert answer.status == 431 and answer.error()["code"] == "request_header_fields_too_large"
    assert run.eof is not None, "no FIN after the answer (a reset, or the connection held open)"
    assert run.cut is not None, "a client that never stops sending was never cut off"
    assert run.cut - run.eof < LINGER.total + 1.5, f"lingered {run.cut - run.eof:.1f}s"
    if pause:  # never idle for LINGER.idle: held to the total bound, not reset at once
        assert run.cut - run.eof > LINGER.total - 1, f"reset {run.cut - run.eof:.1f}s after the answer"
    else:  # bounded in bytes (plus what the sockets' buffers hold), well before the total bound
        assert run.sent_after_eof < 64 * MIB, f"{run.sent_after_eof} bytes read after the answer"
    assert_healthy(gw)
