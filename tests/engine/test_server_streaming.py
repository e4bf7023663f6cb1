"""How generated tokens travel from the engine's step loop to the client: one write per engine step, a lagging
reader catching up in one go, failures and disconnects mid-stream (real engine, real uvicorn on loopback)."""

from __future__ import annotations

import asyncio
import json
import socket
from urllib.parse import urlsplit

import httpx
import pytest

from backend_engine.async_engine import AsyncEngine
from backend_engine.http.server import EngineServer
from backend_engine.http.streaming import per_choice
from backend_engine.sequence import SamplingParams

from .served import MODEL, running_server, wait_idle


@pytest.fixture(scope="module")
def served(make_engine):
    server = EngineServer(make_engine())
    with running_server(server) as url:
        yield server, url


def http_chunks(url: str, path: str, body: dict) -> list[bytes]:
    """POST `body` and return the response's HTTP/1.1 chunks as they were framed: one per ASGI body write."""
    parts = urlsplit(url)
    payload = json.dumps(body).encode()
    with socket.create_connection((parts.hostname, parts.port), timeout=60) as sock:
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n"
            f"content-length: {len(payload)}\r\nconnection: close\r\n\r\n".encode()
            + payload
        )
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head.lower(), head
    chunks = []
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return chunks
        chunks.append(rest[:size])
        rest = rest[size + 2 :]


def events(write: bytes) -> list[dict]:
    return [json.loads(line[6:]) for line in write.split(b"\n") if line.startswith(b"data: {")]


def test_each_engine_step_is_one_write_carrying_every_choice(served):
    """n=2: one step makes a token for each choice, and both go out in one write, never one write per token."""
    max_tokens = 8
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me a story."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    writes = http_chunks(served[1], "/v1/chat/completions", body)
    assert [e["choices"][0]["delta"] for e in events(writes[0])] == [{"role": "assistant", "content": ""}] * 2
    assert writes[-1].endswith(b"data: [DONE]\n\n") and events(writes[-1])[-1]["usage"]["completion_tokens"] == 16
    steps = writes[1:-1]
    assert 0 < len(steps) <= max_tokens  # 8 steps; fewer writes only if the reader fell behind
    for write in steps:
        indexes = [c["index"] for e in events(write) for c in e["choices"]]
        assert len(indexes) == len(set(indexes))  # at most one chunk per choice per write
    assert sum(len(events(w)) for w in steps) == 2 * len(steps)  # every step made text for both choices
    wait_idle(served[0])


def test_a_reader_that_falls_behind_takes_the_missed_steps_at_once(make_engine):
    engine = make_engine()
    async_engine = AsyncEngine(engine)
    async_engine.start()
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)

    async def read_slowly() -> tuple[list, list]:
        outputs = async_engine.generate([([6403, 1980, 253, 655], params)])
        first = await anext(outputs)
        while engine.has_unfinished():  # the reader is busy while the engine makes the other five tokens
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # the last step's hand-over follows the step
        return first, [batch async for batch in outputs]

    try:
        first, rest = asyncio.run(read_slowly())
    finally:
        async_engine.stop()
    assert len(first) == 1 and len(rest) == 1 and len(rest[0]) == 5
    ((index, joined),) = per_choice(rest[0])
    assert index == 0 and joined.finished and joined.num_output_tokens == 6
    assert joined.new_token_ids == [o.new_token_ids[0] for _, o in rest[0]]
    assert joined.new_text == "".join(o.new_text for _, o in rest[0])
    reference = engine.generate([[6403, 1980, 253, 655]], params)[0]
    assert first[0][1].new_token_ids + joined.new_token_ids == reference.output_token_ids


def test_engine_failure_mid_stream_ends_chat_with_an_error_event(served, monkeypatch):
    engine = served[0].engine
    real_step, steps = engine.step, []

    def failing_step():
        steps.append(1)
        if len(steps) == 4:
            raise RuntimeError("device lost")
        return real_step()

    monkeypatch.setattr(engine, "step", failing_step)
    body = {"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 30, "stream": True}
    with httpx.stream("POST", served[1] + "/v1/chat/completions", json=body, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2][6:])["error"]
    assert "device lost" in error["message"] and error["type"] == "server_error"
    assert any(json.loads(line[6:]).get("choices", [{}])[0].get("delta", {}).get("content") for line in lines[1:-2])
    wait_idle(served[0])


def test_closing_a_stream_of_several_choices_frees_every_sequence(served):
    body = {"prompt": "Tell me a very long story.", "max_tokens": 500, "n": 3, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", served[1] + "/v1/completions", json=body, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 6:
                break
    wait_idle(served[0])  # all three sequences aborted, their blocks free
