"""A Responses request's instructions and input as chat messages (OpenAI's Responses API reference)."""

from __future__ import annotations

import pytest

from backend_engine.http.openai_protocol.responses_input import responses_messages
from backend_engine.model.prompt import PromptError


def test_string_input_is_one_user_message_after_the_instructions():
    assert responses_messages({"instructions": "Be brief.", "input": "Hi"}) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]
    assert responses_messages({"input": "Hi"}) == [{"role": "user", "content": "Hi"}]


def test_message_items_join_their_text_parts_in_order():
    payload = {
        "input": [
            {"role": "developer", "content": "Rules."},
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "Hello, "}, {"type": "input_text", "text": "world"}],
            },
            {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
             "content": [{"type": "output_text", "text": "Hi!", "annotations": []}]},
        ]
    }  # fmt: skip
    assert responses_messages(payload) == [
        {"role": "developer", "content": "Rules."},
        {"role": "user", "content": "Hello, world"},
        {"role": "assistant", "content": "Hi!"},
    ]


def test_function_calls_merge_into_one_assistant_turn_and_outputs_become_tool_messages():
    payload = {
        "input": [
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city":"Paris"}'},
            {"type": "function_call", "call_id": "c2", "name": "weather", "arguments": '{"city":"Rome"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "rain"}]},
            {"type": "function_call", "call_id": "c3", "name": "weather", "arguments": "{}"},
        ]
    }
    msgs = responses_messages(payload)
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "tool", "assistant"]
    assert msgs[1] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Paris"}'}},
            {"id": "c2", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Rome"}'}},
        ],
    }
    assert msgs[2] == {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
    assert msgs[3]["content"] == "rain"
    assert [c["id"] for c in msgs[4]["tool_calls"]] == ["c3"]  # a call after outputs starts a new turn


def test_the_payload_is_not_modified():
    payload = {"input": [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}]}
    before = repr(payload)
    responses_messages(payload)[0]["tool_calls"][0]["function"]["name"] = "changed"
    assert repr(payload) == before


@pytest.mark.parametrize(
    ("payload", "param"),
    [
        ({}, "input"),
        ({"input": 5}, "input"),
        ({"input": []}, "input"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
        ({"input": "x", "instructions": ["a"]}, "instructions"),
        ({"input": ["x"]}, "input[0]"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        ({"input": [{"role": "user"}]}, "input[0].content"),
        ({"input": [{"role": "user", "content": ["x"]}]}, "input[0].content[0]"),
        ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 1}]}]}, "input[0].content[0].text"),
        (
            {"input": [{"role": "user", "content": "a"}, {"role": "user", "content": [
                {"type": "input_text", "text": "ok"}, {"type": "input_image", "image_url": "http://x/y.png"}]}]},
            "input[1].content[1].type",
        ),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": {}}]}, "input[0].output"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        ({"input": [{"type": "mesage", "role": "user", "content": "x"}]}, "input[0].type"),
    ],
)  # fmt: skip
def test_malformed_input_names_the_offending_path(payload, param):
    with pytest.raises(PromptError) as exc:
        responses_messages(payload)
    assert exc.value.param == param
    assert str(exc.value)
