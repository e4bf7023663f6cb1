"""A streaming upstream's line that is no event of the route's format (not JSON, binary, a line that is no SSE field,
data of the wrong shape) never reaches the client: the stream ends there with the route's own error event, and the
gateway lets the upstream go. Comments, pings and `[DONE]` still pass.

Every streaming route is covered: chat, completions, Responses, Messages (sent as it is to an Anthropic pool, and
translated for an OpenAI one).

The module runs one gateway in front of one hostile upstream (tests/hostile/hostile_upstream.py): an OpenAI pool that
takes every model, and an Anthropic pool for `claude-test`, whose /v1/messages requests go as sent. Each answer's
events are written one per write (`written`), so the garbage comes in a read of its own, after valid events the
client has been sent, and valid events follow it that must not be relayed either. Each test reads its own tags.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.conftest import Launcher, Process, chat_body, pool
from tests.hostile.conftest import wait_for

ANTHROPIC_MODEL = "claude-test"
DONE = "data: [DONE]\n\n"

# (what, the bytes the upstream writes, as latin-1), bad in every route's format
GARBAGE = [
    ("data that is not JSON", "data: {not json\n\n"),
    ("binary bytes", "\x00\x01\xfe\xff garbage\n\n"),
    ("a data line of bytes that are not UTF-8", "data: \xff\xfe\xfd\n\n"),
    ("JSON that is not an object", "data: [1, 2, 3]\n\n"),
    ("a line that is no SSE field", "dtaa: {}\n\n"),
    ("a comment that is not UTF-8", ": \xff\xfe\n\n"),
]
# bad in the typed formats (Responses, Messages), whose clients dispatch an event by its type
UNTYPED = [
    ("an event without a type", 'data: {"delta": "no type"}\n\n'),
    ("an event whose type is not a string", 'data: {"type": ["response.completed"]}\n\n'),
    ("an event named otherwise than its type", 'event: message_stop\ndata: {"type": "ping"}\n\n'),
]


@pytest.fixture(scope="module")
def upstream(module_hostile_upstream) -> Process:
    return module_hostile_upstream()


@pytest.fixture(scope="module")
def gw(module_launcher: Launcher, upstream: Process) -> Process:
    """`stream_idle` of 1 s: a gateway that waits on after the garbage ends the stream then, not minutes later."""
    options = {"max_attempts": 1, "timeouts": {"stream_idle": 1.0}}
    return module_launcher.gateway(
        {
            "pools": [
                pool("anthropic", upstream.url, api="anthropic", models=[ANTHROPIC_MODEL], **options),
                pool("main", upstream.url, **options),
            ]
        }
    )


def written(tag: str, *events: str, hold: bool = True) -> dict:
    """The answer `events`, each in a write of its own; `hold`: the upstream keeps the connection open after them."""
    return {"behaviour": "written", "events": list(events), "tag": tag, "hold": hold}


def sse(name: str | None, data: dict | str) -> str:
    text = data if isinstance(data, str) else json.dumps(data)
    return (f"event: {name}\n" if name else "") + f"data: {text}\n\n"


def typed(data: dict) -> str:
    return sse(data["type"], data)


def data_fields(text: str) -> list[str]:
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


def assert_cut_at_the_garbage(upstream: Process, tag: str, response: httpx.Response, garbage: str) -> None:
    """The garbage is nowhere in what the client got, and the gateway stopped reading the upstream: it holds its
    connection open after the garbage, so only the gateway's close ends it."""
    assert response.status_code == 200, response.text
    bad = garbage.strip("\n").encode("latin-1")
    assert bad not in response.content, response.content
    assert wait_for(upstream, tag, "closed_at", timeout=5), "the gateway kept reading the upstream"


def chat_chunk(content: str, finish: str | None = None) -> dict:
    return {
        "id": "c1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "test-model",
        "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": finish}],
    }


@pytest.mark.parametrize(("what", "garbage"), GARBAGE, ids=[w for w, _ in GARBAGE])
def test_a_chat_stream_ends_at_a_line_that_is_no_chunk(upstream, gw, what, garbage):
    tag = f"chat {what}"
    events = (
        ": keep-alive\n\n",
        sse(None, chat_chunk("Hi")),
        garbage,
        sse(None, chat_chunk(" there", "stop")),
        DONE,
    )
    response = httpx.post(
        gw.url + "/v1/chat/completions", json=chat_body(stream=True, hostile=written(tag, *events)), timeout=30
    )
    assert_cut_at_the_garbage(upstream, tag, response, garbage)
    assert response.text.startswith(": keep-alive\n\n"), response.text  # a comment is relayed as it came
    data = data_fields(response.text)
    assert len(data) == 3 and data[-1] == "[DONE]", response.text
    assert json.loads(data[0])["choices"][0]["delta"]["content"] == "Hi"
    assert json.loads(data[1])["error"]["code"] == "upstream_bad_event"
    assert gw.access_log(response.headers["x-request-id"])["stream_error"] == "upstream_bad_event"


def test_a_chat_stream_of_chunks_comments_and_done_is_relayed_as_it_came(upstream, gw):
    """What the check lets pass: every event of a well-formed stream, byte for byte."""
    events = (": ping\n\n", sse(None, chat_chunk("Hi")), sse(None, chat_chunk(" there", "stop")), DONE)
    body = chat_body(
        stream=True, stream_options={"include_usage": False}, hostile=written("chat fine", *events, hold=False)
    )
    response = httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=30)
    assert (response.status_code, response.text) == (200, "".join(events))


def completion_chunk(text: str, finish: str | None = None) -> dict:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "test-model", "choices": [choice]}


@pytest.mark.parametrize(("what", "garbage"), GARBAGE, ids=[w for w, _ in GARBAGE])
def test_a_completions_stream_ends_at_a_line_that_is_no_chunk(upstream, gw, what, garbage):
    tag = f"completions {what}"
    events = (sse(None, completion_chunk("Hi")), garbage, sse(None, completion_chunk(" there", "stop")), DONE)
    body = {"model": "test-model", "prompt": "hello", "stream": True, "hostile": written(tag, *events)}
    response = httpx.post(gw.url + "/v1/completions", json=body, timeout=30)
    assert_cut_at_the_garbage(upstream, tag, response, garbage)
    data = data_fields(response.text)
    assert len(data) == 3 and data[-1] == "[DONE]", response.text
    assert json.loads(data[0])["choices"][0]["text"] == "Hi"
    assert json.loads(data[1])["error"]["code"] == "upstream_bad_event"


RESPONSE = {"id": "resp_1", "object": "response", "status": "in_progress", "output": []}


@pytest.mark.parametrize(("what", "garbage"), GARBAGE + UNTYPED, ids=[w for w, _ in GARBAGE + UNTYPED])
def test_a_responses_stream_ends_at_a_line_that_is_no_event(upstream, gw, what, garbage):
    tag = f"responses {what}"
    events = (
        typed({"type": "response.created", "sequence_number": 0, "response": RESPONSE}),
        typed(
            {
                "type": "response.output_text.delta",
                "sequence_number": 1,
                "output_index": 0,
                "content_index": 0,
                "delta": "Hi",
            }
        ),
        garbage,
        typed({"type": "response.completed", "sequence_number": 2, "response": {**RESPONSE, "status": "completed"}}),
    )
    body = {"model": "test-model", "input": "hello", "stream": True, "hostile": written(tag, *events)}
    response = httpx.post(gw.url + "/v1/responses", json=body, timeout=30)
    assert_cut_at_the_garbage(upstream, tag, response, garbage)
    sent = [json.loads(d) for d in data_fields(response.text)]
    assert [e["type"] for e in sent] == ["response.created", "response.output_text.delta", "error"], response.text
    assert sent[-1]["code"] == "upstream_bad_event"
    assert response.text.endswith("\n\n") and "[DONE]" not in response.text


MESSAGE = {
    "id": "msg_1",
    "type": "message",
    "role": "assistant",
    "model": ANTHROPIC_MODEL,
    "content": [],
    "stop_reason": None,
    "usage": {"input_tokens": 5, "output_tokens": 1},
}
MESSAGES_START = (
    typed({"type": "message_start", "message": MESSAGE}),
    typed({"type": "ping"}),
    typed({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
    typed({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hi"}}),
)
MESSAGES_END = (
    typed({"type": "content_block_stop", "index": 0}),
    typed({"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 2}}),
    typed({"type": "message_stop"}),
)
# a chat stream's end is no event of Anthropic's
NOT_MESSAGES = [("a chat stream's end", DONE)]


def messages_request(model: str, hostile: dict) -> dict:
    body = {"model": model, "max_tokens": 8, "stream": True, "messages": [{"role": "user", "content": "hello"}]}
    if model == ANTHROPIC_MODEL:
        return {**body, "hostile": hostile}  # sent as it is
    return {**body, "metadata": {"user_id": json.dumps(hostile)}}  # the translation keeps no `hostile`


def assert_anthropic_error_last(response: httpx.Response) -> list[dict]:
    sent = [json.loads(d) for d in data_fields(response.text)]
    last = sent[-1]
    assert last["type"] == "error" and last["error"]["type"] == "api_error", response.text
    assert response.text.rsplit("\n\n", 2)[-2].startswith("event: error\n"), response.text
    return sent


@pytest.mark.parametrize(
    ("what", "garbage"), GARBAGE + UNTYPED + NOT_MESSAGES, ids=[w for w, _ in GARBAGE + UNTYPED + NOT_MESSAGES]
)
def test_an_anthropic_stream_ends_at_a_line_that_is_no_event(upstream, gw, what, garbage):
    tag = f"messages {what}"
    events = (*MESSAGES_START, garbage, *MESSAGES_END)
    response = httpx.post(
        gw.url + "/v1/messages", json=messages_request(ANTHROPIC_MODEL, written(tag, *events)), timeout=30
    )
    assert_cut_at_the_garbage(upstream, tag, response, garbage)
    sent = assert_anthropic_error_last(response)
    types = ["message_start", "ping", "content_block_start", "content_block_delta", "error"]
    assert [e["type"] for e in sent] == types, response.text


def test_an_anthropic_stream_of_events_and_pings_is_relayed_as_it_came(upstream, gw):
    events = (*MESSAGES_START, ": keep-alive\n\n", *MESSAGES_END)
    response = httpx.post(
        gw.url + "/v1/messages",
        json=messages_request(ANTHROPIC_MODEL, written("messages fine", *events, hold=False)),
        timeout=30,
    )
    assert (response.status_code, response.text) == (200, "".join(events))


@pytest.mark.parametrize(("what", "garbage"), GARBAGE, ids=[w for w, _ in GARBAGE])
def test_a_chat_stream_translated_for_a_messages_client_ends_at_a_line_that_is_no_chunk(upstream, gw, what, garbage):
    tag = f"translated {what}"
    events = (sse(None, chat_chunk("Hi")), garbage, sse(None, chat_chunk(" there", "stop")), DONE)
    response = httpx.post(gw.url + "/v1/messages", json=messages_request("test-model", written(tag, *events)))
    assert_cut_at_the_garbage(upstream, tag, response, garbage)
    sent = assert_anthropic_error_last(response)
    assert [e["delta"]["text"] for e in sent if e["type"] == "content_block_delta"] == ["Hi"], response.text
    assert "message_stop" not in [e["type"] for e in sent]
