"""The whole path with nothing faked: the gateway in front of two real engine replicas serving the bundled model."""

from __future__ import annotations

import json
import sys

import httpx
import openai
import pytest

from tests.conftest import ROOT, Process, free_port, pool, spawn

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """Two engine replicas (one BLAS thread each) and a round-robin gateway; shared by this module's tests."""
    import yaml

    logs = tmp_path_factory.mktemp("stack")
    started: list[Process] = []
    try:
        for i in range(2):
            port = free_port()
            cmd = [sys.executable, "-m", "gateway.cli", "engine", "serve", "--port", str(port), "--threads", "1",
                   "--kv-cache-bytes", "64M"]
            started.append(spawn(cmd, port, logs / f"engine-{i}.log", ready_path="/health", timeout=300))
        port = free_port()
        config = logs / "portcullis.yaml"
        config.write_text(yaml.safe_dump({
            "listen": {"port": port}, "policy_dir": str(ROOT / "policies"),
            "pools": [pool("engine", *(e.url for e in started), routing="round_robin")]}))
        gateway = spawn([sys.executable, "-m", "gateway.cli", "serve", "--config", str(config)], port,
                        logs / "gateway.log")
        yield gateway, started
        started.append(gateway)
    finally:
        for process in started:
            process.stop()


def served_requests(engine: Process) -> float:
    """Finished requests as the engine itself counts them (vLLM-named metric)."""
    text = httpx.get(engine.url + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total"))


def test_openai_client_streams_through_the_gateway_from_both_replicas(stack):
    gateway, engines = stack
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    before = [served_requests(e) for e in engines]
    texts = []
    for _ in range(2):  # round robin: one request lands on each replica
        pieces, usage = [], None
        for chunk in client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=12,
                temperature=0, stream=True, stream_options={"include_usage": True}):
            if chunk.choices:
                pieces.append(chunk.choices[0].delta.content or "")
            if chunk.usage:
                usage = chunk.usage
        texts.append("".join(pieces))
        assert usage is not None and usage.completion_tokens >= 1 and usage.prompt_tokens > 5
    assert texts[0] and texts[0] == texts[1]  # greedy decoding: both replicas agree
    after = [served_requests(e) for e in engines]
    assert [a - b for a, b in zip(after, before)] == [1, 1]


def test_non_streaming_completion_and_models_through_the_gateway(stack):
    gateway, _ = stack
    response = httpx.post(gateway.url + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0})
    assert response.status_code == 200
    body = response.json()
    assert body["usage"]["completion_tokens"] == 4 and body["choices"][0]["text"]
    assert [m["id"] for m in httpx.get(gateway.url + "/v1/models").json()["data"]] == [MODEL]
    metrics = httpx.get(gateway.url + "/metrics").text
    assert f'portcullis_tokens_total{{kind="completion",model="{MODEL}",pool="engine"}}' in metrics


def test_engine_errors_pass_through_in_openai_shape(stack):
    gateway, _ = stack
    response = httpx.post(gateway.url + "/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10, "top_k": "many"})
    assert response.status_code == 400
    assert set(json.loads(response.content)["error"]) >= {"message", "type", "code"}
