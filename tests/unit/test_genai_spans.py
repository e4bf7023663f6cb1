"""The attempt span's answer attributes, read from answers as each provider writes them (tests/api_reference)."""

from __future__ import annotations

import json
from pathlib import Path

from gateway.apis.answers import AnswerFormat, MessagesFormat, ResponsesFormat
from gateway.context import Usage
from gateway.relay.genai_spans import response_attributes

REFERENCE = Path(__file__).resolve().parent.parent / "api_reference"


def _read(answers: AnswerFormat, *bodies: dict) -> dict:
    usage = Usage()
    for body in bodies:
        answers.record(usage, body)
    return response_attributes(usage)


def _events(name: str) -> list[dict]:
    lines = (REFERENCE / name).read_text().splitlines()
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


def test_a_chat_completion_names_its_id_model_and_usage_without_zero_details() -> None:
    attributes = _read(AnswerFormat(), json.loads((REFERENCE / "openai_chat_response_text.json").read_text()))
    assert attributes == {
        "gen_ai.response.id": "chatcmpl-B9MBs8CjcvOU2jLn4n570S5qMJKcT",
        "gen_ai.response.model": "gpt-5.4",
        "gen_ai.response.finish_reasons": ["stop"],
        "gen_ai.usage.input_tokens": 19,
        "gen_ai.usage.output_tokens": 10,
    }  # its cached and reasoning counts are 0: the conventions want them where non-zero


def test_an_anthropic_stream_names_its_message_id_and_model_from_message_start() -> None:
    attributes = _read(MessagesFormat(), *_events("anthropic_stream_text.sse"))
    assert attributes["gen_ai.response.id"] == "msg_1nZdL29xx5MUA1yADyHTEsnR8uuvGzszyY"
    assert attributes["gen_ai.response.model"] == "claude-opus-4-1-20250805"


def test_a_responses_answer_reports_cache_reads_and_reasoning() -> None:
    response = {
        "id": "resp_1",
        "object": "response",
        "model": "o4-mini-2025-04-16",
        "status": "completed",
        "output": [],
        "usage": {
            "input_tokens": 30,
            "input_tokens_details": {"cached_tokens": 12},
            "output_tokens": 40,
            "output_tokens_details": {"reasoning_tokens": 32},
        },
    }
    attributes = _read(ResponsesFormat(), {"type": "response.completed", "response": response})
    assert attributes["gen_ai.response.id"] == "resp_1"
    assert attributes["gen_ai.response.model"] == "o4-mini-2025-04-16"
    assert attributes["gen_ai.usage.cache_read.input_tokens"] == 12
    assert attributes["gen_ai.usage.reasoning.output_tokens"] == 32


def test_an_upstream_s_long_id_is_cut() -> None:
    attributes = _read(AnswerFormat(), {"id": "x" * 100_000, "model": 7, "choices": []})
    assert len(str(attributes["gen_ai.response.id"])) == 256 and "gen_ai.response.model" not in attributes
