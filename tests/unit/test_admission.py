"""Admission: the fair queue sheds with the right status and serves tenants fairly; token counting and the
context window through the tokenize part of an attempt's authority."""

from __future__ import annotations

import asyncio

import pytest
from opentelemetry import trace
from starlette.requests import Request

from gateway.admission.fair_queue import FairQueue
from gateway.config import LimitsConfig, ModelConfig
from gateway.context import Demand, RequestContext
from gateway.edge.offload import Offload
from gateway.errors import GatewayError
from gateway.policy.loader import empty_policy_set
from gateway.stages.tokenize import Tokenize
from gateway.tokenization import EstimateCounter


class Gate:
    """Capacity the test opens one admission at a time; `take` claims it, in the order the queue grants."""

    def __init__(self, order: list[str]) -> None:
        self.slots = 0
        self.order = order

    def taker(self, tenant: str):
        def take() -> bool:
            if self.slots <= 0:
                return False
            self.slots -= 1
            self.order.append(tenant)
            return True

        return take


async def _admit(queue: FairQueue, gate: Gate, tenant: str, timeout: float = 5.0) -> None:
    await queue.admit(tenant, 100, 100, gate.taker(tenant), timeout)


def test_a_flooding_tenant_does_not_starve_a_light_one():
    async def scenario() -> list[str]:
        order: list[str] = []
        queue, gate = FairQueue(max_queue=64), Gate(order)
        flood = [asyncio.create_task(_admit(queue, gate, "flood")) for _ in range(20)]
        await asyncio.sleep(0)
        for _ in range(5):  # the flood is served alone for a while
            gate.slots += 1
            queue.dispatch()
            await asyncio.sleep(0)
        light = [asyncio.create_task(_admit(queue, gate, "light")) for _ in range(3)]
        await asyncio.sleep(0)
        while len(order) < 23:
            gate.slots += 1
            queue.dispatch()
            await asyncio.sleep(0)
        await asyncio.gather(*flood, *light)
        return order

    order = asyncio.run(scenario())
    assert order[:5] == ["flood"] * 5
    # the light tenant is lifted to the flood's counter (the tie goes to the flood, queued first), then alternates
    # with it instead of waiting behind the 15 flood requests still queued
    assert [i for i, t in enumerate(order) if t == "light"] == [6, 8, 10]


def test_full_queue_sheds_the_tenant_over_its_share_with_429_else_503():
    async def scenario() -> None:
        queue, gate = FairQueue(max_queue=4), Gate([])
        hogs = [asyncio.create_task(_admit(queue, gate, "hog")) for _ in range(4)]
        await asyncio.sleep(0)
        newcomer = asyncio.create_task(_admit(queue, gate, "new"))
        await asyncio.sleep(0)
        # the hog's newest waiter made room for the newcomer
        with pytest.raises(GatewayError) as dropped:
            await hogs[-1]
        assert dropped.value.status == 429 and dropped.value.code == "tenant_queue_share_exceeded"
        assert dropped.value.headers["retry-after"] == "1"
        with pytest.raises(GatewayError) as again:  # hog holds 3 > share of 2: refused at the door
            await _admit(queue, gate, "hog")
        assert again.value.status == 429
        for task in (*hogs[:3], newcomer):
            task.cancel()

    asyncio.run(scenario())


def test_deadline_expiry_is_503_with_retry_after_and_leaves_no_waiter():
    async def scenario() -> FairQueue:
        queue = FairQueue(max_queue=8)
        with pytest.raises(GatewayError) as info:
            await queue.admit("t", 10, 10, lambda: False, timeout=0.05)
        assert info.value.status == 503 and info.value.code == "cluster_saturated"
        assert int(info.value.headers["retry-after"]) >= 1
        return queue

    assert len(asyncio.run(scenario())) == 0


def test_admitted_immediately_when_it_fits_and_nobody_waits():
    async def scenario() -> float:
        return await FairQueue(max_queue=1).admit("t", 10, 10, lambda: True, timeout=1)

    assert asyncio.run(scenario()) == 0.0


def _ctx(route: str, payload: dict) -> RequestContext:
    scope = {"type": "http", "method": "POST", "path": "/", "headers": [], "query_string": b""}
    ctx = RequestContext(request=Request(scope), route=route, span=trace.INVALID_SPAN)
    ctx.payload, ctx.model = payload, payload["model"]
    return ctx


def _demand(tokenize: Tokenize, route: str, payload: dict) -> Demand:
    """What the request asks of the model it names."""
    return asyncio.run(tokenize.demand(_ctx(route, payload), payload["model"]))


def test_tiktoken_counts_offline_and_unknown_models_are_estimated():
    tokenize = Tokenize(
        [ModelConfig(name="gpt", tokenizer="tiktoken:cl100k_base")], empty_policy_set, Offload(LimitsConfig())
    )
    completion = _demand(tokenize, "completions", {"model": "gpt", "prompt": "hello world", "max_tokens": 3})
    assert completion.prompt_tokens == 2 and completion.prompt_token_ids is None
    hello = [{"role": "user", "content": "hello world"}]
    chat = _demand(tokenize, "chat", {"model": "gpt", "max_tokens": 3, "messages": hello})
    assert chat.prompt_tokens == 3 + 3 + 1 + 2  # priming + per-message + "user" + "hello world"
    messages = [{"role": "user", "content": "x" * 40}]
    unknown = _demand(tokenize, "chat", {"model": "other", "max_tokens": 3, "messages": messages})
    assert unknown.prompt_tokens == EstimateCounter().count("chat", messages).tokens == 14


WEATHER = {  # the function of OpenAI's cookbook "How to count tokens with tiktoken", section 7
    "name": "get_current_weather",
    "description": "Get the current weather in a given location",
    "parameters": {
        "type": "object",
        "properties": {
            "location": {"type": "string", "description": "The city and state, e.g. San Francisco, CA"},
            "unit": {
                "type": "string",
                "description": "The unit of temperature to return",
                "enum": ["celsius", "fahrenheit"],
            },
        },
        "required": ["location"],
    },
}
WEATHER_CHAT = [
    {"role": "system", "content": "You are a helpful assistant that can answer to questions about the weather."},
    {"role": "user", "content": "What's the weather like in San Francisco?"},
]


def _weather_tool_chat(max_tokens: int) -> dict:
    return {
        "model": "gpt",
        "max_tokens": max_tokens,
        "messages": WEATHER_CHAT,
        "tools": [{"type": "function", "function": WEATHER}],
    }


def test_function_definitions_count_as_prompt_tokens_in_every_shape():
    """105: what OpenAI's API reported as prompt_tokens for this request on gpt-4 and gpt-3.5-turbo (cl100k_base),
    as the cookbook prints it; the same function in Responses' and Anthropic's shapes costs the same."""
    tokenize = Tokenize(
        [ModelConfig(name="gpt", tokenizer="tiktoken:cl100k_base", context_window=120)],
        empty_policy_set,
        Offload(LimitsConfig()),
    )
    chat = _demand(tokenize, "chat", {"model": "gpt", "max_tokens": 5, "messages": WEATHER_CHAT})
    chat_with_tools = _demand(tokenize, "chat", _weather_tool_chat(max_tokens=5))
    assert chat_with_tools.prompt_tokens == 105 and chat.prompt_tokens == 34
    legacy_body = {"model": "gpt", "max_tokens": 5, "messages": WEATHER_CHAT, "functions": [WEATHER]}
    assert _demand(tokenize, "chat", legacy_body).prompt_tokens == 105
    flat = {"name": WEATHER["name"], "description": WEATHER["description"], "input_schema": WEATHER["parameters"]}
    hosted = {"type": "web_search_preview"}  # no definition to read: the provider prices its own tools
    tools = [{"type": "function", **WEATHER}, hosted]
    responses = _demand(tokenize, "responses", {"model": "gpt", "input": "hi", "tools": tools})
    bare = _demand(tokenize, "responses", {"model": "gpt", "input": "hi"})
    hi = [{"role": "user", "content": "hi"}]
    messages = _demand(tokenize, "messages", {"model": "gpt", "max_tokens": 5, "messages": hi})
    messages_tools = _demand(tokenize, "messages", {"model": "gpt", "max_tokens": 5, "messages": hi, "tools": [flat]})
    assert responses.prompt_tokens - bare.prompt_tokens == messages_tools.prompt_tokens - messages.prompt_tokens == 71
    # the window holds the definitions too
    with pytest.raises(GatewayError) as info:
        _demand(tokenize, "chat", _weather_tool_chat(max_tokens=20))
    assert info.value.code == "context_length_exceeded"
