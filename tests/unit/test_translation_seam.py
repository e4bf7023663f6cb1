"""The seam between client APIs and pool APIs (gateway/apis/translation.py, exchange.py, pool_api.py): every pool
API the operator may configure is addressed and served, each stream is translated apart from every other, and a
translation's failures are the client's 400 or the upstream's 502, never the gateway's 500."""

from __future__ import annotations

from typing import get_args

import orjson
import pytest

from gateway.apis.exchange import POOL_APIS, exchange_for
from gateway.apis.routes import APIS
from gateway.config import PoolConfig
from gateway.errors import GatewayError
from gateway.streaming.sse import DONE

CONFIGURABLE_POOL_APIS = get_args(PoolConfig.model_fields["api"].annotation)
MESSAGES = next(api for api in APIS if api.name == "messages")
REQUEST = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "stream": True}


def chunk(text: str) -> bytes:
    data = {"id": "chatcmpl-1", "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}
    return b"data: " + orjson.dumps(data) + b"\n\n"


def streamed_text(events: list[bytes]) -> str:
    """The text deltas of Anthropic stream events."""
    datas = [orjson.loads(line[6:]) for event in events for line in event.split(b"\n") if line.startswith(b"data: ")]
    return "".join(d["delta"].get("text", "") for d in datas if d["type"] == "content_block_delta")


@pytest.mark.parametrize("pool_api", CONFIGURABLE_POOL_APIS)
def test_every_pool_api_the_config_accepts_is_addressed_and_serves_messages(pool_api):
    """A pool API added to the operator config without its headers or its exchanges would fail each request at
    the upstream call, after every stage had passed it."""
    assert pool_api in POOL_APIS
    assert exchange_for(MESSAGES, pool_api, "p").path


@pytest.mark.parametrize("pool_api", CONFIGURABLE_POOL_APIS)
def test_a_pool_is_sent_its_own_key_never_the_clients_credentials(pool_api):
    config = PoolConfig(name="p", api=pool_api, replicas=[{"url": "http://127.0.0.1:1"}])
    client = {"authorization": "Bearer client-key", "x-api-key": "client-key", "anthropic-beta": "b"}
    headers = POOL_APIS[pool_api].headers(config, "pool-key", client)
    assert "client-key" not in orjson.dumps(headers).decode()
    assert "pool-key" in orjson.dumps(headers).decode()
    assert "client-key" not in orjson.dumps(POOL_APIS[pool_api].headers(config, None, client)).decode()


def test_each_stream_is_translated_apart():
    """Two streams of one translation (one object serves every request of its pair) share no state: the second
    is not closed by the first's end, nor given its text."""
    translation = exchange_for(MESSAGES, "openai", "p").translation
    first, second = translation.stream(REQUEST, "m"), translation.stream(REQUEST, "m")
    assert first is not None and second is not None
    first.feed([chunk("one"), DONE])
    events = second.feed([chunk("two"), DONE])
    assert streamed_text(events) == "two"
    assert b"message_stop" in b"".join(events)


@pytest.mark.parametrize("answer", [b"[1]", b"not json", b'{"choices": "none"}'])
def test_a_pool_answer_that_is_not_its_apis_is_a_502(answer):
    translation = exchange_for(MESSAGES, "openai", "p").translation
    with pytest.raises(GatewayError) as raised:
        translation.answer(answer, REQUEST, "m")
    assert (raised.value.status, raised.value.code) == (502, "upstream_bad_response")


def test_a_stream_event_that_is_not_its_apis_is_a_502():
    stream = exchange_for(MESSAGES, "openai", "p").translation.stream(REQUEST, "m")
    assert stream is not None
    with pytest.raises(GatewayError) as raised:
        stream.feed([b'data: {"choices": [{"index": 0, "delta": "text"}]}\n\n'])
    assert (raised.value.status, raised.value.code) == (502, "upstream_bad_response")


def test_a_request_without_a_translation_is_the_clients_400_naming_the_field():
    request = {**REQUEST, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}
    translation = exchange_for(MESSAGES, "openai", "p").translation
    with pytest.raises(GatewayError) as raised:
        translation.request(request, lambda: b"")
    assert (raised.value.status, raised.value.param) == (400, "tools[0].type")
