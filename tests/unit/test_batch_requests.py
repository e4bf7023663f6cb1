"""How a batch's requests are read before the WAF and the guard see them: each as its route's request, named by its
line (or its place in the list), and nothing the gateway cannot read skipped."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.config import LimitsConfig
from gateway.errors import GatewayError
from gateway.tenancy.batch_requests import file_requests, inline_requests

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def line(body: Any, url: str = "/v1/chat/completions", **extra: Any) -> bytes:
    return json.dumps({"custom_id": "r", "method": "POST", "url": url, "body": body, **extra}).encode()


def refusal(content: bytes) -> GatewayError:
    with pytest.raises(GatewayError) as caught:
        file_requests("openai", content, "input_file_id", LimitsConfig())
    return caught.value


def test_each_line_is_read_as_its_routes_request_and_named_by_its_number() -> None:
    content = b"\n".join([line(CHAT), b"", line({"model": "m", "input": "hi"}, "/v1/responses"), b""])
    read = file_requests("openai", content, "input_file_id", LimitsConfig())
    assert [(r.where, r.api.name, r.payload["model"]) for r in read] == [
        ("input_file_id line 1", "chat", "m"),
        ("input_file_id line 3", "responses", "m"),
    ]


@pytest.mark.parametrize(
    "bad",
    [
        line(CHAT, "/v1/moderations"),  # a route the gateway does not serve
        line(CHAT, "/v1/messages"),  # another API's route: not a line an OpenAI pool runs
        line(CHAT, method="GET"),
        line("not an object"),
        line(None),
        b'{"custom_id": "r", "url": "/v1/chat/completions", "body": {"model": NaN}}',
        b"[1, 2]",
    ],
)
def test_a_line_the_gateway_cannot_read_as_a_request_is_refused_not_skipped(bad: bytes) -> None:
    error = refusal(line(CHAT) + b"\n" + bad + b"\n")
    assert (error.status, error.code, error.param) == (400, "batch_request_unreadable", "input_file_id line 2")


def test_a_request_its_route_refuses_names_the_line_and_the_field() -> None:
    error = refusal(line({"model": "m", "messages": "hi"}))
    assert error.status == 400 and error.param is not None
    assert error.param.startswith("input_file_id line 1: ") and error.message.startswith("input_file_id line 1: ")


def test_inline_requests_are_named_by_their_place() -> None:
    params = {"model": "claude", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    read = inline_requests(
        {"requests": [{"custom_id": "a", "params": params}] * 2}, ("requests", "params"), LimitsConfig()
    )
    assert [(r.where, r.api.name) for r in read] == [
        ("requests[0].params", "messages"),
        ("requests[1].params", "messages"),
    ]
    with pytest.raises(GatewayError) as caught:
        inline_requests({"requests": [{"custom_id": "a"}]}, ("requests", "params"), LimitsConfig())
    assert caught.value.code == "batch_request_unreadable" and caught.value.param == "requests[0].params"
