"""The engine as a real process on a loopback port, driven over HTTP (and by the openai client)."""

from __future__ import annotations

import http.server
import json
import os
import select
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import orjson
import pytest

from backend_engine.block_hash import hash_prompt_blocks
from backend_engine.http.server import EngineServer
from gateway.edge.lingering_close import LingerBounds
from tests.hostile.raw_http import send_all_then_read, send_until_cut

from .conftest import reference
from .served import running_server

ROOT = Path(__file__).resolve().parents[2]
MODEL = "SmolLM2-135M-Instruct"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _OTLPSink(http.server.BaseHTTPRequestHandler):
    bodies: list[bytes] = []

    def do_POST(self):  # noqa: N802
        n = int(self.headers.get("content-length", 0))
        _OTLPSink.bodies.append(self.rfile.read(n))
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *a):
        pass


@pytest.fixture(scope="module")
def otlp():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _OTLPSink)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


BODY_IDLE_TIMEOUT = 2.0


@pytest.fixture(scope="module")
def server(otlp, tmp_path_factory):
    port = _free_port()
    log = tmp_path_factory.mktemp("engine") / "server.log"
    env = {
        **os.environ,
        "OTEL_EXPORTER_OTLP_ENDPOINT": otlp,
        "OTEL_SERVICE_NAME": "engine-under-test",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "PYTHONPATH": str(ROOT),
    }
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "backend_engine.cli",
                "engine",
                "serve",
                "--port",
                str(port),
                "--kv-cache-bytes",
                "64M",
                "--threads",
                "1",
                "--body-idle-timeout",  # the stalled-body test waits for it
                str(BODY_IDLE_TIMEOUT),
                "--log-level",
                "warning",
            ],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            if proc.poll() is not None:
                pytest.fail(f"engine exited with {proc.returncode}:\n{log.read_text()}")
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                pytest.fail(f"engine did not become healthy:\n{log.read_text()}")
            time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _metrics(base: str) -> str:
    return httpx.get(base + "/metrics").text


def _metric(base: str, name: str, default: float | None = None, **labels) -> float:
    """The sample of `name` with `labels`; `default` where none is exported yet (else that fails the test)."""
    for line in _metrics(base).splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
    if default is not None:
        return default
    raise AssertionError(f"metric {name} {labels} not exported")


def test_openai_client_streams_chat(server):
    from openai import OpenAI

    client = OpenAI(base_url=server + "/v1", api_key="unused")
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    stream = client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=20, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    pieces, finish, usage = [], None, None
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage
    text = "".join(pieces)
    assert text == "The capital of France is Paris."  # the reference's greedy answer
    assert finish == "stop"
    assert usage.prompt_tokens == 37 and usage.completion_tokens == 8
    full = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=20, temperature=0)
    assert full.choices[0].message.content == text
    assert full.usage.prompt_tokens_details.cached_tokens == 32  # second time: two full blocks cached


def test_models_and_health(server):
    data = httpx.get(server + "/v1/models").json()["data"]
    assert [m["id"] for m in data] == [MODEL, "all-MiniLM-L6-v2"]  # the chat model, then the bundled embedding model
    assert httpx.get(server + "/health").json()["status"] == "ok"


def test_completion_from_token_ids_with_logprobs(server):
    case = reference()["cases"][1]
    r = httpx.post(
        server + "/v1/completions",
        json={"model": MODEL, "prompt": case["prompt_ids"], "max_tokens": 4, "temperature": 0, "logprobs": 5},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    lp = ch["logprobs"]
    assert ch["text"] == " Paris.\n\n"
    assert lp["tokens"] == [" Paris", ".", "\n", "\n"]
    assert abs(lp["token_logprobs"][0] - case["first_step_top5"][0]["logprob"]) < 1e-3
    assert len(lp["top_logprobs"]) == 4 and all(isinstance(t, dict) for t in lp["top_logprobs"])
    assert abs(lp["top_logprobs"][0][" the"] - case["first_step_top5"][1]["logprob"]) < 1e-3
    assert r.json()["usage"]["completion_tokens"] == 4


def test_streamed_completion_with_text_prompt(server):
    with httpx.stream(
        "POST",
        server + "/v1/completions",
        timeout=60,
        json={
            "prompt": "Once upon a time",
            "max_tokens": 10,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 10
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text.startswith(", the city of")


def test_shared_prefix_reports_cached_tokens(server):
    prefix = list(range(3000, 3200))
    body = {"model": MODEL, "max_tokens": 8, "temperature": 0}
    cold = httpx.post(server + "/v1/completions", json={**body, "prompt": prefix + [11, 12]}, timeout=60).json()
    warm = httpx.post(server + "/v1/completions", json={**body, "prompt": prefix + [11, 12]}, timeout=60).json()
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == 192
    assert warm["choices"][0]["text"] == cold["choices"][0]["text"]


@pytest.mark.parametrize(
    "path,body,status,code",
    [
        ("/v1/completions", {"model": "nope", "prompt": "hi"}, 404, "model_not_found"),
        ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "invalid_type"),
        ("/v1/completions", {"prompt": "hi", "n": 17}, 400, None),
        ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, None),
        ("/v1/completions", {"prompt": [1] * 9000}, 400, None),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 100000}, 400, "context_length_exceeded"),
        ("/v1/completions", {"prompt": [-1]}, 400, None),
        ("/v1/chat/completions", {"messages": []}, 400, None),
        # any truthy value turned usage on: "false" included
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2,
                "stream": True,
                "stream_options": {"include_usage": "false"},
            },
            400,
            "invalid_type",
        ),
        # 0 read as absent: the first ran to the end of the context, the second took max_tokens instead
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
            400,
            None,
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0, "max_tokens": 2},
            400,
            None,
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, None),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, 400, None),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]},
            400,
            None,
        ),
        # arguments the renderer passes the template itself: a TypeError in the renderer before
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"bos_token": 5}},
            400,
            None,
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"messages": []}},
            400,
            None,
        ),
        (
            "/tokenize",
            {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"add_generation_prompt": 1}},
            400,
            None,
        ),
        ("/v1/completions", {"prompt": [True, 5]}, 400, None),
        ("/v1/completions", {"prompt": "hi", "stop_token_ids": [True]}, 400, None),
        ("/detokenize", {"tokens": [True]}, 400, None),
        ("/v1/nothing", {}, 404, "not_found"),
    ],
)
def test_errors_are_openai_shaped(server, path, body, status, code):
    r = httpx.post(server + path, json=body, timeout=30)
    assert r.status_code == status
    err = r.json()["error"]
    assert err["message"] and err["type"]
    if code:
        assert err["code"] == code


def test_a_batch_of_too_many_prompts_is_refused_before_it_is_tokenized(server):
    """The count of prompts was checked only after every one was tokenized, on the event loop: two million one-word
    prompts (8 MB of JSON) held every other request for many seconds before the 400."""
    started = time.monotonic()
    r = httpx.post(server + "/v1/completions", json={"prompt": ["a"] * 2_000_000, "max_tokens": 1}, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert time.monotonic() - started < 8  # tokenized first, it took 16-28 s


@pytest.mark.parametrize("batched", [False, True])
def test_token_ids_longer_than_the_context_are_refused_before_they_are_walked(server, batched):
    """Every id of a token-id prompt was checked before the prompt's length: ten million ids took seconds of a core
    the engine's steps share, only to be refused as longer than the context. The last "id" here is no id at all, so
    only a prompt measured before it is walked is refused for its length."""
    max_model_len = httpx.get(server + "/v1/models").json()["data"][0]["max_model_len"]
    ids = [84] * max_model_len + ["x"]
    r = httpx.post(server + "/v1/completions", json={"prompt": [ids] if batched else ids, "max_tokens": 1}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "context_length_exceeded" and r.json()["error"]["param"] == "prompt"


LONG_TEXT = "word " * 1_600_000  # 8 MB: far more than the context holds, well inside the body limit


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/completions", {"prompt": LONG_TEXT, "max_tokens": 1}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG_TEXT}], "max_tokens": 1}),
        ("/v1/responses", {"input": LONG_TEXT, "max_output_tokens": 1}),
    ],
)
def test_a_prompt_text_too_long_for_any_context_is_refused_untokenized(server, path, body):
    """The prompt was tokenized on the event loop before its length was checked: megabytes of text held every other
    request (and /health) for tens of seconds, only to be refused."""
    started = time.monotonic()
    r = httpx.post(server + path, json=body, timeout=300)
    assert r.status_code == 400 and "context" in r.json()["error"]["message"], r.text
    assert time.monotonic() - started < 8  # tokenized first, it took about 12 s


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": ""}] * 1_000_000, "max_tokens": 1}),
        ("/v1/responses", {"input": [{"role": "user", "content": ""}] * 1_000_000, "max_output_tokens": 1}),
        ("/tokenize", {"prompt": "word " * 2_000_000}),
    ],
)
def test_other_requests_are_served_while_a_body_is_parsed(server, path, body):
    """Request bodies were parsed on the event loop: rendering a million chat messages, or tokenizing 10 MB for
    /tokenize, held /health and every other request for the 10-20 s it took."""
    slowest = slowest_health_while_posting(server, path, body)
    assert slowest < 5, f"/health waited {slowest:.1f}s"  # 9-13 s while a body was parsed on the loop


def test_other_requests_are_served_while_millions_of_ids_are_detokenized(server):
    """/detokenize checked and decoded its ids on the event loop, and rendered the text with json.dumps there: 10
    million ids (30 MB of JSON) held /health, and every stream's tokens, for 3-5 s. What is left is decoding the
    body's JSON, which holds the interpreter lock wherever it runs."""
    slowest = slowest_health_while_posting(server, "/detokenize", {"tokens": [84] * 10_000_000})
    assert slowest < 2, f"/health waited {slowest:.2f}s"  # 3.3-5.4 s on the loop, 0.7-1.1 s off it


def test_detokenize_takes_at_most_a_contexts_worth_of_ids(server):
    """No text longer than the context comes from the model, and decoding more was the client's to ask: 5.5 million
    copies of the longest token's id (a 32 MiB body) made a 450 MB answer and 600 MB more resident memory."""
    context = httpx.get(server + "/v1/models").json()["data"][0]["max_model_len"]
    r = httpx.post(server + "/detokenize", json={"tokens": [84] * context}, timeout=60)
    assert r.status_code == 200 and r.json()["prompt"]
    r = httpx.post(server + "/detokenize", json={"tokens": [84] * (context + 1)}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text


def slowest_health_while_posting(server: str, path: str, body: dict) -> float:
    """The longest a /health request took while `body` was posted to `path`: about the engine's longest event-loop
    stall. The body is serialized first, so the client's own work does not hold this process's interpreter lock."""
    content = orjson.dumps(body)
    done = threading.Event()

    def post() -> None:
        try:
            httpx.post(server + path, content=content, headers={"content-type": "application/json"}, timeout=300)
        finally:
            done.set()

    thread = threading.Thread(target=post)
    thread.start()
    slowest = 0.0
    while not done.is_set():
        started = time.monotonic()
        assert httpx.get(server + "/health", timeout=300).status_code == 200
        slowest = max(slowest, time.monotonic() - started)
        time.sleep(0.05)
    thread.join()
    return slowest


@pytest.mark.parametrize("key,value", [("stop", ["zq"] * 100_000), ("stop_token_ids", [7] * 100_000)])
def test_stop_lists_are_bounded(server, key, value):
    """Every generated token is checked against every stop string and stop token id, on the engine thread: a million
    stop strings made each step of every running request about ten times slower. The list is counted before its
    items are looked at (the last one here is of the wrong type): walking millions of them cost a second."""
    body = {"prompt": "hi", "max_tokens": 2, key: [*value, None]}
    r = httpx.post(server + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["param"] == key, r.text
    assert "at most" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("stream", [False, True])
def test_an_empty_stop_string_changes_nothing(server, stream):
    """An empty stop string matches nothing, but it made the characters held back from a running stream -1: every
    token's text then lost its first character ("the city of" came out as "thecityof")."""
    body = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stream": stream}

    def text(extra: dict) -> str:
        r = httpx.post(server + "/v1/completions", json={**body, **extra}, timeout=60)
        assert r.status_code == 200, r.text
        if not stream:
            return r.json()["choices"][0]["text"]
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        return "".join(c["choices"][0]["text"] for c in chunks)

    assert text({"stop": ""}) == text({"stop": ["", "", ""]}) == text({})


def test_cache_salt_is_bounded(server):
    """The salt is hashed into every KV block of the request on the engine thread, which every running request waits
    on: a 20 MB salt cost a 1,400-token prompt 3.6 s of hashing there (87 blocks), against 0.3 ms unsalted."""
    r = httpx.post(
        server + "/v1/completions", json={"prompt": [5] * 64, "max_tokens": 1, "cache_salt": "s" * 100_000}, timeout=120
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text


@pytest.mark.parametrize("stream", [False, True])
def test_a_negative_seed_is_a_400_before_any_stream_starts(server, stream):
    """numpy refused a negative seed only once the engine thread added the sequence: a stream had already answered
    200 and carried the refusal as an error event, and either way the message never named the seed."""
    body = {"prompt": "hi", "max_tokens": 2, "seed": -1, "stream": stream}
    r = httpx.post(server + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert "seed" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        b'{"prompt": "hi", "max_tokens": 2, "temperature": NaN}',  # Python's json module takes NaN and Infinity
        b'{"prompt": "hi", "max_tokens": 2, "temperature": Infinity}',
        b'{"prompt": "\\ud800abc", "max_tokens": 2}',  # a lone surrogate, which the tokenizer cannot encode
    ],
)
def test_invalid_json_body(server, body):
    r = httpx.post(server + "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


def test_a_body_past_the_limit_is_refused_as_it_arrives(server):
    def chunks():
        for _ in range(40):
            yield b" " * (1 << 20)  # 40 MiB of JSON whitespace, chunked: no length to refuse it by up front

    r = httpx.post(server + "/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_a_stalled_body_is_answered_with_408(server):
    """A client that sends part of its body and then nothing held the connection (and its buffer) forever."""
    host, port = server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b'content-length: 100\r\n\r\n{"prompt": '
        )
        started = time.monotonic()
        answer = b""
        while chunk := conn.recv(4096):  # the head and the body may come in separate reads
            answer += chunk
            if b"body_timeout" in answer:
                break
    assert answer.startswith(b"HTTP/1.1 408") and b"body_timeout" in answer, answer
    assert BODY_IDLE_TIMEOUT - 0.1 < time.monotonic() - started < BODY_IDLE_TIMEOUT + 20


def test_a_body_trickled_past_its_deadline_is_answered_with_408_and_closed(make_engine):
    """A client sending a byte just inside each idle wait held its connection, and a handler reading its body, for as
    long as it went on: the idle timeout alone never fired. Short timeouts keep the test to seconds."""
    server = EngineServer(make_engine(body_idle_timeout=1.0, body_timeout=3.0))
    with running_server(server) as url:
        parts = urlsplit(url)
        with socket.create_connection((parts.hostname, parts.port), timeout=30) as conn:
            conn.sendall(
                b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                b"content-length: 1000\r\n\r\n{"
            )
            started = time.monotonic()
            answer = b""
            while time.monotonic() - started < 20:
                try:
                    conn.sendall(b" ")  # well inside the idle timeout
                except OSError:
                    break  # closed by the server
                if select.select([conn], [], [], 0.3)[0]:
                    chunk = conn.recv(4096)
                    if not chunk:
                        break  # closed by the server
                    answer += chunk
            elapsed = time.monotonic() - started
    assert answer.startswith(b"HTTP/1.1 408") and b"body_timeout" in answer and b"within 3s" in answer, answer
    assert 2.5 < elapsed < 10, elapsed  # the deadline, and the connection closed after it however the client goes on


def _stream_past_the_limit(conn: socket.socket) -> None:
    """A chunked body, one chunk declared far past MAX_BODY_BYTES, its first MiB and a byte sent (the limit is 1 MiB
    in these tests): the engine answers 413 once it has read past the limit."""
    conn.sendall(
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"transfer-encoding: chunked\r\n\r\n4000000\r\n" + b" " * ((1 << 20) + 1)
    )


@pytest.fixture
def small_body_limit(monkeypatch):
    monkeypatch.setattr("backend_engine.http.openai_protocol.requests.MAX_BODY_BYTES", 1 << 20)


def test_a_body_streamed_past_the_limit_gets_the_whole_413_and_the_end_however_much_more_comes(
    make_engine, small_body_limit
):
    """Answered 413 while the client still sent its body: uvicorn kept the connection to read and drop the rest of
    the body, for as long as the client sent it. The connection now ends with the answer, its close lingering: the
    client, still writing, loses nothing to a reset, and reads the whole answer and then the end."""
    with running_server(EngineServer(make_engine())) as url:
        parts = urlsplit(url)
        with socket.create_connection((parts.hostname, parts.port), timeout=30) as conn:
            _stream_past_the_limit(conn)
            data = send_all_then_read(conn, b" " * (1 << 20))  # a MiB more, then read
    assert data.startswith(b"HTTP/1.1 413") and b"request_too_large" in data, data
    assert data.endswith(b"}"), data  # the whole body: nothing lost to a reset


@pytest.mark.parametrize("piece, pause", [(b" " * 65536, 0.0), (b" " * 1024, 0.05)], ids=["blasting", "trickling"])
def test_a_client_that_never_stops_sending_after_its_413_is_cut_off_within_the_linger_bounds(
    make_engine, small_body_limit, piece, pause
):
    """What comes after the answer is read only to be dropped, within LingerBounds: bytes for a client sending as
    fast as it can, seconds for one trickling inside the idle wait; then the connection is reset."""
    bounds = LingerBounds()
    with running_server(EngineServer(make_engine())) as url:
        parts = urlsplit(url)
        with socket.create_connection((parts.hostname, parts.port), timeout=30) as conn:
            _stream_past_the_limit(conn)
            run = send_until_cut(conn, piece, pause)
    assert run.data.startswith(b"HTTP/1.1 413") and run.data.endswith(b"}"), run.data
    assert run.eof is not None, "no FIN after the answer (a reset, or the connection held open)"
    assert run.cut is not None, "a client that never stops sending was never cut off"
    assert run.cut - run.eof < bounds.total + 1.5, f"lingered {run.cut - run.eof:.1f}s"
    if pause:
        assert run.cut - run.eof > bounds.total - 1, f"reset {run.cut - run.eof:.1f}s after the answer"
    else:
        assert run.sent_after_eof < 64 << 20, f"{run.sent_after_eof} bytes read after the answer"


def test_logit_bias_steers_the_completion(server):
    """OpenAI's logit_bias was accepted and ignored; now +100 forces a token and -100 bans one."""
    body = {"prompt": [6403, 1980, 253, 655], "max_tokens": 6, "temperature": 0}
    plain = httpx.post(server + "/v1/completions", json={**body, "logprobs": 1}, timeout=60).json()
    first = plain["choices"][0]["logprobs"]["tokens"][0]
    ids = httpx.post(server + "/tokenize", json={"prompt": first, "add_special_tokens": False}).json()["tokens"]
    banned = httpx.post(
        server + "/v1/completions", json={**body, "logit_bias": {str(ids[0]): -100}}, timeout=60
    ).json()["choices"][0]["text"]
    assert not banned.startswith(first)
    forced = httpx.post(
        server + "/v1/completions", json={**body, "logit_bias": {"1980": 100}, "ignore_eos": True}, timeout=60
    ).json()
    assert forced["choices"][0]["text"] == " upon" * 6  # token 1980, the prompt's second


@pytest.mark.parametrize(
    "bias",
    [
        {"x": 1},
        {"-1": 1},
        {"49152": 1},
        {"5": 150},
        {"5": "ban"},
        {"5": True},
        [1, 2],
        {"\u00b2": 1},  # str.isdigit() takes a superscript two, which int() refuses: a 500 before
        {"9" * 5000: 1},  # past int()'s 4300-digit limit: a 500 before
    ],
)
def test_a_bad_logit_bias_is_a_400(server, bias):
    r = httpx.post(server + "/v1/completions", json={"prompt": "hi", "logit_bias": bias}, timeout=30)
    assert r.status_code == 400 and "logit_bias" in r.text


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"tools": [TOOL]}, "tools"),
        ({"tools": [TOOL], "tool_choice": "auto"}, "tools"),
        ({"functions": [TOOL["function"]]}, "functions"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}, "response_format"),
    ],
)
def test_chat_fields_the_engine_cannot_honour_are_refused(server, extra, param):
    """Tools and structured output were accepted and dropped: the answer looked like a success that ignored them."""
    body = {"messages": [{"role": "user", "content": "weather in Paris?"}], "max_tokens": 2, **extra}
    r = httpx.post(server + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_tools_with_tool_choice_none_and_text_format_are_served(server):
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "tools": [TOOL],
        "tool_choice": "none",
        "response_format": {"type": "text"},
    }
    assert httpx.post(server + "/v1/chat/completions", json=body, timeout=30).status_code == 200


def test_a_tiny_temperature_samples_without_failing_the_batch(server):
    """A positive temperature so small that logits / temperature overflowed made every probability NaN: the engine
    step raised, and every request in flight failed with it. It is now the greedy choice, and a neighbour's stream
    is untouched."""
    greedy = {"prompt": [6403, 1980, 253, 655], "max_tokens": 8, "temperature": 0}
    want = httpx.post(server + "/v1/completions", json=greedy, timeout=60).json()["choices"][0]["text"]
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", server + "/v1/completions", json={**greedy, "max_tokens": 64, "stream": True}) as r:
            tiny = client.post(server + "/v1/completions", json={**greedy, "temperature": 1e-310})
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert tiny.status_code == 200 and tiny.json()["choices"][0]["text"] == want
    assert events[-1] == "data: [DONE]" and not any('"error"' in e for e in events)


@pytest.mark.parametrize("heartbeat", ["0", "-1", "1e-9", "nan", "inf", "soon"])
def test_kv_events_refuses_a_heartbeat_outside_its_range(server, heartbeat):
    r = httpx.get(server + f"/v1/kv_events?heartbeat={heartbeat}", timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "heartbeat"


def test_tokenize(server):
    r = httpx.post(server + "/tokenize", json={"prompt": "Once upon a time"}).json()
    assert r["tokens"] == [6403, 1980, 253, 655] and r["count"] == 4
    r = httpx.post(server + "/detokenize", json={"tokens": [1, 6403, 1980, 253, 655]})
    assert r.headers["content-type"] == "application/json" and r.json() == {"prompt": "<|im_start|>Once upon a time"}
    r = httpx.post(
        server + "/tokenize", json={"messages": [{"role": "user", "content": "What is the capital of France?"}]}
    )
    assert r.json()["tokens"] == reference()["cases"][3]["prompt_ids"]


def test_kv_events_stream(server):
    prompt = list(range(7000, 7040))  # two full blocks, never seen before
    want = hash_prompt_blocks(prompt, 16)
    seen: list[int] = []
    seqs: list[int] = []
    with httpx.Client(timeout=60) as client:
        with client.stream("GET", server + "/v1/kv_events?heartbeat=1") as r:
            lines = r.iter_lines()
            snap = json.loads(next(lines))
            assert snap["snapshot"] is True and snap["events"][0]["type"] == "AllBlocksCleared"
            assert not set(want) & set(snap["events"][1]["block_hashes"])
            threading.Thread(
                target=lambda: httpx.post(
                    server + "/v1/completions", timeout=60, json={"prompt": prompt, "max_tokens": 2, "temperature": 0}
                )
            ).start()
            deadline = time.time() + 60
            for line in lines:
                batch = json.loads(line)
                seqs.append(batch["seq"])
                for e in batch["events"]:
                    if e["type"] == "BlockStored":
                        seen.extend(e["block_hashes"])
                if set(want) <= set(seen) or time.time() > deadline:
                    break
    assert set(want) <= set(seen)
    assert seqs == sorted(seqs)


def test_client_disconnect_aborts(server):
    before = (
        _metric(server, "vllm:request_success_total", finished_reason="abort")
        if "abort" in httpx.get(server + "/metrics").text
        else 0.0
    )
    with httpx.stream(
        "POST",
        server + "/v1/completions",
        timeout=60,
        json={
            "prompt": "Tell me a very long story.",
            "max_tokens": 1000,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        },
    ) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 6:
                break
    deadline = time.time() + 30
    while time.time() < deadline:
        if (
            _metric(server, "vllm:num_requests_running") == 0
            and "abort" in httpx.get(server + "/metrics").text
            and _metric(server, "vllm:request_success_total", finished_reason="abort") > before
        ):
            break
        time.sleep(0.3)
    assert _metric(server, "vllm:num_requests_running") == 0
    assert _metric(server, "vllm:kv_cache_usage_perc") == 0.0
    assert _metric(server, "vllm:request_success_total", finished_reason="abort") > before


def test_metrics_have_vllm_names_and_memory_budget(server):
    """Its own traffic first (a 202-token prompt twice: 192 tokens, twelve full blocks, hit the second time), so the
    latency histograms have samples and the hit counter a known rise, whatever ran before."""
    hits = _metric(server, "vllm:prefix_cache_hits_total", default=0.0)
    body = {"model": MODEL, "prompt": list(range(5000, 5202)), "max_tokens": 2, "temperature": 0}
    for _ in range(2):
        httpx.post(server + "/v1/completions", json=body, timeout=60).raise_for_status()
    text = _metrics(server)
    for name in [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
    ]:
        assert name in text, name
    assert _metric(server, "vllm:prefix_cache_hits_total") - hits >= 192
    for comp in ("weights", "runtime_overhead", "kv_cache"):
        assert _metric(server, "portcullis_engine_memory_bytes", component=comp) > 0
    assert _metric(server, "portcullis_engine_kv_cache_tokens") > 1000


def _exported_spans(trace_id: str, wanted: int, wait: float = 20) -> tuple[dict, set[str]]:
    """The spans of one trace the engine exported, by name (waiting up to `wait` seconds for `wanted` of them), and
    the service names every export named."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    spans: dict = {}
    services: set[str] = set()
    deadline = time.time() + wait
    while True:
        for body in list(_OTLPSink.bodies):
            req = ExportTraceServiceRequest.FromString(body)
            for rs in req.resource_spans:
                services |= {a.value.string_value for a in rs.resource.attributes if a.key == "service.name"}
                for ss in rs.scope_spans:
                    for sp in ss.spans:
                        if sp.trace_id.hex() == trace_id:
                            spans[sp.name] = sp
        if len(spans) >= wanted or time.time() > deadline:
            return spans, services
        time.sleep(0.2)


def test_traceparent_is_continued(server):
    trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    unsampled = "5cf92f3577b34da6a3ce929d0e0e4737"
    for trace, flags in ((unsampled, "00"), (trace_id, "01")):  # the gateway's choice travels in the flags
        httpx.post(
            server + "/v1/completions",
            headers={"traceparent": f"00-{trace}-{parent}-{flags}"},
            json={"prompt": "Hello", "max_tokens": 3, "temperature": 0},
            timeout=60,
        )
    spans, services = _exported_spans(trace_id, 4)
    assert services == {"engine-under-test"}, "OTEL_SERVICE_NAME names the service"
    # exported in the order they end: the unsampled request's would have come before
    assert _exported_spans(unsampled, 1, wait=0)[0] == {}, "an unsampled parent's request is not exported"
    assert set(spans) == {"engine.request", "engine.queue", "engine.prefill", "engine.decode"}
    assert spans["engine.request"].parent_span_id.hex() == parent
    root = spans["engine.request"].span_id
    assert all(spans[n].parent_span_id == root for n in ("engine.queue", "engine.prefill", "engine.decode"))
    attrs = {a.key: a.value for a in spans["engine.prefill"].attributes}
    assert attrs["engine.prefill.tokens_computed"].int_value + attrs["engine.prefill.tokens_cached"].int_value == 1


def test_chat_logprobs_shape(server):
    r = httpx.post(
        server + "/v1/chat/completions",
        timeout=60,
        json={
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 3,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 2,
        },
    )
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == ["The", " capital", " of"]
    assert all(len(c["top_logprobs"]) == 2 and c["top_logprobs"][0]["token"] == c["token"] for c in content)
    assert bytes(content[0]["bytes"]).decode() == "The"


def test_concurrent_streams_match_their_solo_outputs(server):
    """Eight streams at once through HTTP are batched together and each still gets its own answer."""
    import asyncio

    prompts = [f"Count from {i} to {i + 5}:" for i in range(8)]

    async def one(client, p):
        body = {"prompt": p, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": True}
        text = []
        async with client.stream("POST", server + "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    text.append(json.loads(line[6:])["choices"][0]["text"])
        return "".join(text)

    async def run_all():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    together = asyncio.run(run_all())
    solo = [
        httpx.post(
            server + "/v1/completions",
            timeout=60,
            json={"prompt": p, "max_tokens": 12, "temperature": 0, "ignore_eos": True},
        ).json()["choices"][0]["text"]
        for p in prompts[:3]
    ]
    assert together[:3] == solo
    assert all(t for t in together)


def test_batch_prompts_and_n(server):
    case = reference()["cases"][1]
    body = {"prompt": [case["prompt"], case["prompt_ids"]], "max_tokens": 3, "temperature": 0}
    r = httpx.post(server + "/v1/completions", json=body, timeout=60).json()
    assert [c["index"] for c in r["choices"]] == [0, 1]
    assert r["choices"][0]["text"] == r["choices"][1]["text"] == " Paris.\n"
    assert r["usage"]["prompt_tokens"] == 10 and r["usage"]["completion_tokens"] == 6
    body = {
        "prompt": "Once upon a time",
        "max_tokens": 6,
        "temperature": 1.0,
        "seed": 3,
        "n": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    texts = {0: "", 1: "", 2: ""}
    usage = None
    with httpx.stream("POST", server + "/v1/completions", json=body, timeout=60) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                d = json.loads(line[6:])
                for c in d["choices"]:
                    texts[c["index"]] += c["text"]
                usage = d.get("usage") or usage
    assert usage["prompt_tokens"] == 4 and usage["completion_tokens"] == 18
    assert len(set(texts.values())) > 1  # different seeds per choice
