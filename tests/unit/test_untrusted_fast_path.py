"""The untrusted strings' fast path (`Inventory.quiet`) against the full walk: for every event of a corpus, hostile
ones included, a format's `untrusted()` gives exactly what the walk gives, string for string, so the shortcut the
common stream event takes can never drift into reading less than the walk reads."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from gateway.apis.answers import AnswerFormat, MessagesFormat, ResponsesFormat
from gateway.apis.untrusted import QUIET_DEPTH, Identifier, place_of

KEY = "AKIAIOSFODNN7EXAMPLE"
BASE64 = "QUtJQUlPU0ZPRE5ON0VYQU1QTEU="


def nested(depth: int, leaf: Any) -> Any:
    for _ in range(depth):
        leaf = {"x": leaf}
    return leaf


def chunk(delta: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """A chat chunk as OpenAI and vLLM send it, with `extra` fields at its top or, as `choice`, in its choice."""
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None, **extra.pop("choice", {})}
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "system_fingerprint": "fp_1",
        "choices": [choice],
        **extra,
    }


def call(**function: Any) -> dict[str, Any]:
    return {"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": function}]}


CHAT: list[dict[str, Any]] = [
    chunk({"content": "the "}),
    chunk({"role": "assistant", "content": ""}),
    chunk({"content": "hi", "x_note": KEY}),  # a field a server added next to the text
    chunk({"content": "hi"}, provider_note="text"),
    chunk({"content": "hi"}, id={"nested": "text"}),  # an identifier's key holding an object
    chunk({"content": "hi"}, choice={"finish_reason": {"why": KEY}}),
    chunk({"content": "hi", "choices.0.delta.content": KEY, "choices[]": KEY, "a\x00b": KEY, "": KEY}),
    chunk({"content": "hi"}, choice={"logprobs": {"content": [{"token": "AK", "logprob": -0.1, "bytes": [65]}]}}),
    chunk(call(name="send", arguments='{"to": "')),
    chunk({"tool_calls": [{"index": 0, "function": {"arguments": "pl"}}]}),  # a call's next fragment
    chunk(call(arguments="x\\u0041", name={"deep": KEY})),
    chunk({"audio": {"id": "a1", "data": BASE64, "transcript": "words"}}),
    chunk({"audio": {"data": "not base64!"}}),
    chunk({"content": "hi"}, obfuscation=BASE64),
    chunk({"content": "hi"}, obfuscation="not base64 at all"),
    chunk({"reasoning_content": "thinking", "reasoning": KEY}),
    chunk({"refusal": "no", "content": None}),
    chunk({"content": "hi", "extra": {"id": KEY, "inner": [KEY, 1, None, {"model": "m2"}]}}),
    chunk({"content": "hi", "deep": nested(QUIET_DEPTH + 2, KEY)}),
    chunk({"content": "hi", "deep": nested(QUIET_DEPTH - 4, 5)}),
    chunk({"content": "hi", "deep": nested(2000, KEY)}),  # deeper than any recursion limit allows
    chunk({"content": "hi"}, usage={"prompt_tokens": 1, "completion_tokens_details": {"note": KEY}}),
    chunk({"content": "chatcmpl-1"}, stop_reason="STOP", kv_transfer_params={"handle": "h"}),
    chunk({"content": "hi"}, choice={"index": True, "text": "legacy"}),
    {"id": "c", "choices": "not a list", "note": [KEY, [KEY]]},
    {"id": "c", "choices": ["a string", 3, None, [KEY]]},
    {"choices": [{"index": 0, "text": "completion text", "logprobs": {"tokens": ["a", KEY]}}]},
    {"error": {"message": KEY, "type": "server_error", "code": None}},
    {},
]

RESPONSES: list[dict[str, Any]] = [
    {
        "type": "response.output_text.delta",
        "item_id": "msg_1",
        "output_index": 0,
        "content_index": 0,
        "delta": "the ",
        "sequence_number": 7,
    },
    {"type": "response.output_text.delta", "item_id": "msg_1", "delta": "x", "obfuscation": "AbC1"},
    {"type": "response.output_text.delta", "item_id": "msg_1", "delta": "x", "obfuscation": "not base64!"},
    {"type": "response.output_text.delta", "delta": "x", "logprobs": [{"token": KEY, "top_logprobs": []}]},
    {"type": "response.output_text.delta", "delta": "x", "item_id": {"x": KEY}, "extra": KEY},
    {"type": "response.new_feature.delta", "output_index": 1, "delta": KEY},
    {"type": "response.output_text.done", "output_index": 0, "content_index": 0, "text": "the whole"},
    {"type": "response.audio.delta", "delta": BASE64},
    {"type": "response.audio.delta", "delta": "spoken words"},
    {
        "type": "response.created",
        "response": {
            "id": "resp_1",
            "object": "response",
            "model": "m",
            "status": "in_progress",
            "instructions": "the request's own",
            "metadata": {"k": "v"},
            "tools": [{"type": "function", "name": "send", "description": "d"}],
            "output": [],
            "note": KEY,
        },
    },
    {
        "type": "response.output_item.added",
        "output_index": 0,
        "item": {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "send", "arguments": '{"a"'},
    },
    {
        "type": "response.output_item.added",
        "output_index": 1,
        "item": {"type": "reasoning", "id": "rs_1", "encrypted_content": "not base64!", "summary": []},
    },
    {"type": "error", "code": "server_error", "message": KEY, "param": None},
    {"type": 5, "delta": KEY},
    {"type": "response.output_text.delta", "delta": "x", "deep": nested(2000, KEY)},
]

MESSAGES: list[dict[str, Any]] = [
    {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "the "}},
    {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "x", "extra": KEY}},
    {"type": "content_block_delta", "index": 0, "delta": {"type": "citations_delta", "citation": {"cited_text": KEY}}},
    {"type": "content_block_delta", "index": 0, "delta": {"type": "signature_delta", "signature": BASE64}},
    {"type": "content_block_delta", "index": 0, "delta": {"type": "signature_delta", "signature": "not base64!"}},
    {"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": '{"q'}},
    {"type": "content_block_start", "index": 1, "content_block": {"type": "tool_use", "id": "t1", "input": {}}},
    {
        "type": "content_block_start",
        "index": 1,
        "content_block": {"type": "tool_use", "id": "t1", "name": "f", "input": {"q": KEY, "n": [KEY]}},
    },
    {
        "type": "message_start",
        "message": {"id": "msg_1", "type": "message", "role": "assistant", "model": "m", "content": [], "note": KEY},
    },
    {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None}, "usage": {"x": 1}},
    {"type": "ping"},
    {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "x"}, "deep": nested(50, KEY)},
]

CORPUS: list[tuple[str, Callable[[], AnswerFormat], dict[str, Any]]] = [
    *(("chat", AnswerFormat, event) for event in CHAT),
    *(("chat without reasoning", lambda: AnswerFormat(reasoning=False), event) for event in CHAT),
    *(("responses", ResponsesFormat, event) for event in RESPONSES),
    *(("messages", MessagesFormat, event) for event in MESSAGES),
]


def read(answers: AnswerFormat, event: dict[str, Any], *, whole: bool) -> set[Any]:
    """The places of the texts the format reads itself, as the output guard gathers them."""
    texts = answers.body_texts(event) if whole else [*answers.texts(event), *answers.snapshots(event)]
    return {place_of(holder, key) for _, holder, key in texts}


def identifiers(answers: AnswerFormat, event: dict[str, Any]) -> set[str]:
    """Every identifier value the walk reads in the event (as if the stream had read them all before)."""
    found = answers._inventory.walk(event, set(), (), whole=False)
    return {holder[key] for channel, holder, key in found if isinstance(channel, Identifier)}


@pytest.mark.parametrize("whole", [False, True], ids=["stream", "whole"])
@pytest.mark.parametrize("seen", ["nothing", "its identifiers", "some"])
@pytest.mark.parametrize(("name", "make", "event"), CORPUS, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(CORPUS)])
def test_untrusted_reads_what_the_walk_reads(name, make, event, seen, whole):
    answers = make().for_stream()
    values = identifiers(make(), event)
    seen_values = {"nothing": set(), "its identifiers": values, "some": set(sorted(values)[::2])}[seen]
    known = read(answers, event, whole=whole)
    fast = [
        (channel, id(holder), key) for channel, holder, key in answers.untrusted(event, known, seen_values, whole=whole)
    ]
    walk = [
        (channel, id(holder), key)
        for channel, holder, key in answers._inventory.walk(event, known, seen_values, whole=whole)
    ]
    assert fast == walk


@pytest.mark.parametrize(
    ("make", "event"),
    [
        (AnswerFormat, CHAT[0]),
        (AnswerFormat, chunk({"content": "the "}, obfuscation="aZ3k9")),
        (AnswerFormat, CHAT[9]),
        (ResponsesFormat, RESPONSES[0]),
        (MessagesFormat, MESSAGES[0]),
    ],
    ids=["chat content", "chat content padded", "chat tool arguments", "responses text", "messages text"],
)
def test_the_common_stream_events_take_the_fast_path(make, event):
    """Once a stream's ids were read, a delta of known text holds nothing else: the walk is not needed for it."""
    answers = make().for_stream()
    seen = identifiers(answers, event)
    assert answers._inventory.quiet(event, read(answers, event, whole=False), seen)
    assert not answers._inventory.quiet(event, read(answers, event, whole=False), set())
