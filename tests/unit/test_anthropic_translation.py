"""Anthropic Messages <-> OpenAI chat translation, checked on the payloads recorded from the public references
(tests/api_reference/README.md names each source) and then by the official `anthropic` SDK: its models must accept
what comes out, its stream accumulator must build the expected message from our events, and its client must read
them off a real socket as it reads Anthropic's API."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import anthropic
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message, RawMessageStreamEvent
from anthropic.types.shared import ErrorResponse
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import TypeAdapter

from gateway.apis.anthropic.checks import MessagesRequestError, check_messages_request
from gateway.apis.anthropic.errors import anthropic_error, anthropic_error_type
from gateway.apis.anthropic.from_chat import MAX_HELD_CHARS, ChatStreamToMessages, chat_to_message
from gateway.apis.anthropic.to_chat import messages_to_chat

REFERENCE = Path(__file__).resolve().parent.parent / "api_reference"
STREAM_EVENT = TypeAdapter(RawMessageStreamEvent)


def reference(name: str) -> Any:
    return json.loads((REFERENCE / name).read_text())


def sse_data(raw: bytes) -> list[tuple[str | None, Any]]:
    """(event name, parsed data) of each event in an SSE byte stream; `[DONE]` is left out."""
    events = []
    for block in raw.replace(b"\r\n", b"\n").split(b"\n\n"):
        name, data = None, None
        for line in block.split(b"\n"):
            if line.startswith(b"event:"):
                name = line[6:].strip().decode()
            elif line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                data = json.loads(line[5:])
        if data is not None:
            events.append((name, data))
    return events


def recorded_chunks(name: str) -> list[dict[str, Any]]:
    return [data for _, data in sse_data((REFERENCE / name).read_bytes())]


def translated_bytes(chunks: list[dict[str, Any]], **options: Any) -> bytes:
    """Our stream's bytes for a chat stream, as the gateway sends them."""
    translator = ChatStreamToMessages("claude-on-vllm", **options)
    return b"".join(event for chunk in chunks for event in translator.feed(chunk)) + b"".join(translator.finish())


def translate_stream(chunks: list[dict[str, Any]], **options: Any) -> list[dict[str, Any]]:
    """Our events for a chat stream, each checked as SSE: its event name is its data's type."""
    events = sse_data(translated_bytes(chunks, **options))
    assert all(name == data["type"] for name, data in events)
    return [data for _, data in events]


def accumulate(events: list[dict[str, Any]]) -> Message:
    """The SDK's own accumulation of stream events into the final message (anthropic.lib.streaming)."""
    snapshot, buffers = None, {}
    for data in events:
        if data["type"] in ("ping", "error"):
            continue
        snapshot = accumulate_event(
            event=STREAM_EVENT.validate_python(data), current_snapshot=snapshot, json_bufs=buffers
        )
    assert snapshot is not None
    return Message.model_validate(snapshot.model_dump())


def collapsed_types(events: list[dict[str, Any]]) -> list[str]:
    """The event types in order, runs of one type collapsed and pings left out: the stream's grammar."""
    types: list[str] = []
    for data in events:
        if data["type"] != "ping" and (not types or types[-1] != data["type"]):
            types.append(data["type"])
    return types


# --- request: Messages -> chat ---------------------------------------------------------------------------------


def test_conversation_request_field_by_field():
    request = reference("anthropic_request_conversation.json")
    check_messages_request(request)
    chat = messages_to_chat(request)
    turns = request["messages"]
    weather_calls = turns[5]["content"][1:]

    assert chat["model"] == request["model"] and chat["max_tokens"] == request["max_tokens"]
    assert chat["messages"][0] == {"role": "system", "content": request["system"][0]["text"]}
    assert chat["messages"][1] == {
        "role": "user",
        "content": [
            {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,/9j/4AAQSkZJRg..."}},
            {"type": "text", "text": "What is in this image?"},
        ],
    }
    assert chat["messages"][2] == {"role": "assistant", "content": turns[1]["content"]}
    assert chat["messages"][3]["content"][0] == {
        "type": "image_url",
        "image_url": {"url": turns[2]["content"][0]["source"]["url"]},
    }
    assert chat["messages"][4] == {"role": "assistant", "content": "It is the same ant."}
    assert chat["messages"][5] == {"role": "user", "content": turns[4]["content"]}
    assistant = chat["messages"][6]
    assert assistant["role"] == "assistant" and assistant["content"] == turns[5]["content"][0]["text"]
    assert [(c["id"], c["type"], c["function"]["name"]) for c in assistant["tool_calls"]] == [
        (call["id"], "function", call["name"]) for call in weather_calls
    ]
    assert [json.loads(c["function"]["arguments"]) for c in assistant["tool_calls"]] == [
        call["input"] for call in weather_calls
    ]
    assert chat["messages"][7:] == [
        {"role": "tool", "tool_call_id": "toolu_01A09q90qw90lq917835lq9", "content": "15 degrees"},
        {
            "role": "tool",
            "tool_call_id": "toolu_01B09q90qw90lq917835lq9",
            "content": "Error: ConnectionError: the weather service API is not available (HTTP 500)",
        },
        {"role": "user", "content": "And what should I wear?"},
    ]
    tool = request["tools"][0]
    assert chat["tools"] == [
        {
            "type": "function",
            "function": {"name": tool["name"], "description": tool["description"], "parameters": tool["input_schema"]},
        }
    ]
    assert chat["tool_choice"] == "auto" and chat["parallel_tool_calls"] is False
    assert chat["stop"] == request["stop_sequences"]
    assert (chat["temperature"], chat["top_p"], chat["top_k"]) == (0.7, 0.7, 5)
    assert chat["user"] == request["metadata"]["user_id"]
    assert "stream" not in chat and "stream_options" not in chat


def test_tools_request_has_the_chat_references_shape():
    """The tools part of a translated request is built like the chat reference's own "Functions" example."""
    chat = messages_to_chat(reference("anthropic_request_stream_tools.json"))
    openai_request = reference("openai_chat_request_functions.json")
    ours, theirs = chat["tools"][0], openai_request["tools"][0]
    assert ours.keys() == theirs.keys() and ours["type"] == theirs["type"]
    assert ours["function"].keys() == theirs["function"].keys()
    assert chat["messages"] == [{"role": "user", "content": "What is the weather like in San Francisco?"}]
    assert chat["tool_choice"] == "required"  # {"type": "any"}
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ({"type": "auto"}, "auto"),
        ({"type": "any"}, "required"),
        ({"type": "none"}, "none"),
        ({"type": "tool", "name": "get_weather"}, {"type": "function", "function": {"name": "get_weather"}}),
    ],
)
def test_tool_choice(choice, expected):
    request = {**reference("anthropic_request_stream_tools.json"), "tool_choice": choice}
    check_messages_request(request)
    chat = messages_to_chat(request)
    assert chat["tool_choice"] == expected
    assert "parallel_tool_calls" not in chat


def test_text_blocks_become_one_string_and_images_in_a_tool_result_join_the_user_turn():
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    request = {
        "model": "m",
        "max_tokens": 8,
        "system": "be brief",
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": "sig"},
                    {"type": "tool_use", "id": "toolu_1", "name": "screenshot", "input": {}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": [{"type": "text", "text": "here"}, image],
                    },
                    {"type": "text", "text": "what do you see?"},
                ],
            },
        ],
    }
    check_messages_request(request)
    messages = messages_to_chat(request)["messages"]
    assert messages[0] == {"role": "system", "content": "be brief"}
    assert messages[1] == {"role": "user", "content": "a\nb"}
    assert messages[2]["content"] is None and messages[2]["tool_calls"][0]["function"]["arguments"] == "{}"
    thought_only = {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "sig"}]}
    assert messages_to_chat(with_messages(USER, thought_only))["messages"][1] == {"role": "assistant", "content": ""}
    assert messages[3] == {"role": "tool", "tool_call_id": "toolu_1", "content": "here"}
    assert messages[4] == {
        "role": "user",
        "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
            {"type": "text", "text": "what do you see?"},
        ],
    }


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image", "source": {"type": "file", "file_id": "f"}}]}
                ]
            },
            "messages[0].content[0].source.type",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "document", "source": {"type": "base64"}}]}]},
            "messages[0].content[0].source.type",
        ),
        ({"messages": [{"role": "user", "content": [{"type": "search_result"}]}]}, "messages[0].content[0].type"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": "x"}}]}]},
            "messages[0].content[0].source.media_type",
        ),
    ],
)
def test_what_a_chat_pool_cannot_take_is_refused_by_name(change, param):
    request = {**reference("anthropic_request_stream_tools.json"), **change}
    check_messages_request(request)  # valid Messages requests: refused in translation, not in the check
    with pytest.raises(MessagesRequestError) as caught:
        messages_to_chat(request)
    assert caught.value.param == param


# --- response: chat -> Message ---------------------------------------------------------------------------------


def test_text_response():
    body = reference("openai_chat_response_text.json")
    message = Message.model_validate(chat_to_message(body, "claude-on-vllm"))
    assert message.id.startswith("msg_") and message.model == "claude-on-vllm"
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == body["choices"][0]["message"]["content"]  # type: ignore[union-attr]
    assert (message.stop_reason, message.stop_sequence) == ("end_turn", None)
    usage = body["usage"]
    assert (message.usage.input_tokens, message.usage.output_tokens) == (
        usage["prompt_tokens"],
        usage["completion_tokens"],
    )
    assert message.usage.cache_read_input_tokens == 0
    assert set(chat_to_message(body, "m")) == set(reference("anthropic_response_text.json"))


def test_tool_call_response():
    body = reference("openai_chat_response_tool_calls.json")
    message = Message.model_validate(chat_to_message(body, "m"))
    call = body["choices"][0]["message"]["tool_calls"][0]
    assert message.stop_reason == "tool_use"
    assert [block.model_dump(exclude_none=True) for block in message.content] == [
        {
            "type": "tool_use",
            "id": call["id"],
            "name": call["function"]["name"],
            "input": json.loads(call["function"]["arguments"]),
        }
    ]
    Message.model_validate(reference("anthropic_response_tool_use.json"))  # the shape ours is held to


def vllm_body(message: dict[str, Any], finish_reason: str, stop_reason: Any = None) -> dict[str, Any]:
    """A non-streaming chat completion as vLLM answers one (fake: vLLM cannot run here). Built from vLLM's
    ChatCompletionResponse in vllm/entrypoints/openai/protocol.py: a choice carries `stop_reason` (the stop string
    or token that ended it), a message may carry `reasoning_content`, usage has prompt_tokens_details."""
    return {
        "id": "chatcmpl-4b5d0c9e",
        "object": "chat.completion",
        "created": 1,
        "model": "served-model",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", **message},
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": stop_reason,
            }
        ],
        "usage": {
            "prompt_tokens": 100,
            "completion_tokens": 7,
            "total_tokens": 107,
            "prompt_tokens_details": {"cached_tokens": 64},
        },
    }


@pytest.mark.parametrize(
    ("finish_reason", "stop_reason", "expected"),
    [
        ("stop", "\n\nHuman:", ("stop_sequence", "\n\nHuman:")),
        ("stop", "not one of ours", ("end_turn", None)),
        ("stop", 128001, ("end_turn", None)),  # an EOS token id
        ("length", None, ("max_tokens", None)),
        ("content_filter", None, ("refusal", None)),
    ],
)
def test_stop_reasons(finish_reason, stop_reason, expected):
    body = vllm_body({"content": "Hello"}, finish_reason, stop_reason)
    message = Message.model_validate(chat_to_message(body, "m", stop_sequences=["\n\nHuman:", "###"]))
    assert (message.stop_reason, message.stop_sequence) == expected


def test_cached_prompt_tokens_are_cache_reads():
    message = Message.model_validate(chat_to_message(vllm_body({"content": "Hi"}, "stop"), "m"))
    usage = message.usage
    assert (usage.input_tokens, usage.cache_read_input_tokens, usage.cache_creation_input_tokens) == (36, 64, 0)
    assert usage.output_tokens == 7


def test_forced_tool_calls_that_finish_with_stop_are_tool_use():
    """vLLM answers tool_choice "required" or a named function with finish_reason "stop"."""
    call = {"id": "chatcmpl-tool-1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    message = Message.model_validate(chat_to_message(vllm_body({"content": None, "tool_calls": [call]}, "stop"), "m"))
    assert message.stop_reason == "tool_use"
    assert message.content[0].input == {"a": 1}  # type: ignore[union-attr]


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
def test_reasoning_becomes_a_thinking_block_when_asked_for(field):
    body = vllm_body({"content": "4", field: "2 + 2 is 4"}, "stop")
    asked = Message.model_validate(chat_to_message(body, "m", thinking=True))
    assert [block.type for block in asked.content] == ["thinking", "text"]
    assert asked.content[0].thinking == "2 + 2 is 4"  # type: ignore[union-attr]
    plain = Message.model_validate(chat_to_message(body, "m"))
    assert [block.type for block in plain.content] == ["text"]


# Fields of the wrong type, where an upstream that is not the chat server it claims to be may put them.
ILL_TYPED_CALL = {"index": 0, "id": 7, "type": "function", "function": {"name": 8, "arguments": 9}}
ILL_TYPED_USAGE = {"prompt_tokens": 1.5, "completion_tokens": -3, "prompt_tokens_details": {"cached_tokens": True}}
NO_USAGE = {"input_tokens": 0, "output_tokens": 0, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}


def test_answer_fields_of_the_wrong_type_read_as_absent():
    """Non-string text, reasoning or tool-call fields make no block the SDK cannot read, and usage counts that
    charging would not take (gateway/spend/charge.py) are reported as 0."""
    message = {"content": 5, "refusal": ["no"], "reasoning_content": {"r": 1}, "tool_calls": [ILL_TYPED_CALL]}
    body = {**vllm_body(message, "tool_calls"), "usage": ILL_TYPED_USAGE}
    translated = chat_to_message(body, "m", thinking=True)
    Message.model_validate(translated)
    [call] = translated["content"]
    assert (call["type"], call["name"], call["input"]) == ("tool_use", "", {}) and call["id"].startswith("toolu_")
    assert translated["usage"] == NO_USAGE


# --- stream: chat chunks -> Anthropic events -------------------------------------------------------------------


def test_text_stream():
    chunks = recorded_chunks("openai_chat_stream_text.sse")
    events = translate_stream(chunks)
    reference_events = [data for _, data in sse_data((REFERENCE / "anthropic_stream_text.sse").read_bytes())]
    assert collapsed_types(events) == collapsed_types(reference_events)
    message = accumulate(events)
    expected_text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == expected_text  # type: ignore[union-attr]
    assert (message.stop_reason, message.stop_sequence) == ("end_turn", None)
    assert (message.usage.input_tokens, message.usage.output_tokens) == (14, 47)  # the recorded usage chunk
    assert events[0]["message"]["usage"]["input_tokens"] == 0  # unknown until the last chunk


def test_tool_call_stream():
    chunks = recorded_chunks("openai_chat_stream_tool_calls.sse")
    events = translate_stream(chunks)
    assert collapsed_types(events) == [
        "message_start",
        *["content_block_start", "content_block_delta", "content_block_stop"] * 2,
        "message_delta",
        "message_stop",
    ]
    message = accumulate(events)
    assert message.stop_reason == "tool_use"
    assert [(b.type, b.id, b.name, b.input) for b in message.content] == [  # type: ignore[union-attr]
        (
            "tool_use",
            "call_lQnnsesjFMWMQ5IeWPHzR4th",
            "GetWeatherArgs",
            {"city": "Edinburgh", "country": "UK", "units": "c"},
        ),
        ("tool_use", "call_2xjOUgaCdiwAcl9ZBL9LyMUU", "get_stock_price", {"ticker": "AAPL", "exchange": "NASDAQ"}),
    ]
    assert message.usage.output_tokens == 60


@pytest.mark.parametrize("name", ["anthropic_stream_tool_use.sse", "anthropic_stream_tool_use_sdk.sse"])
def test_the_accumulator_builds_the_recorded_anthropic_streams(name):
    """The helper above, on Anthropic's own recorded streams: it is the SDK's accumulation, not ours."""
    message = accumulate([data for _, data in sse_data((REFERENCE / name).read_bytes())])
    assert [block.type for block in message.content] == ["text", "tool_use"]
    assert message.content[1].input["location"] in ("San Francisco, CA", "Paris")  # type: ignore[union-attr]


def vllm_chunk(delta: dict[str, Any], finish_reason: str | None = None, **choice: Any) -> dict[str, Any]:
    """A vLLM chat chunk (fake: vLLM cannot run here), after ChatCompletionStreamResponse in
    vllm/entrypoints/openai/protocol.py: `usage` null until the usage chunk, `stop_reason` on the finishing choice."""
    body = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason, **choice}
    return {
        "id": "chatcmpl-7",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "x",
        "choices": [body],
        "usage": None,
    }


def usage_chunk(prompt: int, completion: int, cached: int = 0) -> dict[str, Any]:
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    return {
        "id": "chatcmpl-7",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "x",
        "choices": [],
        "usage": {**usage, "prompt_tokens_details": {"cached_tokens": cached}},
    }


def test_stream_stop_sequence_thinking_and_cache_reads():
    chunks = [
        vllm_chunk({"role": "assistant", "content": ""}),
        vllm_chunk({"reasoning_content": "Count: "}),
        vllm_chunk({"reasoning_content": "one, two."}),
        vllm_chunk({"content": "Two"}),
        vllm_chunk({"content": "."}, "stop", stop_reason="###"),
        usage_chunk(50, 9, cached=32),
    ]
    message = accumulate(translate_stream(chunks, stop_sequences=["###"], thinking=True))
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in message.content] == [
        ("thinking", "Count: one, two."),
        ("text", "Two."),
    ]
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "###")
    assert (message.usage.input_tokens, message.usage.cache_read_input_tokens, message.usage.output_tokens) == (
        18,
        32,
        9,
    )
    without_thinking = accumulate(translate_stream(chunks, stop_sequences=["###"]))
    assert [b.type for b in without_thinking.content] == ["text"]


def test_stream_fields_of_the_wrong_type_read_as_absent():
    chunks = [
        vllm_chunk({"role": "assistant", "content": 5, "reasoning_content": 3}),
        vllm_chunk({"content": "Hi", "refusal": ["no"]}),
        vllm_chunk({"tool_calls": [ILL_TYPED_CALL]}, "tool_calls"),
        {**usage_chunk(0, 0), "usage": ILL_TYPED_USAGE},
    ]
    events = translate_stream(chunks, thinking=True)
    message = accumulate(events)
    assert [(b.type, getattr(b, "text", None) or getattr(b, "name", None)) for b in message.content] == [
        ("text", "Hi"),
        ("tool_use", ""),
    ]
    assert message.content[1].input == {}  # type: ignore[union-attr]
    assert events[-2]["usage"] == NO_USAGE


def test_a_stream_without_a_usage_chunk_still_closes():
    message = accumulate(translate_stream([vllm_chunk({"content": "Hi"}, "length")]))
    assert message.stop_reason == "max_tokens" and message.content[0].text == "Hi"  # type: ignore[union-attr]


def test_an_empty_stream_is_a_whole_message():
    events = translate_stream([])
    assert collapsed_types(events) == ["message_start", "message_delta", "message_stop"]
    assert accumulate(events).content == []


def test_an_upstream_error_chunk_ends_the_stream_with_an_error_event():
    """The bundled engine's mid-stream error (backend_engine/http/openai_protocol/responses.py) becomes Anthropic's."""
    translator = ChatStreamToMessages("m")
    translator.feed(vllm_chunk({"content": "partial"}))
    [event] = translator.feed({"error": {"message": "boom", "type": "server_error", "param": None, "code": "500"}})
    [(name, data)] = sse_data(event)
    assert name == "error" and data == {"type": "error", "error": {"type": "api_error", "message": "boom"}}
    assert translator.finish() == [] and translator.feed(vllm_chunk({"content": "late"})) == []


def test_an_upstream_error_code_of_other_digits_is_no_status():
    """`"²".isdigit()` holds but `int("²")` raises: an upstream's code of such digits is no HTTP status, not a crash."""
    for code in ("²", "٣", "5০0"):
        [event] = ChatStreamToMessages("m").feed({"error": {"message": "boom", "code": code}})
        [(name, data)] = sse_data(event)
        assert name == "error" and data["error"] == {"type": "api_error", "message": "boom"}


def test_error_event_is_the_documented_one():
    [(name, data)] = sse_data(ChatStreamToMessages("m").error("overloaded_error", "Overloaded"))
    [(reference_name, reference_data)] = sse_data((REFERENCE / "anthropic_stream_error.sse").read_bytes())
    assert (name, data) == (reference_name, reference_data)
    ErrorResponse.model_validate(data)


# Arbitrary chunking: the same answer split at any points and grouped into chunks any way gives the same message.

ANSWER_TEXT = "Let me look that up for you."
ANSWER_CALLS = [
    ("call_1", "get_weather", '{"location": "San Francisco, CA", "unit": "celsius"}'),
    ("call_2", "get_time", '{"timezone": "America/Los_Angeles"}'),
]


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    return [text[a:b] for a, b in zip(points, points[1:])]


def chunked_stream(data: st.DataObject, *, text_anywhere: bool = False, indexed: bool = True) -> list[dict[str, Any]]:
    """The answer as chat chunks: text, then each tool call (id and name with its first fragment), pieces grouped
    into chunks at random; within a chunk text precedes tool calls, as in a chat delta. `text_anywhere` scatters
    the text's pieces among the calls' fragments (in order), inside a call's arguments too; `indexed=False` sends
    fragments without `index`, as some OpenAI-compatible servers do (a call's first fragment has its id)."""
    cut_lists = st.lists(st.integers(0, 100), max_size=6)
    texts: list[tuple[str, Any]] = [("text", t) for t in split(ANSWER_TEXT, data.draw(cut_lists))]
    pieces: list[tuple[str, Any]] = []
    for index, (call_id, name, arguments) in enumerate(ANSWER_CALLS):
        for k, fragment in enumerate(split(arguments, data.draw(cut_lists))):
            call: dict[str, Any] = {"index": index, "function": {"arguments": fragment}}
            if k == 0:
                call.update(id=call_id, type="function")
                call["function"]["name"] = name
            if not indexed:
                del call["index"]
            pieces.append(("tool", call))
    if text_anywhere:
        places = sorted(data.draw(st.lists(st.integers(0, len(pieces)), min_size=len(texts), max_size=len(texts))))
        for place, text in reversed(list(zip(places, texts))):
            pieces.insert(place, text)
    else:
        pieces = texts + pieces
    chunks, start = [], 0
    while start < len(pieces):
        end = start + data.draw(st.integers(1, 4))
        group = pieces[start:end]
        delta: dict[str, Any] = {}
        text = "".join(p for kind, p in group if kind == "text")
        if text:
            delta["content"] = text
        calls = [p for kind, p in group if kind == "tool"]
        if calls:
            delta["tool_calls"] = calls
        chunks.append(vllm_chunk(delta))
        start = end
    if data.draw(st.booleans()):
        chunks[-1]["choices"][0]["finish_reason"] = "tool_calls"
    else:
        chunks.append(vllm_chunk({}, "tool_calls"))
    return [vllm_chunk({"role": "assistant", "content": ""}), *chunks, usage_chunk(120, 40)]


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_any_chunking_of_a_chat_stream_gives_the_same_message(data):
    message = accumulate(translate_stream(chunked_stream(data)))
    assert message.content[0].type == "text" and message.content[0].text == ANSWER_TEXT  # type: ignore[union-attr]
    assert [(b.id, b.name, b.input) for b in message.content[1:]] == [  # type: ignore[union-attr]
        (call_id, name, json.loads(arguments)) for call_id, name, arguments in ANSWER_CALLS
    ]
    assert (message.stop_reason, message.usage.input_tokens, message.usage.output_tokens) == ("tool_use", 120, 40)


@settings(max_examples=80, deadline=None)
@given(st.data(), st.booleans())
def test_text_anywhere_among_tool_call_fragments_loses_nothing(data, indexed):
    """Text between any two fragments, inside a call's arguments too, with or without the fragments' `index`: every
    block well-formed, each call whole in its own block, and all of the text in text blocks, in its order."""
    events = translate_stream(chunked_stream(data, text_anywhere=True, indexed=indexed))
    assert_block_grammar(events)
    message = accumulate(events)
    assert "".join(b.text for b in message.content if b.type == "text") == ANSWER_TEXT
    assert [(b.id, b.name, b.input) for b in message.content if b.type == "tool_use"] == [
        (call_id, name, json.loads(arguments)) for call_id, name, arguments in ANSWER_CALLS
    ]


# --- the SDK's client, over a real socket -----------------------------------------------------------------------


class _Answer(BaseHTTPRequestHandler):
    """Answers every POST with the server's prepared (body, content type[, status]), as the gateway's route would."""

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers.get("content-length", 0)))
        body, content_type, *status = self.server.answer  # type: ignore[attr-defined]
        self.send_response(status[0] if status else 200)
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def sdk_client() -> Iterator[tuple[anthropic.Anthropic, ThreadingHTTPServer]]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Answer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    client = anthropic.Anthropic(api_key="test", base_url=f"http://127.0.0.1:{server.server_port}", max_retries=0)
    try:
        yield client, server
    finally:
        client.close()
        server.shutdown()
        server.server_close()


ASK = {"model": "claude-on-vllm", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]}


def test_the_sdk_streams_our_events_to_the_accumulated_message(sdk_client):
    client, server = sdk_client
    chunks = recorded_chunks("openai_chat_stream_tool_calls.sse")
    server.answer = (translated_bytes(chunks), "text/event-stream")
    with client.messages.stream(**ASK) as stream:
        final = stream.get_final_message()
    assert final.model_dump() == accumulate(translate_stream(chunks)).model_dump()
    assert [block.input for block in final.content][1] == {"ticker": "AAPL", "exchange": "NASDAQ"}  # type: ignore[union-attr]


def test_the_sdk_reads_our_message_and_our_stream_error(sdk_client):
    client, server = sdk_client
    body = chat_to_message(reference("openai_chat_response_text.json"), "claude-on-vllm")
    server.answer = (json.dumps(body).encode(), "application/json")
    message = client.messages.create(**ASK)
    assert message.content[0].text == "Hello! How can I assist you today?"  # type: ignore[union-attr]

    translator = ChatStreamToMessages("claude-on-vllm")
    started = translator.feed(vllm_chunk({"content": "Hel"}))
    server.answer = (b"".join(started) + translator.error("overloaded_error", "Overloaded"), "text/event-stream")
    with pytest.raises(anthropic.APIStatusError) as caught, client.messages.stream(**ASK) as stream:
        stream.get_final_message()
    assert caught.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]


# --- errors ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "error_type"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (402, "billing_error"),
        (403, "permission_error"),
        (404, "not_found_error"),
        (408, "invalid_request_error"),
        (413, "request_too_large"),
        (429, "rate_limit_error"),
        (500, "api_error"),
        (502, "api_error"),
        (503, "overloaded_error"),
        (504, "timeout_error"),
        (529, "overloaded_error"),
    ],
)
def test_error_types(status, error_type, sdk_client):
    """Each status's body, as the SDK's client receives it: the exception for the status, the type in the body."""
    assert anthropic_error_type(status) == error_type
    client, server = sdk_client
    server.answer = (json.dumps(anthropic_error(status, "why")).encode(), "application/json", status)
    with pytest.raises(anthropic.APIStatusError) as caught:
        client.messages.create(**ASK)
    assert caught.value.status_code == status
    assert caught.value.body == {"type": "error", "error": {"type": error_type, "message": "why"}}
    if error_type != "request_too_large":  # documented for 413 (sent by Cloudflare), yet not among the SDK's models
        ErrorResponse.model_validate(caught.value.body)


def with_messages(*messages: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 16, "messages": list(messages)}


USER = {"role": "user", "content": "hi"}


@pytest.mark.parametrize(
    ("request_body", "param"),
    [
        ({"max_tokens": 1, "messages": [USER]}, "model"),
        ({"model": "", "max_tokens": 1, "messages": [USER]}, "model"),
        ({"model": "m", "messages": [USER]}, "max_tokens"),
        ({"model": "m", "max_tokens": 0, "messages": [USER]}, "max_tokens"),
        ({"model": "m", "max_tokens": True, "messages": [USER]}, "max_tokens"),
        ({"model": "m", "max_tokens": "16", "messages": [USER]}, "max_tokens"),
        (with_messages(), "messages"),
        ({"model": "m", "max_tokens": 16, "messages": "hi"}, "messages"),
        (with_messages(USER, {"role": "system", "content": "x"}), "messages[1].role"),
        (with_messages({"role": "user", "content": 5}), "messages[0].content"),
        (with_messages({"role": "user", "content": [{"type": "text"}]}), "messages[0].content[0].text"),
        (with_messages({"role": "user", "content": ["hi"]}), "messages[0].content[0]"),
        (with_messages({"role": "user", "content": [{"type": "image"}]}), "messages[0].content[0].source"),
        (
            with_messages({"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}),
            "messages[0].content[0].type",
        ),
        (
            with_messages(USER, {"role": "assistant", "content": [{"type": "tool_use", "name": "f", "input": {}}]}),
            "messages[1].content[0].id",
        ),
        (
            with_messages(USER, {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "input": {}}]}),
            "messages[1].content[0].name",
        ),
        (
            with_messages(
                USER, {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": []}]}
            ),
            "messages[1].content[0].input",
        ),
        (with_messages({"role": "user", "content": [{"type": "tool_result"}]}), "messages[0].content[0].tool_use_id"),
        (
            with_messages({"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": 5}]}),
            "messages[0].content[0].content",
        ),
        (
            with_messages(
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text", "text": 1}]}],
                }
            ),
            "messages[0].content[0].content[0].text",
        ),
        (
            with_messages(
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "is_error": "yes"}]}
            ),
            "messages[0].content[0].is_error",
        ),
        (
            with_messages(USER, {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}),
            "messages[1].content[0].type",
        ),
        ({**with_messages(USER), "system": 5}, "system"),
        ({**with_messages(USER), "system": [{"type": "image"}]}, "system[0]"),
        ({**with_messages(USER), "system": [{"type": "text", "text": None}]}, "system[0].text"),
        ({**with_messages(USER), "tools": {}}, "tools"),
        ({**with_messages(USER), "tools": [{"name": "f"}]}, "tools[0].input_schema"),
        ({**with_messages(USER), "tools": [{"input_schema": {}}]}, "tools[0].name"),
        (
            {**with_messages(USER), "tools": [{"name": "f", "description": 1, "input_schema": {}}]},
            "tools[0].description",
        ),
        ({**with_messages(USER), "tool_choice": {"type": "sometimes"}}, "tool_choice"),
        ({**with_messages(USER), "tool_choice": {"type": "tool"}}, "tool_choice.name"),
        ({**with_messages(USER), "tool_choice": {"type": "tool", "name": "f"}}, "tool_choice"),
        ({**with_messages(USER), "tools": [], "tool_choice": {"type": "any"}}, "tool_choice"),
        ({**with_messages(USER), "stop_sequences": "###"}, "stop_sequences"),
        ({**with_messages(USER), "stop_sequences": ["###", 3]}, "stop_sequences[1]"),
        ({**with_messages(USER), "temperature": 1.5}, "temperature"),
        ({**with_messages(USER), "top_p": -0.1}, "top_p"),
        ({**with_messages(USER), "top_k": 1.5}, "top_k"),
        ({**with_messages(USER), "stream": "yes"}, "stream"),
        ({**with_messages(USER), "metadata": []}, "metadata"),
        ({**with_messages(USER), "metadata": {"user_id": 7}}, "metadata.user_id"),
        ({**with_messages(USER), "thinking": "on"}, "thinking"),
    ],
)
def test_bad_requests_name_the_field(request_body, param):
    with pytest.raises(MessagesRequestError) as caught:
        check_messages_request(request_body)
    assert isinstance(caught.value, ValueError)
    assert caught.value.param == param and str(caught.value).startswith(f"{param}: ")


def test_valid_requests_pass_the_check():
    for name in ("anthropic_request_conversation.json", "anthropic_request_stream_tools.json"):
        check_messages_request(reference(name))
    check_messages_request({**with_messages(USER), "tools": [{"type": "web_search_20250305", "name": "web_search"}]})
    check_messages_request({**with_messages(USER), "tool_choice": {"type": "auto"}})  # no tools: as if no choice
    with pytest.raises(MessagesRequestError) as caught:
        check_messages_request([])  # type: ignore[arg-type]
    assert caught.value.param is None


# --- interleaved tool calls ------------------------------------------------------------------------------------


def assert_block_grammar(events: list[dict[str, Any]]) -> None:
    """Anthropic's stream grammar for content blocks: indices 0, 1, 2... each started once, at most one open at a
    time, its deltas between its start and its stop (a client that reads a tool call's input at its block's stop
    must have all of it by then)."""
    open_block, started = None, 0
    for event in events:
        kind, index = event["type"], event.get("index")
        if kind == "content_block_start":
            assert open_block is None and index == started, event
            open_block, started = index, started + 1
        elif kind == "content_block_delta":
            assert index == open_block, f"a delta for block {index} while block {open_block} is open: {event}"
        elif kind == "content_block_stop":
            assert index == open_block, event
            open_block = None
        elif kind in ("message_delta", "message_stop"):
            assert open_block is None, event


def call_fragment(index: int, arguments: str, first: bool = False) -> dict[str, Any]:
    """A streamed tool call's fragment; the first carries the call's id and name only."""
    call: dict[str, Any] = {"index": index, "function": {"arguments": arguments}}
    if first:
        call.update(id=f"call_{index}", type="function")
        call["function"]["name"] = f"tool_{index}"
    return call


def test_interleaved_tool_call_fragments_become_one_whole_block_each(sdk_client):
    """Parallel tool calls whose argument fragments alternate (index 0, 1, 0, 1), as an upstream that generates its
    calls side by side sends them: each call is its own tool_use block, whose deltas all come before its stop."""
    chunks = [
        vllm_chunk({"role": "assistant", "content": ""}),
        vllm_chunk({"tool_calls": [call_fragment(0, '{"city": ', first=True)]}),
        vllm_chunk({"tool_calls": [call_fragment(1, '{"ticker": ', first=True)]}),
        vllm_chunk({"tool_calls": [call_fragment(0, '"Paris"}')]}),
        vllm_chunk({"tool_calls": [call_fragment(1, '"AAPL"}')]}),
        vllm_chunk({}, "tool_calls"),
        usage_chunk(30, 12),
    ]
    events = translate_stream(chunks)
    assert_block_grammar(events)
    message = accumulate(events)
    assert [(b.id, b.name, b.input) for b in message.content] == [  # type: ignore[union-attr]
        ("call_0", "tool_0", {"city": "Paris"}),
        ("call_1", "tool_1", {"ticker": "AAPL"}),
    ]
    assert (message.stop_reason, message.usage.output_tokens) == ("tool_use", 12)

    client, server = sdk_client
    server.answer = (translated_bytes(chunks), "text/event-stream")
    with client.messages.stream(**ASK) as stream:
        stopped = [e.content_block.input for e in stream if e.type == "content_block_stop"]  # type: ignore[union-attr]
    assert stopped == [{"city": "Paris"}, {"ticker": "AAPL"}]  # each input whole when its block stops


def test_tool_calls_in_one_delta_and_a_late_fragment_keep_their_blocks():
    """Two calls started in one delta, then each one's fragments in a later delta, out of index order."""
    chunks = [
        vllm_chunk({"tool_calls": [call_fragment(0, "", first=True), call_fragment(1, '{"b"', first=True)]}),
        vllm_chunk({"tool_calls": [call_fragment(1, ": 2}"), call_fragment(0, '{"a": 1}')]}, "tool_calls"),
    ]
    events = translate_stream(chunks)
    assert_block_grammar(events)
    assert [(b.id, b.input) for b in accumulate(events).content] == [  # type: ignore[union-attr]
        ("call_0", {"a": 1}),
        ("call_1", {"b": 2}),
    ]


def test_text_inside_a_calls_arguments_comes_after_its_block(sdk_client):
    """Text that arrives while a call's arguments are not yet whole JSON cannot go in a block of its own then
    (Anthropic's blocks are sequential, and stopping the call's block would cut its input short): it waits, and
    goes out as a text block once the call's arguments are whole."""
    chunks = [
        vllm_chunk({"role": "assistant", "content": "Checking."}),
        vllm_chunk({"tool_calls": [call_fragment(0, '{"city": ', first=True)]}),
        vllm_chunk({"content": " One moment."}),
        vllm_chunk({"tool_calls": [call_fragment(0, '"Paris"}')]}),
        vllm_chunk({"content": " Done."}, "tool_calls"),
        usage_chunk(30, 12),
    ]
    events = translate_stream(chunks)
    assert_block_grammar(events)
    content = [(b.type, b.text if b.type == "text" else b.input) for b in accumulate(events).content]  # type: ignore[union-attr]
    assert content == [("text", "Checking."), ("tool_use", {"city": "Paris"}), ("text", " One moment. Done.")]

    client, server = sdk_client
    server.answer = (translated_bytes(chunks), "text/event-stream")
    with client.messages.stream(**ASK) as stream:
        stopped = [e.content_block for e in stream if e.type == "content_block_stop"]
    assert [getattr(block, "input", None) for block in stopped] == [None, {"city": "Paris"}, None]


# How servers other than OpenAI and vLLM tell a stream's tool calls apart: (name, fragment as they send it).
FRAGMENT_STYLES = [
    ("no index, the id on each call's first fragment", lambda f: {k: v for k, v in f.items() if k != "index"}),
    ("all at index 0, a new id each, '' after (lmdeploy)", lambda f: {**f, "index": 0, "id": f.get("id", "")}),
    ("all at index 0, the call's id on each (SGLang)", lambda f: {**f, "index": 0, "id": f"call_{f['index']}"}),
]


@pytest.mark.parametrize("style", [pytest.param(style, id=name) for name, style in FRAGMENT_STYLES])
def test_calls_that_share_or_lack_an_index_are_told_apart_by_their_ids(style):
    """A fragment with a new `id` starts a new call, whatever its `index`; one without an id continues the call at
    its index, or without an index the last call."""
    fragments = [
        call_fragment(0, "", first=True),
        call_fragment(0, '{"city": '),
        call_fragment(0, '"Paris"}'),
        call_fragment(1, '{"tz": "CET"}', first=True),
    ]
    chunks = [vllm_chunk({"tool_calls": [style(f)]}) for f in fragments] + [vllm_chunk({}, "tool_calls")]
    events = translate_stream(chunks)
    assert_block_grammar(events)
    assert [(b.id, b.name, b.input) for b in accumulate(events).content] == [  # type: ignore[union-attr]
        ("call_0", "tool_0", {"city": "Paris"}),
        ("call_1", "tool_1", {"tz": "CET"}),
    ]


def test_thousands_of_streamed_calls_cost_each_fragment_a_lookup_not_a_search():
    """An upstream may stream any number of calls: finding a fragment's call among them is a lookup, so 40,000
    calls take about a second here, where searching the calls seen for each fragment took tens of seconds."""
    calls = 40_000
    chunks = [vllm_chunk({"tool_calls": [call_fragment(i, f'{{"n": {i}}}', first=True)]}) for i in range(calls)]
    started = time.perf_counter()
    events = translate_stream(chunks + [vllm_chunk({}, "tool_calls")])
    assert time.perf_counter() - started < 10  # a generous bound for a loaded machine
    assert sum(e["type"] == "content_block_start" for e in events) == calls


def test_a_malformed_call_index_names_no_call():
    """A fragment whose `index` is not a number continues the last call instead of failing the stream."""
    chunks = [
        vllm_chunk({"tool_calls": [{**call_fragment(0, '{"city": ', first=True), "index": [0]}]}),
        vllm_chunk({"tool_calls": [{**call_fragment(0, '"Paris"}'), "index": {"i": 0}}]}, "tool_calls"),
    ]
    events = translate_stream(chunks)
    assert_block_grammar(events)
    assert [(b.id, b.input) for b in accumulate(events).content] == [("call_0", {"city": "Paris"})]  # type: ignore[union-attr]


def test_parallel_calls_that_share_an_id_are_told_apart_by_their_index():
    """A server or model that names calls after their function gives two parallel calls one id: at two indices they
    are two calls, each fragment on its own, however they interleave."""
    call = {"type": "function", "id": "get_weather", "function": {"name": "get_weather"}}
    fragments = [
        {**call, "index": 0, "function": {**call["function"], "arguments": '{"city": '}},
        {**call, "index": 1, "function": {**call["function"], "arguments": '{"city": "Rome"}'}},
        {"index": 0, "function": {"arguments": '"Paris"}'}},
        {**call, "index": 1, "function": {"arguments": ""}},
    ]
    events = translate_stream([vllm_chunk({"tool_calls": [f]}) for f in fragments] + [vllm_chunk({}, "tool_calls")])
    assert_block_grammar(events)
    assert [(b.id, b.input) for b in accumulate(events).content] == [  # type: ignore[union-attr]
        ("get_weather", {"city": "Paris"}),
        ("get_weather", {"city": "Rome"}),
    ]


def test_text_behind_a_call_that_never_parses_is_held_within_a_bound():
    """A call whose arguments never become JSON (a stray closing brace, a model writing a Python dict) would hold
    everything after it to the end of the stream: past MAX_HELD_CHARS of held text the stream ends with an error
    event (the call's block cannot stop before its input is whole, nor take deltas after), and each piece held
    meanwhile costs no parse of the call's arguments."""
    arguments = '{"city": "' + "P" * 1_000_000 + '"}}'  # a megabyte read before the parse fails, each time it runs
    pieces = [f"{i:07d}xyz" for i in range(MAX_HELD_CHARS // 10 + 2000)]
    translator = ChatStreamToMessages("claude-on-vllm")
    translator.feed(vllm_chunk({"tool_calls": [call_fragment(0, "", first=True)]}))
    translator.feed(vllm_chunk({"tool_calls": [call_fragment(0, arguments)]}))
    started = time.perf_counter()
    out = [event for piece in pieces for event in translator.feed(vllm_chunk({"content": piece}))]
    assert time.perf_counter() - started < 15  # a parse of the arguments per piece took over a minute
    out += translator.finish() + translator.feed(vllm_chunk({"content": "more"}))
    [(name, data)] = sse_data(b"".join(out))
    assert name == "error" and data["error"]["type"] == "api_error" and "not JSON" in data["error"]["message"]


def test_a_long_call_in_small_fragments_costs_time_in_proportion_to_its_length():
    """An agent's write_file call may stream megabytes of arguments: each fragment used to copy all of them (a
    string grown with +=, then stripped to see whether it ended in a brace), so 2 MB took the event loop 20 s."""
    body = "x" * 23
    fragments = [call_fragment(0, '{"content": "', first=True)] + [call_fragment(0, body) for _ in range(80_000)]
    chunks = [vllm_chunk({"tool_calls": [f]}) for f in fragments + [call_fragment(0, '"}')]]
    started = time.perf_counter()
    raw = translated_bytes(chunks + [vllm_chunk({}, "tool_calls")])
    assert time.perf_counter() - started < 15  # a generous bound for a loaded machine
    deltas = [data["delta"] for _, data in sse_data(raw) if data["type"] == "content_block_delta"]
    assert json.loads("".join(d["partial_json"] for d in deltas)) == {"content": body * 80_000}
