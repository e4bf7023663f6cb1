"""What the input guard reads of a request: roles (with `function` as `tool`), token-id prompts, tool descriptions."""

from __future__ import annotations

from gateway.apis.routes import BY_NAME
from gateway.guard.inputs import request_texts, selected

CHAT, COMPLETIONS = BY_NAME["chat"], BY_NAME["completions"]


def unknown(ids: list[int], where: str) -> None:
    return None


def test_function_messages_are_read_as_tool_messages() -> None:
    payload = {
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "function", "name": "f", "content": "result"},
            {"role": "tool", "tool_call_id": "1", "content": [{"type": "text", "text": "part"}]},
            {"role": "system", "content": "rules"},
        ]
    }
    texts = request_texts(CHAT, payload, {"user", "tool"}, unknown)
    assert [(t.text, t.role, t.where) for t in texts] == [
        ("hi", "user", "messages[0]"),
        ("result", "tool", "messages[1]"),
        ("part", "tool", "messages[2].content[0]"),
    ]
    assert [t.where for t in selected(texts, ["tool"])] == ["messages[1]", "messages[2].content[0]"]


def test_tool_descriptions_only_when_a_role_asks_for_them() -> None:
    payload = {
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "t", "description": "does things"}}],
    }
    assert [t.where for t in request_texts(CHAT, payload, {"user"}, unknown)] == ["messages[0]"]
    assert [t.where for t in request_texts(CHAT, payload, {"user", "tool_definitions"}, unknown)] == [
        "messages[0]",
        "tools[0].function.description",
    ]
