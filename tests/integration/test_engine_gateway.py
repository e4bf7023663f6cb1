"""The whole path with nothing faked: gateways in front of two real engine replicas serving the bundled model.

Tests run in file order and share the engines, and the gateways whose configuration is the same; the last one kills
a replica.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time

import httpx
import openai
import pytest

from backend_engine.block_hash import hash_prompt_blocks
from gateway.tokenization import EngineCounter
from tests.conftest import ROOT, Process, pool

MODEL = "SmolLM2-135M-Instruct"
SYSTEM = " ".join(f"Rule {i}: answer politely and briefly, citing rule {i}." for i in range(30))  # ~400 tokens


# The gateway for kv_events routing: the prefix test and the replica-killing one (the last test) share it; an
# unreachable replica is ejected at its first failure.
KV_EVENTS = {"routing": "kv_events", "health": {"failures_to_eject": 1, "eject_seconds": 60}}


@pytest.fixture(scope="module")
def stack(module_launcher):
    """Two engine replicas (one BLAS thread each); `stack.gateway(routing, ...)` gives a gateway in front of them,
    started once per configuration. The module's launcher stops the gateways before the engines, whose kv-event
    streams they follow."""

    class Stack:
        def __init__(self) -> None:
            self.engines: list[Process] = []
            self.gateways: dict[str, Process] = {}

        def gateway(self, routing: str, auth: dict | None = None, **pool_options) -> Process:
            config = {
                "policy_dir": str(ROOT / "policies"),
                "auth": auth or {},
                "telemetry": {"replica_header": True},
                "pools": [
                    pool(
                        "engine",
                        *(e.url for e in self.engines),
                        routing=routing,
                        scrape_interval=0.2,
                        **pool_options,
                    )
                ],
            }
            key = json.dumps(config, sort_keys=True)
            if key not in self.gateways:
                self.gateways[key] = module_launcher.gateway(config)
                time.sleep(0.5)  # first scrape and KV-event snapshots
            return self.gateways[key]

    def engine(port: int) -> list[str]:
        return [
            sys.executable,
            "-m",
            "gateway.cli",
            "engine",
            "serve",
            "--port",
            str(port),
            "--threads",
            "1",
            "--kv-cache-bytes",
            "128M",
        ]

    stack = Stack()
    stack.engines = [module_launcher.spawn(engine, f"engine-{i}", ready_path="/health", timeout=300) for i in range(2)]
    return stack


def served_requests(engine: Process) -> float:
    """Finished requests as the engine itself counts them (vLLM-named metric)."""
    text = httpx.get(engine.url + "/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:request_success_total")
    )


def chat(
    gateway: Process, messages: list[dict], max_tokens: int = 8, key: str | None = None, **extra
) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    response = httpx.post(
        gateway.url + "/v1/chat/completions",
        timeout=120,
        headers=headers,
        json={"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra},
    )
    assert response.status_code == 200, response.text
    return response


def test_openai_client_streams_through_the_gateway_from_both_replicas(stack):
    gateway = stack.gateway("round_robin")
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    before = [served_requests(e) for e in stack.engines]
    texts = []
    for _ in range(2):  # round robin: one request lands on each replica
        pieces, usage = [], None
        for chunk in client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Name a colour."}],
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        ):
            if chunk.choices:
                pieces.append(chunk.choices[0].delta.content or "")
            if chunk.usage:
                usage = chunk.usage
        texts.append("".join(pieces))
        assert usage is not None and usage.completion_tokens >= 1 and usage.prompt_tokens > 5
    assert texts[0] and texts[0] == texts[1]  # greedy decoding: both replicas agree
    after = [served_requests(e) for e in stack.engines]
    assert [a - b for a, b in zip(after, before)] == [1, 1]

    response = httpx.post(
        gateway.url + "/v1/completions",
        timeout=60,
        json={"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0},
    )
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4
    assert [m["id"] for m in httpx.get(gateway.url + "/v1/models").json()["data"]] == [MODEL, "all-MiniLM-L6-v2"]
    bad = httpx.post(
        gateway.url + "/v1/chat/completions",
        timeout=30,
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10, "top_k": "many"},
    )
    assert bad.status_code == 400 and set(bad.json()["error"]) >= {"message", "type", "code"}


def test_gateway_block_hashes_are_the_engines(stack):
    """The gateway tokenizes and hashes a prompt itself; the engine's KV events must name the same blocks."""
    engine = stack.engines[0]
    messages = [{"role": "system", "content": SYSTEM + " (hash check)"}, {"role": "user", "content": "Hi!"}]
    ids = EngineCounter(_bundled()).count("chat", messages).token_ids
    predicted = hash_prompt_blocks(ids, 16)
    assert len(predicted) >= 20
    httpx.post(
        engine.url + "/v1/chat/completions", timeout=120, json={"model": MODEL, "messages": messages, "max_tokens": 1}
    ).raise_for_status()
    with httpx.stream("GET", engine.url + "/v1/kv_events", timeout=10) as events:
        snapshot = json.loads(next(events.iter_lines()))
    stored = {h for e in snapshot["events"] if e["type"] == "BlockStored" for h in e["block_hashes"]}
    assert set(predicted) <= stored


@pytest.mark.parametrize("routing", ["kv_events", "prefix_affinity"])
def test_next_turn_goes_where_its_prefix_is_cached_and_predictions_match(stack, routing):
    gateway = stack.gateway(**KV_EVENTS) if routing == "kv_events" else stack.gateway(routing)
    for conversation in range(3):
        history = [
            {"role": "system", "content": f"{SYSTEM} (conversation {conversation} via {routing})"},
            {"role": "user", "content": "What is rule 3?"},
        ]
        first = chat(gateway, history)
        replica = first.headers["x-portcullis-replica"]
        history += [first.json()["choices"][0]["message"], {"role": "user", "content": "And rule 7?"}]
        # kv_events: the engine's KV events for the first turn reach the gateway; prefix_affinity learned the prompt's
        # blocks when it routed it, and waits only for a scrape (every 0.2 s) that sees the first turn finished
        time.sleep(1.5 if routing == "kv_events" else 0.5)
        second = chat(gateway, history)
        assert second.headers["x-portcullis-replica"] == replica
        cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= 25 * 16  # the system prompt and the first turn came from the cache
        entry = gateway.access_log(second.headers["x-request-id"])
        assert entry["cached_tokens"] == cached
        if routing == "kv_events":  # precise: the engine's own events, generated blocks included
            assert entry["predicted_cached_tokens"] == cached
        else:  # learned from routing: knows the first prompt's blocks, not the blocks the reply filled
            assert 0 <= cached - entry["predicted_cached_tokens"] <= 32


def test_tenant_cache_isolation_keeps_prefixes_apart_and_routing_still_predicts_them(stack):
    keys = {"sk-iso-a": "tenant-a", "sk-iso-b": "tenant-b"}
    auth = {"keys": [{"tenant": t, "sha256": hashlib.sha256(k.encode()).hexdigest()} for k, t in keys.items()]}
    gateway = stack.gateway("kv_events", auth=auth, cache_isolation="tenant")
    prompt = [{"role": "system", "content": SYSTEM + " (isolation)"}, {"role": "user", "content": "Rule 9?"}]
    chat(gateway, prompt, key="sk-iso-a", cache_salt="guess")  # a client-sent salt is replaced, not used
    time.sleep(1.5)
    other = chat(gateway, prompt, key="sk-iso-b")
    assert other.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # b never sees a's blocks
    again = chat(gateway, prompt, key="sk-iso-a")
    cached = again.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 25 * 16
    assert gateway.access_log(again.headers["x-request-id"])["predicted_cached_tokens"] == cached


def test_an_engines_log_has_its_requests_access_lines_and_not_its_probes(stack):
    """A gateway scrapes each replica every second: those access lines, and health checks', buried the requests'."""
    engine = next(e for e in stack.engines if e.proc.poll() is None)  # a later test kills one
    for path in ("/metrics", "/health", "/v1/models"):
        assert httpx.get(engine.url + path, timeout=10).status_code == 200
    deadline = time.monotonic() + 10
    while "GET /v1/models HTTP/1.1" not in engine.output():
        assert time.monotonic() < deadline, "no access line for a request"
        time.sleep(0.1)
    assert "GET /metrics" not in engine.output() and "GET /health" not in engine.output()


def test_killing_the_replica_that_holds_a_prefix_reroutes_cleanly(stack):
    gateway = stack.gateway(**KV_EVENTS)
    history = [{"role": "system", "content": SYSTEM + " (failover)"}, {"role": "user", "content": "Rule 1?"}]
    first = chat(gateway, history)
    holder = first.headers["x-portcullis-replica"]
    killed = next(e for e in stack.engines if e.url == holder).proc
    killed.kill()  # SIGKILL: gone at once, its connections and its kv-event stream cut
    killed.wait()
    history += [first.json()["choices"][0]["message"], {"role": "user", "content": "Rule 2?"}]
    for _ in range(3):
        again = chat(gateway, history)
        assert again.headers["x-portcullis-replica"] != holder
    state = gateway.admin.get("/readyz").json()["pools"]["engine"]
    assert {r["url"]: r["up"] for r in state}[holder] is False


def _bundled() -> str:
    from backend_engine.config import default_model_path

    return default_model_path()
