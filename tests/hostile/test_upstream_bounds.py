"""A hostile upstream cannot make the gateway buffer without bound, stall its event loop, or hand garbage to a client.

Every test runs the real gateway against tests/hostile/hostile_upstream.py, a real process misbehaving on the wire.
The module starts one of each, and the tests that read only what they sent (their own tags, request ids, answers and
counters' changes) share them; a test that measures the gateway process (its peak memory, its CPU) or configures it
otherwise starts a gateway of its own.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import Launcher, Process, chat_body, pool
from tests.hostile.conftest import log_mark, upstream_seen, wait_for

MIB = 1024 * 1024


def sse_data(text: str) -> list[str]:
    """The data fields of a relayed stream, whichever line endings it used."""
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


def peak_rss(pid: int) -> int:
    """The process's high-water resident memory, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


@pytest.fixture(scope="module")
def upstream(module_hostile_upstream) -> Process:
    """The module's hostile upstream: each test reads the records of its own tags, or a count's change."""
    return module_hostile_upstream()


@pytest.fixture(scope="module")
def gw(module_launcher: Launcher, upstream: Process) -> Process:
    """The module's gateway in front of it, for the tests that read only their own answers and log lines."""
    return module_launcher.gateway({"pools": [pool("main", upstream.url, max_attempts=1)]})


def assert_openai_error(response: httpx.Response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.text[:300]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "code", "param"} and error["message"]
    if code is not None:
        assert error["code"] == code, error
    return error


def test_a_huge_answer_is_dropped_at_the_cap_and_never_buffered(upstream, gateway):
    """256 MiB answers against the default 32 MiB cap: 502, the upstream connection dropped, memory flat. A gateway of
    its own: its peak memory is what a shared one's other tests have raised it to."""
    gw = gateway({"pools": [pool("main", upstream.url, max_attempts=1)]})
    pid = gw.proc.pid
    httpx.post(gw.url + "/v1/chat/completions", json=chat_body(), timeout=30)  # warm: first-request allocations
    before = peak_rss(pid)
    for tag, length in (("unsized", False), ("sized", True)):
        hostile = {"behaviour": "huge_body", "bytes": 256 * MIB, "length": length, "tag": tag}
        response = httpx.post(gw.url + "/v1/chat/completions", json=chat_body(hostile=hostile), timeout=60)
        assert_openai_error(response, 502, "upstream_response_too_large")
        assert wait_for(upstream, tag, "closed_at", timeout=10), "the gateway kept reading the oversized answer"
    grown = peak_rss(pid) - before
    assert grown < 128 * MIB, f"the gateway's peak memory grew by {grown / MIB:.0f} MiB"


def test_an_event_above_the_cap_ends_the_stream_with_an_error_event(upstream, gw):
    """One SSE event of 16 MiB against the default 1 MiB event cap."""
    hostile = {"behaviour": "no_boundary", "bytes": 16 * MIB, "tag": "big-event"}
    response = httpx.post(gw.url + "/v1/chat/completions", json=chat_body(stream=True, hostile=hostile), timeout=60)
    assert response.status_code == 200
    data = sse_data(response.text)
    assert data[-1] == "[DONE]"
    assert json.loads(data[-2])["error"]["code"] == "upstream_event_too_large"
    assert wait_for(upstream, "big-event", "closed_at", timeout=10), "the gateway kept reading the stream"


def test_a_stream_without_event_boundaries_costs_linear_time(upstream, gateway):
    """24 MiB of one unfinished event in 16 KiB writes: rescanning the pending bytes per chunk would cost the gateway
    minutes of CPU (and stall every other request); one pass costs a fraction of a second."""
    gw = gateway({"pools": [pool("main", upstream.url, max_attempts=1, max_event_bytes=64 * MIB)]})
    httpx.post(gw.url + "/v1/chat/completions", json=chat_body(), timeout=30)
    cpu_before = cpu_seconds(gw.proc.pid)
    hostile = {"behaviour": "no_boundary", "bytes": 24 * MIB, "piece": 16 * 1024, "pause": 0.0005}
    with httpx.stream(
        "POST", gw.url + "/v1/chat/completions", json=chat_body(stream=True, hostile=hostile), timeout=60
    ) as response:
        assert response.status_code == 200
        health = httpx.get(gw.url + "/healthz", timeout=5)  # served while the stream is being framed
        text = response.read().decode()
    assert health.status_code == 200
    data = sse_data(text)
    assert json.loads(data[-2])["error"]["code"] == "upstream_stream_truncated" and data[-1] == "[DONE]"
    spent = cpu_seconds(gw.proc.pid) - cpu_before
    assert spent < 8.0, f"the gateway spent {spent:.1f} s of CPU framing a 24 MiB stream"


def test_every_sse_line_ending_is_framed(gw):
    """CR, LF and CRLF mixed, each byte of every line ending in its own TCP write (so CRLFs arrive cut in two)."""
    hostile = {
        "behaviour": "line_endings",
        "endings": ["\n\r\n", "\r\n\n", "\r\r", "\r\n\r\n", "\n\r", "\r\r\n"],
        "words": 4,
    }
    body = chat_body(stream=True, stream_options={"include_usage": True}, hostile=hostile)
    response = httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 200
    data = sse_data(response.text)
    assert data[-1] == "[DONE]", data
    chunks = [json.loads(d) for d in data[:-1]]
    assert not [c for c in chunks if "error" in c], chunks
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks if c["choices"]) == "w0 w1 w2 w3 "
    assert chunks[-1]["usage"]["completion_tokens"] == 4  # the usage event, read by the gateway, reached the client


def test_a_stream_that_starts_with_a_byte_order_mark_loses_none_of_its_first_event(gw):
    """A UTF-8 BOM before the first event (which the SSE specification has a reader ignore): that event's text
    reaches a Messages client of the chat pool, and its output counts for the bill, as any other event's does."""
    chunks = (
        {"choices": [{"index": 0, "delta": {"content": "Hi"}}]},
        {"choices": [{"index": 0, "delta": {"content": " there"}, "finish_reason": "stop"}]},
        {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 2}},
    )
    bom = "\u00ef\u00bb\u00bf"  # the hostile upstream writes its body as latin-1: these are the BOM's three bytes
    streamed = translated(gw.url, bom + events(*chunks), stream=True)
    sent = [json.loads(d) for d in sse_data(streamed.text)]
    assert [e["delta"]["text"] for e in sent if e["type"] == "content_block_delta"] == ["Hi", " there"], sent
    assert sent[-1]["type"] == "message_stop"

    relayed = httpx.post(
        gw.url + "/v1/chat/completions", json=chat_body(stream=True, hostile=garbage(bom + events(*chunks), True))
    )
    data = sse_data(relayed.text)
    assert relayed.text.startswith("data: ") and data[-1] == "[DONE]"  # no BOM for a client to trip on
    assert [json.loads(d)["choices"][0]["delta"]["content"] for d in data[:2]] == ["Hi", " there"]


def test_a_failed_responses_stream_is_charged_the_usage_it_reports(gw):
    """A Responses stream that ends in `response.failed` after some output, its Response reporting what the
    attempt used: the request is charged those counts, not the tokenizer's guess and the whole reservation."""
    failed = {
        "object": "response",
        "status": "failed",
        "error": {"code": "server_error", "message": "the model crashed"},
        "output": [],
        "usage": {"input_tokens": 5, "output_tokens": 3, "input_tokens_details": {"cached_tokens": 2}},
    }
    stream = [
        {"type": "response.created", "response": {"object": "response", "status": "in_progress"}},
        {"type": "response.output_text.delta", "output_index": 0, "content_index": 0, "delta": "Hi"},
        {"type": "response.failed", "response": failed},
    ]
    answer = "".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in stream)
    body = {"model": "test-model", "input": "hello", "stream": True, "max_output_tokens": 500}
    response = httpx.post(gw.url + "/v1/responses", json={**body, "hostile": garbage(answer, True)}, timeout=30)
    assert (response.status_code, response.text) == (200, answer)  # relayed as sent: the failure is its own end
    line = gw.access_log(response.headers["x-request-id"])
    assert line["stream_error"] == "upstream_error_event"
    assert (line["prompt_tokens"], line["completion_tokens"], line["cached_tokens"]) == (5, 3, 2), line


def test_upstream_errors_and_garbage_reach_the_client_openai_shaped(gw):
    def ask(hostile: dict, stream: bool = False) -> httpx.Response:
        return httpx.post(gw.url + "/v1/chat/completions", json=chat_body(stream=stream, hostile=hostile), timeout=30)

    html = assert_openai_error(ask({"behaviour": "html_502"}), 502, "upstream_bad_response")
    assert "<" not in html["message"] and html["type"] == "upstream_error"
    assert_openai_error(ask({"behaviour": "html_502"}, stream=True), 502, "upstream_bad_response")
    garbage = [
        (200, "not json at all", "text/plain"),
        (200, "[1, 2, 3]", "application/json"),
        (500, '{"detail": "boom"}', "application/json"),  # JSON, but no error object
        (400, '{"error": "just a string"}', "application/json"),
        (400, '{"error": {"message": "caf\u00e9 \u00ff\u00fe"}}', "application/json"),  # latin-1: not UTF-8
    ]
    for status, text, content_type in garbage:
        response = ask({"behaviour": "garbage", "status": status, "body": text, "content_type": content_type})
        assert_openai_error(response, 502, "upstream_bad_response")
        assert response.headers["content-type"] == "application/json"
    upstream_error = {
        "error": {
            "message": "This model's maximum context length is 8 tokens",
            "type": "invalid_request_error",
            "code": "context_length_exceeded",
            "param": None,
        }
    }
    for stream in (False, True):
        response = ask(
            {
                "behaviour": "garbage",
                "status": 400,
                "body": json.dumps(upstream_error),
                "content_type": "application/json",
            },
            stream=stream,
        )
        assert response.json() == upstream_error and response.status_code == 400
    overloaded = {
        "behaviour": "garbage",
        "status": 503,
        "content_type": "application/json",
        "body": json.dumps({"error": {"message": "engine overloaded", "code": 503}}),
    }
    error = assert_openai_error(ask(overloaded), 503, "503")
    assert error["message"] == "engine overloaded" and error["type"] == "upstream_error"
    # the upstream judged the pool's key, not the client's: a 401 would tell the client its own key is wrong, and
    # OpenAI's message quotes part of the key it refused
    refused = {
        "behaviour": "garbage",
        "status": 401,
        "content_type": "application/json",
        "body": json.dumps(
            {
                "error": {
                    "message": "Incorrect API key provided: sk-pool***cret",
                    "type": "invalid_request_error",
                    "code": "invalid_api_key",
                }
            }
        ),
    }
    error = assert_openai_error(ask(refused), 502, "upstream_auth_failed")
    assert "sk-pool" not in error["message"]


def test_stream_headers_go_out_when_the_upstream_answers(upstream, gw):
    """The upstream answers 200 at once and sends its first event after 2.5 s (a long prefill)."""
    hostile = {"behaviour": "slow_first", "delay": 2.5, "tag": "slow"}
    started = time.monotonic()
    with httpx.stream(
        "POST", gw.url + "/v1/chat/completions", json=chat_body(stream=True, hostile=hostile), timeout=30
    ) as response:
        headers_after = time.monotonic() - started
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        text = response.read().decode()
    assert upstream_seen(upstream, "slow")["answered"]
    assert headers_after < 1.8, f"the client waited {headers_after:.1f} s for its headers"
    data = sse_data(text)
    assert (
        data[-1] == "[DONE]"
        and "".join(json.loads(d)["choices"][0]["delta"]["content"] for d in data[:-1]) == "w0 w1 w2 "
    )


def garbage(body: str, stream: bool) -> dict:
    """What the hostile upstream answers: `body`, as sent, under a 200."""
    content_type = "text/event-stream" if stream else "application/json"
    return {"behaviour": "garbage", "status": 200, "body": body, "content_type": content_type}


def events(*data: dict) -> str:
    """A chat stream of these chunks, ended by [DONE]."""
    return "".join(f"data: {json.dumps(d)}\n\n" for d in data) + "data: [DONE]\n\n"


def translated(url: str, answer: str, stream: bool, **extra: object) -> httpx.Response:
    """A Messages request (with `extra` fields) to an OpenAI pool whose answer is `answer`."""
    body = {
        "model": "test-model",
        "max_tokens": 8,
        "stream": stream,
        "messages": [{"role": "user", "content": "hello"}],
        "metadata": {"user_id": json.dumps(garbage(answer, stream))},  # the translation keeps no `hostile`
        **extra,
    }
    return httpx.post(url + "/v1/messages", json=body, timeout=30)


def test_answers_of_the_wrong_shape_are_relayed_or_refused_in_each_routes_own_shape(gw):
    """JSON objects that are not the answers they claim to be (`choices` a number, a Response's `output` a number,
    an event `type` a list). What is relayed as sent reaches the client as sent; an event no client could dispatch
    (its type not a string) ends the stream with the route's error event, unrelayed; what the gateway translates for
    a Messages client fails in Anthropic's shape: a 502 body, or an error event that ends the stream. Never a 500,
    and never a stream cut without its error event."""
    mark = log_mark(gw)

    def relayed(path: str, body: dict, answer: str, stream: bool) -> None:
        response = httpx.post(gw.url + path, json={**body, "hostile": garbage(answer, stream)}, timeout=30)
        assert (response.status_code, response.text) == (200, answer)

    not_a_list = {"id": "cmpl-hostile", "choices": 5}
    relayed("/v1/chat/completions", chat_body(), json.dumps(not_a_list), stream=False)
    relayed("/v1/chat/completions", chat_body(stream=True), events(not_a_list), stream=True)
    responses = {"model": "test-model", "input": "hello", "stream": True}
    final = {"type": "response.completed", "response": {"object": "response", "output": 5}}
    relayed("/v1/responses", responses, events(final), stream=True)
    untyped = httpx.post(
        gw.url + "/v1/responses",
        json={**responses, "hostile": garbage(events({"type": ["response.completed"]}, final), True)},
        timeout=30,
    )
    assert untyped.status_code == 200
    [error] = [json.loads(d) for d in sse_data(untyped.text)]
    assert error["type"] == "error" and error["code"] == "upstream_bad_event", untyped.text

    answer = translated(gw.url, json.dumps(not_a_list), stream=False)
    assert answer.status_code == 502
    assert answer.json()["type"] == "error" and answer.json()["error"]["type"] == "api_error"
    streamed = translated(gw.url, events(not_a_list), stream=True)
    assert streamed.status_code == 200
    last = json.loads(sse_data(streamed.text)[-1])
    assert last["type"] == "error" and last["error"]["type"] == "api_error", streamed.text
    log = gw.output()[mark:]
    assert "Traceback" not in log and "unhandled error" not in log


def test_a_translated_answer_carries_no_field_of_the_wrong_type(gw):
    """Text that is not a string and usage counts that are not counts (as charging judges them), in a chat answer
    translated for a Messages client: the text is absent and the counts are 0, in the body and in the stream."""
    usage = {"prompt_tokens": 1.5, "completion_tokens": -3}
    answer = {"choices": [{"message": {"content": 5}, "finish_reason": "stop"}], "usage": usage}
    message = translated(gw.url, json.dumps(answer), stream=False)
    assert message.status_code == 200, message.text
    assert message.json()["content"] == []
    assert (message.json()["usage"]["input_tokens"], message.json()["usage"]["output_tokens"]) == (0, 0)

    chunks = (
        {"choices": [{"index": 0, "delta": {"content": 5}}]},
        {"choices": [{"index": 0, "delta": {"content": "w0"}, "finish_reason": "stop"}]},
        {"choices": [], "usage": {"prompt_tokens": "7", "completion_tokens": "1"}},
    )
    streamed = translated(gw.url, events(*chunks), stream=True)
    sent = [json.loads(d) for d in sse_data(streamed.text)]
    assert [e["delta"]["text"] for e in sent if e["type"] == "content_block_delta"] == ["w0"], streamed.text
    [delta] = [e for e in sent if e["type"] == "message_delta"]
    assert (delta["usage"]["input_tokens"], delta["usage"]["output_tokens"]) == (0, 0)
    assert sent[-1]["type"] == "message_stop"


def test_a_replica_whose_metrics_say_infinity_stops_no_health_checks(hostile_upstream, gateway):
    """`+Inf` is valid Prometheus text but no count of requests: that scrape fails, as a NaN's does, and the scrapes
    of the pool go on (had it stopped them, no replica of the pool would be ejected or re-admitted again)."""
    broken = hostile_upstream(metrics="vllm:num_requests_running +Inf\n")
    healthy = hostile_upstream(metrics="vllm:num_requests_running 0\n")
    gw = gateway(
        {
            "pools": [
                pool(
                    "main",
                    broken.url,
                    healthy.url,
                    routing="least_load",
                    scrape_interval=0.1,
                    health={"failures_to_eject": 2, "eject_seconds": 60},
                )
            ]
        }
    )
    time.sleep(1.0)  # several scrapes: the broken replica is ejected
    for _ in range(6):
        assert httpx.post(gw.url + "/v1/chat/completions", json=chat_body(), timeout=10).status_code == 200
    served = [httpx.get(p.url + "/_stats").json()["requests"] for p in (broken, healthy)]
    assert served == [0, 6]


def test_a_translated_answer_keeps_its_reasoning_as_thinking_when_the_request_asked(gw):
    """A Messages client that asks for extended thinking, in front of a chat pool whose model reasons (vLLM's
    `reasoning_content`), gets the reasoning as a thinking block, whole or streamed; one that did not ask gets none."""
    base = {"id": "chatcmpl-r", "object": "chat.completion", "model": "test-model"}
    whole = {
        **base,
        "choices": [
            {
                "index": 0,
                "finish_reason": "stop",
                "message": {"role": "assistant", "reasoning_content": "2 + 2 is 4", "content": "4"},
            }
        ],
    }
    chunk = {**base, "object": "chat.completion.chunk"}
    streamed = events(
        {**chunk, "choices": [{"index": 0, "delta": {"role": "assistant", "reasoning_content": "2 + 2 is 4"}}]},
        {**chunk, "choices": [{"index": 0, "delta": {"content": "4"}, "finish_reason": "stop"}]},
    )

    def ask(answer: str, stream: bool, thinking: bool) -> httpx.Response:
        asked = {"max_tokens": 2048, "thinking": {"type": "enabled", "budget_tokens": 1024}} if thinking else {}
        response = translated(gw.url, answer, stream, **asked)
        assert response.status_code == 200, response.text
        return response

    message = ask(json.dumps(whole), stream=False, thinking=True).json()
    assert [(b["type"], b.get("thinking", b.get("text"))) for b in message["content"]] == [
        ("thinking", "2 + 2 is 4"),
        ("text", "4"),
    ]
    assert [b["type"] for b in ask(json.dumps(whole), stream=False, thinking=False).json()["content"]] == ["text"]
    starts = [
        json.loads(d)["content_block"]["type"]
        for d in sse_data(ask(streamed, stream=True, thinking=True).text)
        if json.loads(d)["type"] == "content_block_start"
    ]
    assert starts == ["thinking", "text"]


def upstream_errors(gw: Process) -> list[str]:
    """The gateway's upstream error counters, once two reads 0.2 s apart agree (an earlier test's last count is in)."""

    def read() -> list[str]:
        text = gw.admin.get("/metrics").text
        return [line for line in text.splitlines() if line.startswith("portcullis_upstream_errors_total{")]

    last, now = None, read()
    while now != last:
        time.sleep(0.2)
        last, now = now, read()
    return now


def test_a_pooled_connection_closed_as_a_request_goes_out_is_sent_again_not_failed(upstream, gw):
    """An upstream whose idle timeout closes a kept connection just as the gateway reuses it: the request never
    reached it, so it is sent again on a new connection, and neither the client nor the replica's health pays."""
    dropped, errors = httpx.get(upstream.url + "/_stats").json()["dropped"], upstream_errors(gw)
    first = httpx.post(gw.url + "/v1/chat/completions", json=chat_body(hostile={"behaviour": "idle_close"}))
    assert first.status_code == 200, first.text
    for _ in range(3):  # each follows an idle_close answer on the connection it left open
        again = httpx.post(gw.url + "/v1/chat/completions", json=chat_body(hostile={"behaviour": "idle_close"}))
        assert again.status_code == 200, again.text
    assert httpx.get(upstream.url + "/_stats").json()["dropped"] - dropped == 3
    assert upstream_errors(gw) == errors  # no upstream error counted, of any kind


def test_an_upstream_error_event_ends_the_stream_with_no_second_error(gw):
    """An upstream that reports its failure in the stream and then closes without [DONE]: its error event is the
    stream's end, in the client's shape; the gateway adds no 'truncated' error of its own after it."""
    chunk = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "test-model"}
    answer = (
        f"data: {json.dumps({**chunk, 'choices': [{'index': 0, 'delta': {'content': 'Hi'}}]})}\n\n"
        f"data: {json.dumps({'error': {'message': 'the model is overloaded', 'type': 'server_error'}})}\n\n"
    )
    chat = httpx.post(
        gw.url + "/v1/chat/completions", json=chat_body(stream=True, hostile=garbage(answer, True)), timeout=30
    )
    errors = [d for d in sse_data(chat.text) if '"error"' in d]
    assert len(errors) == 1 and "overloaded" in errors[0], chat.text
    assert gw.access_log(chat.headers["x-request-id"])["stream_error"] == "upstream_error_event"
    messages = translated(gw.url, answer, stream=True)
    errors = [d for d in sse_data(messages.text) if json.loads(d)["type"] == "error"]
    assert len(errors) == 1, messages.text
    assert gw.access_log(messages.headers["x-request-id"])["stream_error"] == "upstream_error_event"
