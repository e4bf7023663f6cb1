"""Mutated answers never cost a 500: an upstream's whole answer or stream, valid but for a few members given values
no provider sends (tests/hostile/mutation.py), events dropped or repeated, reaches the client as an answer, a 502 in
the route's shape, or a stream ending in its terminal event or an error event; the gateway logs no traceback.

The hostile upstream (tests/hostile/hostile_upstream.py) writes what each request asks: a chat completion, a
Responses object or a Messages answer, whole (`garbage`) or as SSE events (`written`), through the output guard
(PII redacted, secrets blocked), and translated where the route's API is not the pool's."""

from __future__ import annotations

import hashlib
import json
import random

import httpx
import pytest
import yaml

from tests.conftest import Launcher, pool
from tests.hostile.conftest import log_mark, start_hostile_upstream
from tests.hostile.mutation import answer_problem, mutated
from tests.hostile.test_mutated_requests import HEADERS, KEY

ANSWERS_PER_CASE = 120

CHAT = {
    "id": "c",
    "object": "chat.completion",
    "created": 1,
    "model": "test-model",
    "choices": [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": "hi, mail bob@example.com",
                "tool_calls": [{"id": "t", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}],
            },
            "finish_reason": "stop",
            "logprobs": {"content": [{"token": "hi", "logprob": -0.1, "bytes": [104, 105], "top_logprobs": []}]},
        }
    ],
    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
}
CHAT_EVENTS = [
    (
        None,
        {
            "id": "c",
            "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": "hi "}}],
        },
    ),
    (
        None,
        {
            "id": "c",
            "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": {"content": "bob@example.com"}}],
        },
    ),
    (
        None,
        {
            "id": "c",
            "object": "chat.completion.chunk",
            "choices": [
                {
                    "index": 0,
                    "delta": {
                        "tool_calls": [
                            {"index": 0, "id": "t", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                        ]
                    },
                }
            ],
        },
    ),
    (
        None,
        {"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
    ),
    (
        None,
        {
            "id": "c",
            "object": "chat.completion.chunk",
            "choices": [],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
        },
    ),
]
RESPONSE = {
    "id": "resp_1",
    "object": "response",
    "status": "completed",
    "model": "gpt-x",
    "output": [
        {
            "type": "message",
            "id": "msg_1",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": "hi bob@example.com", "annotations": []}],
        },
        {"type": "function_call", "id": "fc_1", "call_id": "c", "name": "f", "arguments": "{}"},
        {"type": "reasoning", "id": "r", "summary": [{"type": "summary_text", "text": "x"}]},
    ],
    "usage": {"input_tokens": 3, "output_tokens": 1, "total_tokens": 4},
}
RESPONSE_EVENTS = [
    ("response.created", {"type": "response.created", "response": {**RESPONSE, "status": "in_progress", "output": []}}),
    (
        "response.output_item.added",
        {
            "type": "response.output_item.added",
            "output_index": 0,
            "item": {"type": "message", "id": "msg_1", "role": "assistant", "content": []},
        },
    ),
    (
        "response.output_text.delta",
        {
            "type": "response.output_text.delta",
            "item_id": "msg_1",
            "output_index": 0,
            "content_index": 0,
            "delta": "hi bob@example.com",
        },
    ),
    (
        "response.function_call_arguments.delta",
        {"type": "response.function_call_arguments.delta", "item_id": "fc_1", "output_index": 1, "delta": "{}"},
    ),
    ("response.completed", {"type": "response.completed", "response": RESPONSE}),
]
MESSAGE = {
    "id": "msg_1",
    "type": "message",
    "role": "assistant",
    "model": "claude-x",
    "content": [
        {"type": "text", "text": "hi bob@example.com"},
        {"type": "tool_use", "id": "t", "name": "f", "input": {"a": 1}},
        {"type": "thinking", "thinking": "x", "signature": "s"},
    ],
    "stop_reason": "end_turn",
    "stop_sequence": None,
    "usage": {"input_tokens": 3, "output_tokens": 1},
}
MESSAGE_EVENTS = [
    ("message_start", {"type": "message_start", "message": {**MESSAGE, "content": [], "stop_reason": None}}),
    ("content_block_start", {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
    (
        "content_block_delta",
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "hi bob@example.com"}},
    ),
    ("content_block_stop", {"type": "content_block_stop", "index": 0}),
    (
        "content_block_start",
        {
            "type": "content_block_start",
            "index": 1,
            "content_block": {"type": "tool_use", "id": "t", "name": "f", "input": {}},
        },
    ),
    (
        "content_block_delta",
        {"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": '{"a": 1}'}},
    ),
    ("content_block_stop", {"type": "content_block_stop", "index": 1}),
    ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 2}}),
    ("message_stop", {"type": "message_stop"}),
]
# (route, model, the pool's whole answer, its stream's events): test-model's pool speaks chat, claude-x's Messages
CASES = [
    ("/v1/chat/completions", "test-model", CHAT, CHAT_EVENTS),
    ("/v1/responses", "gpt-x", RESPONSE, RESPONSE_EVENTS),
    ("/v1/messages", "claude-x", MESSAGE, MESSAGE_EVENTS),
    ("/v1/messages", "test-model", CHAT, CHAT_EVENTS),
]


@pytest.fixture(scope="module")
def gw(module_launcher: Launcher, tmp_path_factory: pytest.TempPathFactory):
    output = {"enabled": True, "secrets": "block", "pii": "redact", "hold_back": 48, "scan_every": 16}
    spec = {"guard": {"enabled": True, "injection": {"enabled": False}, "output": output}}
    policies = tmp_path_factory.mktemp("answers") / "policies"
    policies.mkdir()
    policy = {"apiVersion": "portcullis.dev/v1", "kind": "Policy", "metadata": {"name": "output"}, "spec": spec}
    (policies / "base.yaml").write_text(yaml.safe_dump(policy))
    upstream = start_hostile_upstream(module_launcher)
    return module_launcher.gateway(
        {
            "pools": [
                pool("openai", upstream.url, models=["test-model", "gpt-x"]),
                pool("claude", upstream.url, models=["claude-x"], api="anthropic", api_key_env="PROVIDER_KEY"),
            ],
            "policy_dir": str(policies),
            "models": [{"name": "test-model", "tokenizer": "tiktoken:cl100k_base"}],
            "auth": {"keys": [{"tenant": "t", "sha256": hashlib.sha256(KEY.encode()).hexdigest()}]},
        },
        env={"PROVIDER_KEY": "up"},
    )


def sse(events: list[tuple[str | None, object]]) -> list[str]:
    """The events as an upstream writes them: named (Responses, Messages) or not (chat, ended by [DONE])."""
    written = [(f"event: {name}\n" if name else "") + f"data: {json.dumps(data)}\n\n" for name, data in events]
    return written + ([] if events and events[0][0] else ["data: [DONE]\n\n"])


def mutated_events(events: list, rng: random.Random) -> list:
    events = [(name, data) for name, data in events]
    at = rng.randrange(len(events))
    events[at] = (events[at][0], mutated(events[at][1], rng))
    if rng.random() < 0.2:
        del events[rng.randrange(len(events))]
    if rng.random() < 0.2:
        events.insert(rng.randrange(len(events)), events[rng.randrange(len(events))])
    return events


@pytest.mark.parametrize("route, model, whole, events", CASES, ids=[f"{r}-{m}" for r, m, _, _ in CASES])
def test_mutated_answers_reach_the_client_in_the_routes_shape_and_no_traceback(gw, route, model, whole, events):
    rng = random.Random(f"{route} {model}")
    mark = log_mark(gw)
    failures = []
    with httpx.Client(timeout=30) as client:
        for _ in range(ANSWERS_PER_CASE):
            stream = rng.random() < 0.5
            if stream:
                hostile = {"behaviour": "written", "events": sse(mutated_events(events, rng)), "gap": 0}
            else:
                answer = json.dumps(mutated(whole, rng))
                hostile = {"behaviour": "garbage", "status": 200, "content_type": "application/json", "body": answer}
            body: dict = {"model": model, "stream": stream}
            if route == "/v1/responses":
                body["input"] = "hello"
            else:
                body["messages"] = [{"role": "user", "content": "hello"}]
            if route == "/v1/messages":
                body["max_tokens"] = 32
            if route == "/v1/messages" and model == "test-model":  # translated: `user` is what reaches the pool
                body["metadata"] = {"user_id": json.dumps(hostile)}
            else:
                body["hostile"] = hostile
            response = client.post(gw.url + route, json=body, headers=HEADERS)
            problem = answer_problem(route, response) if response.status_code != 502 else None
            if response.status_code == 502 and "upstream" not in response.text:
                problem = "a 502 that does not name the upstream"
            if problem:
                failures.append(f"{problem}: {json.dumps(hostile)[:400]} -> {response.text[:200]}")
    assert not failures, f"{len(failures)} of {ANSWERS_PER_CASE}:\n" + "\n".join(failures[:5])
    assert "Traceback" not in gw.output()[mark:]
