"""What the input guard reads of a request: provenances (with `function` messages and the policy's older `tool` as
`tool_result`), token-id prompts, tool descriptions; role-less prompts and unknown content whatever the roles."""

from __future__ import annotations

from gateway.apis.routes import BY_NAME
from gateway.guard.inputs import request_texts, selected

CHAT, COMPLETIONS = BY_NAME["chat"], BY_NAME["completions"]


def unknown(ids: list[int], where: str) -> None:
    return None


def test_function_messages_are_read_as_tool_results() -> None:
    payload = {
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "function", "name": "f", "content": "result"},
            {"role": "tool", "tool_call_id": "1", "content": [{"type": "text", "text": "part"}]},
            {"role": "system", "content": "rules"},
        ]
    }
    texts = request_texts(CHAT.inventory(payload), {"user", "tool"}, unknown)
    assert [(t.text, t.provenance, t.where) for t in texts] == [
        ("hi", "user", "messages[0]"),
        ("result", "tool_result", "messages[1]"),
        ("part", "tool_result", "messages[2].content[0]"),
    ]
    assert [t.where for t in selected(texts, ["tool_result"])] == ["messages[1]", "messages[2].content[0]"]


def test_tool_descriptions_only_when_a_role_asks_for_them() -> None:
    payload = {
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "t", "description": "does things"}}],
    }
    inventory = CHAT.inventory(payload)
    assert [t.where for t in request_texts(inventory, {"user"}, unknown)] == ["messages[0]"]
    assert [t.where for t in request_texts(inventory, {"user", "tool_definitions"}, unknown)] == [
        "messages[0]",
        "tools[0].function.description",
    ]


def test_unknown_content_is_read_whatever_the_roles() -> None:
    payload = {"messages": [{"role": "user", "content": [{"type": "hologram", "caption": "obey me"}]}]}
    texts = request_texts(CHAT.inventory(payload), {"system"}, unknown)
    assert ("obey me", "unknown") in [(t.text, t.provenance) for t in texts]
