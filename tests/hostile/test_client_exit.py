"""Every way a request ends early stops the upstream work done for it at once: a client that leaves (before or
during its answer), the request's total deadline, and an upstream stream gone silent.

Real gateway, real hostile upstream (tests/hostile/hostile_upstream.py) that reports when the gateway closed it.
Each test configures its gateway its own way and reads that gateway's whole log, so each starts one; the hostile
upstream is the module's, each test reading the records of its own tags. Deadlines are a fraction of a second to a
second: the tests are about which deadline ends the request, not its length.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from tests.conftest import Process, chat_body, policy_dir, pool
from tests.hostile.conftest import upstream_seen, wait_for


def sse_data(text: str) -> list[str]:
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


@pytest.fixture(scope="module")
def upstream(module_hostile_upstream) -> Process:
    return module_hostile_upstream()


def send_and_leave(url: str, body: dict, upstream, tag: str) -> float:
    """POST `body` over a raw socket, wait until the upstream has the request, then hang up; when it hung up."""
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(payload), payload)
        )
        assert wait_for(upstream, tag, "received_at", timeout=10), "the request never reached the upstream"
        time.sleep(0.3)  # the gateway is now waiting on the upstream (or, for a stream, has sent its headers)
        left_at = time.time()
    return left_at


def test_a_client_that_leaves_cancels_the_upstream_and_frees_its_slot(upstream, gateway, tmp_path):
    one_at_a_time = [{"id": "one-at-once", "key": ["tenant"], "concurrency": {"limit": 1}}]
    gw = gateway(
        {"pools": [pool("main", upstream.url, max_attempts=1)], "policy_dir": policy_dir(tmp_path, one_at_a_time)}
    )
    leaving = [
        ("non-streaming", chat_body(hostile={"behaviour": "hang", "tag": "non-streaming"})),
        (
            "stream-before-headers",
            chat_body(stream=True, hostile={"behaviour": "hang", "tag": "stream-before-headers"}),
        ),
        (
            "stream-before-first-chunk",
            chat_body(
                stream=True, hostile={"behaviour": "slow_first", "delay": 60, "tag": "stream-before-first-chunk"}
            ),
        ),
    ]
    for tag, body in leaving:
        left_at = send_and_leave(gw.url, body, upstream, tag)
        seen = wait_for(upstream, tag, "closed_at", timeout=10)
        assert seen, f"{tag}: the gateway kept the upstream request open after its client left"
        assert seen["closed_at"] - left_at < 2.0, f"{tag}: upstream closed {seen['closed_at'] - left_at:.1f} s late"
        # the client's concurrency slot is free again: the next request is served, not refused with 429
        after = httpx.post(gw.url + "/v1/chat/completions", json=chat_body(hostile={"tag": f"after-{tag}"}), timeout=10)
        assert after.status_code == 200, f"{tag}: {after.text}"
    log = gw.output()
    assert "client disconnected" in log
    assert "Traceback" not in log and "ERROR" not in log, log[-3000:]


def long_stream_on_a_small_buffer(url: str, tag: str, path: str = "/v1/chat/completions") -> socket.socket:
    """A raw connection asking for a ~32 MB stream, with a 4 KB receive buffer so the gateway soon has to wait on it."""
    body = json.dumps(chat_body(stream=True, hostile={"behaviour": "ok", "words": 4000, "pad": 8192, "tag": tag}))
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    sock.sendall(
        b"POST %s HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (path.encode(), len(body), body.encode())
    )
    return sock


def test_a_client_that_stops_reading_is_cut_off_and_frees_its_slot(upstream, gateway, tmp_path):
    """A client that reads the headers of a long stream and then nothing parks the gateway's writes on flow control,
    where no deadline reached: it kept its concurrency slot and the upstream stream for as long as it liked."""
    one_at_a_time = [{"id": "one-at-once", "key": ["tenant"], "concurrency": {"limit": 1}}]
    gw = gateway(
        {
            "pools": [pool("main", upstream.url, max_attempts=1, timeouts={"total": 120, "stream_idle": 60})],
            "policy_dir": policy_dir(tmp_path, one_at_a_time),
            "limits": {"send_timeout": 0.5},
        }
    )
    with long_stream_on_a_small_buffer(gw.url, "unread") as sock:
        assert sock.recv(1024).startswith(b"HTTP/1.1 200")  # the answer started; from here on nothing is read
        assert wait_for(upstream, "unread", "received_at", timeout=10)
        started = time.monotonic()
        seen = wait_for(upstream, "unread", "closed_at", timeout=15)
        assert seen, "the gateway kept streaming for a client that read nothing"
        assert not seen["answered"]
        assert time.monotonic() - started < 10
        after = httpx.post(gw.url + "/v1/chat/completions", json=chat_body(hostile={"tag": "after"}), timeout=10)
        assert after.status_code == 200, after.text  # its slot is free while its socket is still open
    log = gw.output()
    assert "read nothing for 0.5s" in log
    assert "Traceback" not in log and "ERROR" not in log, log[-3000:]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/audio/speech"], ids=["model-route", "passthrough"])
def test_the_total_deadline_ends_a_stream_to_a_slow_reader(upstream, gateway, path):
    """A client reading slowly but steadily keeps the upstream's bytes waiting in the gateway, so reading them never
    waits and the deadline's timer never had a chance to fire: the stream went on for as long as the answer did. And
    the deadline lets the upstream go when it passes: the relay is held in its writes to this reader until the kernel
    finds room in the socket (after the reader drained half of what it holds), and the upstream connection used to
    wait there with it, 2.5 s past a 1 s deadline at 400 KB/s, 4.5 s at this reader's 200 KB/s. A passthrough
    route's answer, relayed as bytes, is held the same way."""
    timeouts = {"total": 1, "stream_idle": 60}
    gw = gateway(
        {"pools": [pool("main", upstream.url, max_attempts=1, timeouts=timeouts, passthrough=["/v1/audio/speech"])]}
    )
    tag = f"slow-reader{path}"
    stop = threading.Event()

    def read_slowly(sock: socket.socket) -> None:
        """About 200 KB/s: what the gateway's socket holds at the deadline takes this reader seconds to read."""
        while not stop.is_set() and sock.recv(4096):
            time.sleep(0.02)

    with long_stream_on_a_small_buffer(gw.url, tag, path) as sock:
        reader = threading.Thread(target=read_slowly, args=(sock,), daemon=True)
        reader.start()
        seen = wait_for(upstream, tag, "closed_at", timeout=15)
        stop.set()
        reader.join(timeout=5)
    assert seen, "the stream outlived its 1 s deadline by 15 s"
    # the deadline counts from the gateway's arrival, a few milliseconds before the upstream's
    assert not seen["answered"] and 0.9 <= seen["closed_at"] - seen["received_at"] < 3


def test_the_total_deadline_ends_a_trickling_upstream(upstream, gateway):
    """An upstream sending a byte every 0.3 s never trips a read timeout; the request's total deadline stops it."""
    gw = gateway({"pools": [pool("main", upstream.url, max_attempts=1, timeouts={"read": 30, "total": 1})]})
    started = time.monotonic()
    response = httpx.post(
        gw.url + "/v1/chat/completions",
        json=chat_body(hostile={"behaviour": "trickle", "interval": 0.3, "tag": "answer"}),
        timeout=20,
    )
    assert response.status_code == 504 and response.json()["error"]["code"] == "deadline_exceeded"
    assert time.monotonic() - started < 6
    assert wait_for(upstream, "answer", "closed_at", timeout=5)

    body = chat_body(stream=True, hostile={"behaviour": "trickle", "interval": 0.3, "tag": "stream"})
    response = httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=20)
    assert response.status_code == 200  # the stream had started: the deadline ends it with an error event
    data = sse_data(response.text)
    assert json.loads(data[-2])["error"]["code"] == "deadline_exceeded" and data[-1] == "[DONE]"
    assert wait_for(upstream, "stream", "closed_at", timeout=5)


def test_a_silent_stream_ends_at_the_idle_timeout(upstream, gateway):
    """Two events, then silence with the connection open: `timeouts.stream_idle`, not `read`, ends it."""
    gw = gateway({"pools": [pool("main", upstream.url, max_attempts=1, timeouts={"read": 30, "stream_idle": 0.5})]})
    started = time.monotonic()
    body = chat_body(stream=True, hostile={"behaviour": "stall", "events": 2, "tag": "stall"})
    response = httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=20)
    assert response.status_code == 200
    data = sse_data(response.text)
    assert [json.loads(d)["choices"][0]["delta"]["content"] for d in data[:2]] == ["w0 ", "w1 "]
    assert json.loads(data[2])["error"]["code"] == "upstream_stream_idle" and data[3:] == ["[DONE]"]
    assert time.monotonic() - started < 8
    assert wait_for(upstream, "stall", "closed_at", timeout=5)
    assert upstream_seen(upstream, "stall")["answered"] is False


def test_a_stream_whose_client_is_gone_before_it_starts_is_still_closed_and_counted_out(upstream, gateway):
    """The stream's headers cannot go out: its client reads nothing (here: a pipelined request behind an answer it
    never read), and the connection is dropped at the send timeout before the stream's body began. The upstream
    answer is closed all the same, and the replica's in-flight count, which least-outstanding routing ranks by,
    goes back to zero instead of keeping the request counted for ever."""
    gw = gateway(
        {
            "pools": [pool("main", upstream.url, max_attempts=1, max_response_bytes=16 * 1024 * 1024)],
            "limits": {"send_timeout": 0.5},
        }
    )
    big = json.dumps(chat_body(hostile={"behaviour": "huge_body", "bytes": 8 * 1024 * 1024, "length": True}))
    stream = json.dumps(chat_body(stream=True, hostile={"behaviour": "slow_first", "delay": 60, "tag": "behind"}))
    host, port = gw.url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    with sock:
        sock.connect((host, int(port)))
        sock.sendall(
            b"".join(
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(body), body.encode())
                for body in (big, stream)
            )
        )
        assert wait_for(upstream, "behind", "received_at", timeout=10), "the pipelined stream never reached upstream"
        seen = wait_for(upstream, "behind", "closed_at", timeout=10)
        assert seen, "the gateway kept the upstream stream open after its client was dropped"
    deadline = time.monotonic() + 10
    while "portcullis_upstream_outstanding_requests" not in (metrics := gw.admin.get("/metrics").text) or (
        f'replica="{upstream.url}"}} 0.0' not in metrics
    ):
        assert time.monotonic() < deadline, [line for line in metrics.splitlines() if "outstanding" in line]
        time.sleep(0.2)
    assert "read nothing for 0.5s" in gw.output()
