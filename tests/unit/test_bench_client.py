"""portcullis bench: SSE parsing and per-chunk timing of one streamed chat completion."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from gateway.bench.client import chat_url, stream_chat
from gateway.bench.metrics import RequestResult


def sse(obj) -> bytes:
    return f"data: {json.dumps(obj) if not isinstance(obj, str) else obj}\n\n".encode()


def chunk(content: str | None, role: str | None = None) -> dict:
    delta = {k: v for k, v in (("role", role), ("content", content)) if v is not None}
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}


USAGE = {
    "object": "chat.completion.chunk",
    "choices": [],
    "usage": {
        "prompt_tokens": 120,
        "completion_tokens": 3,
        "total_tokens": 123,
        "prompt_tokens_details": {"cached_tokens": 96},
    },
}


def run(events, status: int = 200, headers: dict | None = None) -> RequestResult:
    """Stream `events` (bytes, or a float = sleep that long) from a mock target and time them."""
    seen: list[httpx.Request] = []

    async def body():
        for e in events:
            if isinstance(e, float):
                await asyncio.sleep(e)
            elif isinstance(e, Exception):
                raise e
            else:
                yield e

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(status, headers={"content-type": "text/event-stream", **(headers or {})}, content=body())

    async def main() -> RequestResult:
        result = RequestResult(0, 0, 0, 0)
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            await stream_chat(
                client, "http://t/v1/chat/completions", {"stream": True}, {"authorization": "Bearer k"}, result, t0=0.0
            )
        return result

    result = asyncio.run(main())
    assert seen and seen[0].headers["authorization"] == "Bearer k"
    return result


def test_ttft_itl_e2e_usage_and_replica_header():
    r = run(
        [
            sse(chunk("", role="assistant")),
            0.08,
            sse(chunk("a")),
            0.03,
            sse(chunk("b")),
            0.03,
            sse(chunk("c")),
            0.02,
            sse(USAGE),
            sse("[DONE]"),
        ],
        headers={"x-portcullis-replica": "replica-2"},
    )
    assert r.success and r.error is None and r.status == 200
    assert r.ttft_s >= 0.08  # the role-only chunk carries no text: not the first token
    assert len(r.itl_s) == 2 and all(x >= 0.03 for x in r.itl_s)
    assert r.e2el_s >= r.ttft_s + 0.08  # ends at the usage chunk
    assert r.text == "abc" and r.chunks == 3
    assert (r.prompt_tokens, r.completion_tokens, r.cached_tokens) == (120, 3, 96)
    assert r.replica == "replica-2"
    assert r.tpot_s == pytest.approx((r.e2el_s - r.ttft_s) / 2)


def test_without_usage_chunks_count_as_tokens_and_no_replica_header():
    r = run([sse(chunk("x")), sse(chunk("y")), sse("[DONE]")])
    assert r.success and r.completion_tokens is None and r.output_tokens == 2
    assert r.cached_tokens is None and r.replica is None


def test_http_error_status_is_a_failed_request_with_the_message():
    body = json.dumps({"error": {"message": "rate limit exceeded for tenant a", "type": "rate_limit"}}).encode()
    r = run([body], status=429)
    assert not r.success and r.status == 429
    assert r.error == "HTTP 429: rate limit exceeded for tenant a"


def test_error_event_in_the_stream_fails_the_request():
    r = run([sse(chunk("a")), sse({"error": {"message": "engine overloaded"}}), sse("[DONE]")])
    assert not r.success and r.error == "stream error: engine overloaded"
    assert r.status == 200


def test_dropped_connection_fails_the_request_without_raising():
    r = run([sse(chunk("a")), httpx.RemoteProtocolError("peer closed connection")])
    assert not r.success and "RemoteProtocolError" in r.error and r.text == "a"


@pytest.mark.parametrize("base", ["http://h:1", "http://h:1/", "http://h:1/v1", "http://h:1/v1/chat/completions"])
def test_chat_url(base):
    assert chat_url(base) == "http://h:1/v1/chat/completions"


def test_a_response_without_events_is_a_failure():
    r = run([json.dumps({"choices": [{"message": {"content": "not streamed"}}]}).encode()])
    assert not r.success and r.error.startswith("no SSE events")


def test_an_immediate_stop_succeeds_without_a_ttft():
    r = run([sse({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}), sse("[DONE]")])
    assert r.success and r.ttft_s is None and r.e2el_s is not None and r.tpot_s is None
