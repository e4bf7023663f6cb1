"""Mutated requests never cost a 500: each supported route, sent valid bodies with a few members given values no
client library would send (tests/hostile/mutation.py), answers every one with its own success or its own 4xx
shape, ends every stream it starts with its terminal event or an error event, and logs no traceback.

The gateway runs every stage that walks a body: the WAF (every pack), an exact tokenizer, the recommended guard
(classifier, PII, secrets, output guard) and the object-reference checks, in front of an OpenAI-compatible fake,
and fake Anthropic Messages and OpenAI Responses providers (tests/fake_providers.py)."""

from __future__ import annotations

import hashlib
import json
import random

import httpx
import pytest
import yaml

from tests.conftest import Launcher, pool
from tests.hostile.conftest import log_mark
from tests.hostile.mutation import answer_problem, mutated
from tests.hostile.test_guard_bypass import recommended_guard
from tests.hostile.test_tenant_objects import UPSTREAM_KEY, fake_provider

KEY = "sk-hostile-mutations"
HEADERS = {"authorization": f"Bearer {KEY}", "x-api-key": KEY, "anthropic-version": "2023-06-01"}
BODIES_PER_ROUTE = 150

CHAT = {
    "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hello"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ],
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "max_tokens": 8,
}
RESPONSES = {
    "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"type": "function_call_output", "call_id": "x", "output": "r"},
    ],
    "instructions": "be brief",
    "tools": [{"type": "function", "name": "f", "parameters": {}}],
    "max_output_tokens": 16,
}
MESSAGES = {
    "max_tokens": 8,
    "system": [{"type": "text", "text": "be brief"}],
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "r"}]}],
        },
    ],
    "tools": [{"name": "f", "input_schema": {"type": "object"}}],
}
# (route, model, a valid body): each model's pool speaks another API (test-model: the OpenAI-compatible fake;
# gpt-x: the fake Responses provider; claude-x: the fake Anthropic provider), so translated pairs are walked too
CASES = [
    ("/v1/chat/completions", "test-model", CHAT),
    ("/v1/chat/completions", "gpt-x", CHAT),
    ("/v1/completions", "test-model", {"prompt": "hello", "max_tokens": 8}),
    ("/v1/responses", "gpt-x", RESPONSES),
    ("/v1/embeddings", "test-model", {"input": ["hello", "world"]}),
    ("/v1/messages", "claude-x", MESSAGES),
    ("/v1/messages", "test-model", MESSAGES),
    ("/v1/messages/count_tokens", "claude-x", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/messages/count_tokens", "test-model", {"messages": [{"role": "user", "content": "hi"}]}),
]


@pytest.fixture(scope="module")
def gw(module_launcher: Launcher, tmp_path_factory: pytest.TempPathFactory):
    guard = recommended_guard()
    guard["output"] = {"enabled": True, "secrets": "block", "pii": "redact", "hold_back": 48, "scan_every": 16}
    waf = {"packs": ["protocol", "scanners", "sqli", "xss", "lfi", "rce", "llm"]}
    policies = tmp_path_factory.mktemp("mutations") / "policies"
    policies.mkdir()
    spec = {"guard": guard, "waf": waf}
    policy = {"apiVersion": "portcullis.dev/v1", "kind": "Policy", "metadata": {"name": "all"}, "spec": spec}
    (policies / "base.yaml").write_text(yaml.safe_dump(policy))
    upstream = module_launcher.fake_upstream()
    providers = fake_provider(module_launcher)
    return module_launcher.gateway(
        {
            "pools": [
                pool("main", upstream.url, models=["test-model"]),
                pool("claude", providers.url, models=["claude-x"], api="anthropic", api_key_env="PROVIDER_KEY"),
                pool("hosted", providers.url, models=["gpt-x"], api_key_env="PROVIDER_KEY"),
            ],
            "policy_dir": str(policies),
            "models": [{"name": "test-model", "tokenizer": "tiktoken:cl100k_base"}],
            "auth": {"keys": [{"tenant": "t", "sha256": hashlib.sha256(KEY.encode()).hexdigest()}]},
        },
        env={"PROVIDER_KEY": UPSTREAM_KEY},
    )


@pytest.mark.parametrize("route, model, valid", CASES, ids=[f"{r}-{m}" for r, m, _ in CASES])
def test_mutated_bodies_get_the_routes_own_answers_and_no_traceback(gw, route, model, valid):
    rng = random.Random(f"{route} {model}")
    mark = log_mark(gw)
    failures = []
    with httpx.Client(timeout=30) as client:
        for _ in range(BODIES_PER_ROUTE):
            body = mutated({"model": model, **valid}, rng)
            if isinstance(body, dict) and rng.random() < 0.3 and not route.endswith(("count_tokens", "embeddings")):
                body["stream"] = True
            response = client.post(gw.url + route, content=json.dumps(body), headers=HEADERS)
            problem = answer_problem(route, response)
            if problem:
                failures.append(f"{problem}: {json.dumps(body)[:400]} -> {response.text[:200]}")
    assert not failures, f"{len(failures)} of {BODIES_PER_ROUTE}:\n" + "\n".join(failures[:5])
    assert "Traceback" not in gw.output()[mark:]
