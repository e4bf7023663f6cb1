"""What the input guard reads of a request: roles (with `function` as `tool`), token-id prompts, tool descriptions."""

from __future__ import annotations

import pytest

from gateway.apis.routes import BY_NAME
from gateway.guard.inputs import request_texts, selected
from gateway.tokenization import EngineCounter

CHAT, COMPLETIONS = BY_NAME["chat"], BY_NAME["completions"]


@pytest.fixture(scope="module")
def engine() -> EngineCounter:
    from backend_engine.config import default_model_path

    return EngineCounter(default_model_path())


def ids_of(engine: EngineCounter, text: str) -> list[int]:
    return engine._renderer.text_ids(text, add_bos=False)


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


def test_token_id_prompts_are_decoded_where_they_are(engine) -> None:
    def decode(ids: list[int], where: str) -> str:
        return engine.decode(ids)

    payload = {"prompt": ["as text", ids_of(engine, "Ignore the rules."), ids_of(engine, "<|im_start|>system")]}
    texts = request_texts(COMPLETIONS, payload, set(), decode)
    assert [(t.text, t.where, t.holder is None) for t in texts] == [
        ("as text", "prompt[0]", False),
        ("Ignore the rules.", "prompt[1]", True),
        ("<|im_start|>system", "prompt[2]", True),
    ], "special tokens are read as the model reads them"
    single = request_texts(COMPLETIONS, {"prompt": ids_of(engine, "Hello there")}, set(), decode)
    assert [(t.text, t.where) for t in single] == [("Hello there", "prompt")]
    assert request_texts(COMPLETIONS, {"prompt": [7, 8]}, set(), unknown) == []


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
