"""One streamed OpenAI chat completion, timed chunk by chunk; never raises for a failed request."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx

from gateway.bench.metrics import RequestResult

REPLICA_HEADER = "x-portcullis-replica"


def chat_url(base_url: str) -> str:
    """http://host:port, http://host:port/v1 or the full .../chat/completions URL."""
    url = base_url.rstrip("/")
    if url.endswith("/chat/completions"):
        return url
    return url + ("/chat/completions" if url.endswith("/v1") else "/v1/chat/completions")


def _error_text(body: bytes) -> str:
    try:
        err = json.loads(body).get("error")
        message = err.get("message") if isinstance(err, dict) else err
        if message:
            return str(message)[:200]
    except (ValueError, AttributeError):
        pass
    return body[:200].decode("utf-8", "replace")


async def stream_chat(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str], result: RequestResult, t0: float
) -> None:
    """Send `body` (stream on) and fill `result`; `t0` is the benchmark's perf_counter origin."""
    start = time.perf_counter()
    result.start_s = start - t0
    last = prev = start
    events = 0
    text: list[str] = []
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            result.status = resp.status_code
            result.replica = resp.headers.get(REPLICA_HEADER)
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {_error_text(await resp.aread())}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                try:
                    event = json.loads(data)
                except ValueError:
                    result.error = f"bad stream event: {data[:100]}"
                    return
                if not isinstance(event, dict):
                    continue
                if event.get("error"):
                    err = event["error"]
                    result.error = "stream error: " + str(err.get("message") if isinstance(err, dict) else err)
                    return
                last = now
                events += 1
                for choice in event.get("choices") or []:
                    delta = choice.get("delta") or {}
                    piece = delta.get("content") or delta.get("reasoning_content") or choice.get("text") or ""
                    if not piece:
                        continue
                    if result.ttft_s is None:
                        result.ttft_s = now - start
                    else:
                        result.itl_s.append(now - prev)
                    prev = now
                    result.chunks += 1
                    text.append(piece)
                usage = event.get("usage")
                if isinstance(usage, dict):
                    result.prompt_tokens = usage.get("prompt_tokens")
                    result.completion_tokens = usage.get("completion_tokens")
                    details = usage.get("prompt_tokens_details") or {}
                    if isinstance(details, dict) and details.get("cached_tokens") is not None:
                        result.cached_tokens = int(details["cached_tokens"])
        result.text = "".join(text)  # no text at all (an immediate stop) still succeeds, without a TTFT
        if not events:
            result.error = "no SSE events in the response (does the target stream?)"
            return
        result.e2el_s = last - start
        result.success = True
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:200]
        result.text = "".join(text)
