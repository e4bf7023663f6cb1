"""The response cache in a real gateway process: an answer served again to the same tenant for the same
deterministic request, never to another tenant, in whatever shape the client asks (whole, or streamed in the
route's own events, read by the official SDKs), after every input stage, billed at the `cached` price.

One gateway serves the module: pool `main` is tests/fake_upstream.py (chat, completions, embeddings; it counts what
it is asked), pools `claude`, `hosted` and `chat` are tests/fake_providers.py (Anthropic Messages, OpenAI Responses,
chat completions a Messages request is translated to; it records what it is asked). Each test keeps to prompts of its
own, so what an upstream was asked for is that test's; tests that reload a policy or need Redis start their own.
"""

from __future__ import annotations

import hashlib
import json
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
import yaml

from tests.conftest import ROOT, Process, pool
from tests.fake_upstream import bag_of_words

MODEL, CLAUDE, GPT, CHAT = "test-model", "claude-sonnet-4-5", "gpt-4.1-mini", "chat-model"
UPSTREAM_KEY = "sk-upstream-5d1e"
KEYS = {
    t: f"sk-{t}-{hashlib.sha256(t.encode()).hexdigest()[:8]}"
    for t in ("alpha", "beta", "limited", "short", "payer", "near", "near2")
}
MAX_ENTRY_BYTES = 4096
CACHED_PRICE = 0.5  # per million tokens: a hit's token costs 500 nanos
GREEDY = {"temperature": 0}  # greedy decoding: a deterministic request (the SDKs take it as an extra field alike)
http = httpx.Client(timeout=30)


def policy(directory: Path, base: dict[str, Any], overlays: dict[str, dict[str, Any]] | None = None) -> str:
    (directory / "tenants").mkdir(parents=True, exist_ok=True)
    doc = {"apiVersion": "portcullis.dev/v1", "kind": "Policy", "metadata": {"name": "cache"}, "spec": base}
    (directory / "base.yaml").write_text(yaml.safe_dump(doc))
    for tenant, spec in (overlays or {}).items():
        over = {"apiVersion": "portcullis.dev/v1", "kind": "TenantPolicy", "metadata": {"name": tenant}}
        (directory / "tenants" / f"{tenant}.yaml").write_text(yaml.safe_dump({**over, "tenant": tenant, "spec": spec}))
    return str(directory)


BASE = {
    "cache": {"enabled": True, "ttl": 60},
    "prices": {"default": {"input": 1.0, "output": 2.0, "cached": CACHED_PRICE}},
}
OVERLAYS = {
    "limited": {"rate_limits": [{"id": "two", "requests": {"limit": 2, "per": "1m"}}]},
    "short": {"cache": {"enabled": True, "ttl": 0.4}},
    **{tenant: {"cache": {"enabled": True, "semantic": {"model": "embed-model"}}} for tenant in ("near", "near2")},
}


def auth() -> dict[str, Any]:
    return {"keys": [{"tenant": t, "sha256": hashlib.sha256(k.encode()).hexdigest()} for t, k in KEYS.items()]}


def fake_providers(launcher) -> Process:
    cmd = [sys.executable, str(ROOT / "tests" / "fake_providers.py"), "--api-key", UPSTREAM_KEY]
    return launcher.spawn(lambda port: [*cmd, "--port", str(port)], "fake-providers", ready_path="/_received")


def pools(upstream: Process, providers: Process) -> list[dict[str, Any]]:
    keyed = {"api_key_env": "FAKE_PROVIDER_KEY"}
    return [
        pool("main", upstream.url, models=[MODEL, "embed-model"]),
        pool("claude", providers.url, models=[CLAUDE], api="anthropic", **keyed),
        pool("hosted", providers.url, models=[GPT], **keyed),
        pool("chat", providers.url, models=[CHAT], **keyed),
    ]


@pytest.fixture(scope="module")
def stack(module_launcher) -> tuple[Process, Process, Process]:
    """(gateway, fake upstream, fake providers)."""
    upstream = module_launcher.fake_upstream()
    providers = fake_providers(module_launcher)
    config = {
        "policy_dir": policy(module_launcher.directory / "policies", BASE, OVERLAYS),
        "auth": auth(),
        "pools": pools(upstream, providers),
        "response_cache": {"max_entry_bytes": MAX_ENTRY_BYTES},
    }
    gw = module_launcher.gateway(config, env={"FAKE_PROVIDER_KEY": UPSTREAM_KEY})
    return gw, upstream, providers


@pytest.fixture(scope="module")
def gw(stack) -> Process:
    return stack[0]


@pytest.fixture(scope="module")
def upstream(stack) -> Process:
    return stack[1]


@pytest.fixture(scope="module")
def providers(stack) -> Process:
    return stack[2]


def asked(upstream: Process) -> int:
    """How many requests the fake upstream has been asked so far."""
    return http.get(upstream.url + "/_stats").json()["requests"]


def asked_about(providers: Process, marker: str) -> int:
    """How many requests the fake providers got that carry `marker`."""
    return sum(marker in json.dumps(r["body"]) for r in http.get(providers.url + "/_received").json())


def unique(text: str = "hello") -> str:
    return f"{text} {uuid.uuid4().hex[:12]}"


def chat(gw: Process, tenant: str = "alpha", headers: dict[str, str] | None = None, **body: Any) -> httpx.Response:
    request = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 0, **body}
    sent = {"authorization": f"Bearer {KEYS[tenant]}", **(headers or {})}
    return http.post(gw.url + "/v1/chat/completions", json=request, headers=sent)


def gpt(gw: Process, tenant: str = "alpha") -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=KEYS[tenant], max_retries=0, timeout=30)


def claude(gw: Process, tenant: str = "alpha") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key=KEYS[tenant], max_retries=0, timeout=30)


def metric(gw: Process, name: str, **labels: str) -> float:
    wanted = name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "} "
    lines = gw.admin.get("/metrics").text.splitlines()
    return next((float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(wanted)), 0.0)


# ---- hits and misses --------------------------------------------------------------------------------------------


def test_the_second_identical_deterministic_request_is_a_hit_and_the_upstream_is_asked_once(gw, upstream) -> None:
    hits = metric(gw, "portcullis_cache_requests_total", route="chat", result="hit")
    before, messages = asked(upstream), [{"role": "user", "content": unique()}]
    first, second = chat(gw, messages=messages), chat(gw, messages=messages)
    assert first.status_code == second.status_code == 200
    assert (first.headers["x-portcullis-cache"], second.headers["x-portcullis-cache"]) == ("miss", "hit")
    assert second.json() == first.json()
    assert asked(upstream) - before == 1
    assert gw.access_log(second.headers["x-request-id"])["cache"] == "hit"
    assert second.headers["x-portcullis-model"] == MODEL
    assert metric(gw, "portcullis_cache_requests_total", route="chat", result="hit") == hits + 1


def test_a_seed_makes_a_request_cacheable_and_sampling_does_not(gw, upstream) -> None:
    before, messages = asked(upstream), [{"role": "user", "content": unique()}]
    sampled = [chat(gw, messages=messages, temperature=0.7) for _ in range(2)]
    default = [chat(gw, messages=messages, temperature=None) for _ in range(2)]  # the API's default: 1
    assert all("x-portcullis-cache" not in r.headers for r in sampled + default), "not cacheable: not looked up"
    assert asked(upstream) - before == 4
    seeded = [chat(gw, messages=messages, temperature=0.7, seed=11) for _ in range(2)]
    assert [r.headers["x-portcullis-cache"] for r in seeded] == ["miss", "hit"]
    assert asked(upstream) - before == 5


def test_no_tenant_is_served_another_tenants_answer(gw, upstream) -> None:
    """Same body, another tenant's key; then that tenant naming the first in every field a client might think
    picks whose cache it shares: always the asking tenant's own entry, never the first's."""
    messages = [{"role": "user", "content": unique()}]
    before = asked(upstream)
    assert [chat(gw, "alpha", messages=messages).headers["x-portcullis-cache"] for _ in range(2)] == ["miss", "hit"]
    for forced in ({"cache_salt": "alpha"}, {"user": "alpha"}, {"safety_identifier": "alpha"}):
        response = chat(gw, "beta", messages=messages, **forced)
        assert response.status_code == 200 and response.headers["x-portcullis-cache"] == "miss", forced
    assert asked(upstream) - before == 4
    # beta's own answers are beta's: cache_salt is the pool's to set (a client's is dropped), so that one is its key
    assert chat(gw, "beta", messages=messages).headers["x-portcullis-cache"] == "hit"
    assert asked(upstream) - before == 4


def test_cache_control_no_store_and_no_cache_are_honoured(gw, upstream) -> None:
    before, messages = asked(upstream), [{"role": "user", "content": unique()}]
    assert "x-portcullis-cache" not in chat(gw, messages=messages, headers={"cache-control": "no-store"}).headers
    assert chat(gw, messages=messages).headers["x-portcullis-cache"] == "miss", "no-store: nothing was stored"
    assert chat(gw, messages=messages).headers["x-portcullis-cache"] == "hit"
    fresh = chat(gw, messages=messages, headers={"cache-control": "no-cache"})
    assert fresh.status_code == 200 and "x-portcullis-cache" not in fresh.headers
    assert asked(upstream) - before == 3


def test_an_answer_expires_after_its_ttl(gw, upstream) -> None:
    before, messages = asked(upstream), [{"role": "user", "content": unique()}]
    assert [chat(gw, "short", messages=messages).headers["x-portcullis-cache"] for _ in range(2)] == ["miss", "hit"]
    time.sleep(0.6)  # the tenant's ttl: 0.4 s
    assert chat(gw, "short", messages=messages).headers["x-portcullis-cache"] == "miss"
    assert asked(upstream) - before == 2


def test_an_answer_over_the_entry_bound_is_never_stored(gw, upstream) -> None:
    before, messages = asked(upstream), [{"role": "user", "content": unique()}]
    big = {"fake": {"chunks": MAX_ENTRY_BYTES // 3}}  # "w0 w1 ...": past the bound
    assert [chat(gw, messages=messages, **big).headers["x-portcullis-cache"] for _ in range(2)] == ["miss", "miss"]
    small = {"fake": {"chunks": 5}}
    assert [chat(gw, messages=messages, **small).headers["x-portcullis-cache"] for _ in range(2)] == ["miss", "hit"]
    assert asked(upstream) - before == 3


def test_embeddings_are_cached(gw, upstream) -> None:
    before, text = asked(upstream), unique("embed me")
    client = gpt(gw)
    first = client.embeddings.with_raw_response.create(model="embed-model", input=[text, "two"])
    second = client.embeddings.with_raw_response.create(model="embed-model", input=[text, "two"])
    assert (first.headers["x-portcullis-cache"], second.headers["x-portcullis-cache"]) == ("miss", "hit")
    assert second.parse().data[0].embedding == first.parse().data[0].embedding
    assert asked(upstream) - before == 1


def test_a_hit_still_counts_against_the_rate_limit(gw, upstream) -> None:
    messages = [{"role": "user", "content": unique()}]
    first, second, third = (chat(gw, "limited", messages=messages) for _ in range(3))
    assert (first.status_code, second.status_code) == (200, 200) and second.headers["x-portcullis-cache"] == "hit"
    assert third.status_code == 429 and third.json()["error"]["code"] == "rate_limit_exceeded", third.text


def test_a_hit_is_billed_at_the_cached_price_and_reported_apart(gw) -> None:
    messages = [{"role": "user", "content": unique()}]
    miss, hit = chat(gw, "payer", messages=messages), chat(gw, "payer", messages=messages)
    assert hit.headers["x-portcullis-cache"] == "hit"
    usage = hit.json()["usage"]
    miss_line, hit_line = gw.access_log(miss.headers["x-request-id"]), gw.access_log(hit.headers["x-request-id"])
    assert miss_line["cost"] == pytest.approx((usage["prompt_tokens"] * 1.0 + usage["completion_tokens"] * 2.0) / 1e6)
    tokens = usage["prompt_tokens"] + usage["completion_tokens"]
    assert hit_line["cost"] == pytest.approx(tokens * CACHED_PRICE / 1e6)
    assert (hit_line["prompt_tokens"], hit_line["completion_tokens"]) == (
        usage["prompt_tokens"],
        tokens - usage["prompt_tokens"],
    )
    deadline = time.monotonic() + 20  # the ledger is written once a second
    while True:
        rows = gw.admin.get("/admin/spend", params={"group_by": "tenant", "tenant": "payer"}).json()["data"]
        if (rows and rows[0]["cache_hits"] == 1) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    [row] = rows
    assert (row["requests"], row["cache_hits"], row["cache_hit_tokens"]) == (1, 1, tokens)
    assert (row["prompt_tokens"], row["completion_tokens"]) == (usage["prompt_tokens"], usage["completion_tokens"])
    assert row["cost_nanos"] == round(miss_line["cost"] * 1e9) + tokens * 500
    billed = metric(gw, "portcullis_billed_tokens_total", tenant="payer", model=MODEL, kind="cache_hit")
    assert billed == tokens


# ---- streams: a cached answer in each route's own events, read by the official SDKs --------------------------------


def test_a_cached_chat_answer_streams_as_chat_chunks(gw, upstream) -> None:
    before, messages = asked(upstream), [{"role": "user", "content": unique()}]
    whole = gpt(gw).chat.completions.create(model=MODEL, messages=messages, extra_body=GREEDY)
    with gpt(gw).chat.completions.with_streaming_response.create(
        model=MODEL, messages=messages, temperature=0, stream=True, stream_options={"include_usage": True}
    ) as response:
        assert response.headers["x-portcullis-cache"] == "hit"
        chunks = list(response.parse())
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == whole.usage.total_tokens
    assert asked(upstream) - before == 1


def test_a_streamed_chat_answer_is_assembled_and_served_whole(gw, providers) -> None:
    marker = unique()
    messages = [{"role": "user", "content": marker}]
    stream = gpt(gw).chat.completions.create(model=CHAT, messages=messages, temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    raw = gpt(gw).chat.completions.with_raw_response.create(model=CHAT, messages=messages, extra_body=GREEDY)
    assert raw.headers["x-portcullis-cache"] == "hit"
    assert raw.parse().choices[0].message.content == text == marker
    assert asked_about(providers, marker) == 1


def test_a_cached_response_streams_as_responses_events(gw, providers) -> None:
    marker = unique("Say this back")
    whole = gpt(gw).responses.create(model=GPT, input=marker, temperature=0)
    with gpt(gw).responses.stream(model=GPT, input=marker, temperature=0) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == whole.output_text == marker
    assert final.id == whole.id and final.usage == whole.usage
    # and the other way: a stream assembled from response.completed, served whole
    other = unique("Say this back")
    with gpt(gw).responses.stream(model=GPT, input=other, temperature=0) as stream:
        streamed = stream.get_final_response()
    raw = gpt(gw).responses.with_raw_response.create(model=GPT, input=other, temperature=0)
    assert raw.headers["x-portcullis-cache"] == "hit" and raw.parse().output_text == streamed.output_text == other
    assert asked_about(providers, marker) == asked_about(providers, other) == 1


@pytest.mark.parametrize("model", [CLAUDE, CHAT], ids=["anthropic-pool", "translated"])
def test_a_cached_message_streams_as_messages_events(gw, providers, model) -> None:
    marker = unique("Repeat after me")
    messages = [{"role": "user", "content": marker}]
    whole = claude(gw).messages.create(model=model, max_tokens=64, messages=messages, extra_body=GREEDY)
    with claude(gw).messages.stream(model=model, max_tokens=64, messages=messages, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
        assert stream.response.headers["x-portcullis-cache"] == "hit"
    assert text == final.content[0].text == whole.content[0].text == marker
    assert final.stop_reason == whole.stop_reason == "end_turn"
    # and the other way: a stream assembled as it passed, served whole
    other = unique("Repeat after me")
    again = [{"role": "user", "content": other}]
    with claude(gw).messages.stream(model=model, max_tokens=64, messages=again, extra_body=GREEDY) as stream:
        streamed = stream.get_final_message()
    raw = claude(gw).messages.with_raw_response.create(model=model, max_tokens=64, messages=again, extra_body=GREEDY)
    assert raw.headers["x-portcullis-cache"] == "hit" and raw.parse().content[0].text == streamed.content[0].text
    assert asked_about(providers, marker) == asked_about(providers, other) == 1


# ---- the input stages hold for a hit -----------------------------------------------------------------------------


def test_the_waf_and_the_guards_still_judge_a_request_the_cache_holds(launcher, tmp_path) -> None:
    """Answers cached under a policy without rules; the policy then gains a WAF rule, an input guard that blocks
    secrets and an output guard that redacts PII: the same requests are refused though the cache holds their
    answers, and a cached answer reaches the client redacted, as the guard of the moment has it."""
    providers = fake_providers(launcher)
    directory = tmp_path / "policies"
    config = {"policy_dir": policy(directory, BASE), "auth": auth(), "pools": pools(providers, providers)}
    gw = launcher.gateway(config, env={"FAKE_PROVIDER_KEY": UPSTREAM_KEY})
    secret = [{"role": "user", "content": f"the key is AKIAIOSFODNN7EXAMPLE, keep it {unique()}"}]
    banned = [{"role": "user", "content": f"tell me about forbidden-topic {unique()}"}]
    email = [{"role": "user", "content": f"write to jane.doe@example.com {unique()}"}]  # the fake says it back
    for messages in (secret, banned, email):
        answers = [chat(gw, messages=messages, model=CHAT) for _ in range(2)]
        assert [a.headers["x-portcullis-cache"] for a in answers] == ["miss", "hit"]
    assert "jane.doe@example.com" in answers[1].json()["choices"][0]["message"]["content"]
    version = gw.admin.get("/admin/policy").json()["version"]
    rule = {"id": "no-topic", "when": {"target": "prompt", "regex": "forbidden-topic"}}
    guard = {
        "enabled": True,
        "injection": {"enabled": False},
        "pii": {"secrets": "block"},
        "output": {"enabled": True, "injection": "off", "pii": "redact", "secrets": "block"},
    }
    policy(directory, {**BASE, "waf": {"rules": [rule]}, "guard": guard})
    deadline = time.monotonic() + 15
    while gw.admin.get("/admin/policy").json()["version"] == version:
        assert time.monotonic() < deadline, "the policy was not reloaded"
        time.sleep(0.1)
    blocked = chat(gw, messages=banned, model=CHAT)
    assert blocked.status_code == 403 and blocked.json()["error"]["code"] == "waf_blocked"
    guarded = chat(gw, messages=secret, model=CHAT)
    assert guarded.status_code == 400 and guarded.json()["error"]["code"] == "prompt_blocked"
    redacted = chat(gw, messages=email, model=CHAT)
    assert redacted.headers["x-portcullis-cache"] == "hit"
    assert "[REDACTED:EMAIL]" in redacted.json()["choices"][0]["message"]["content"]
    for messages in (secret, banned, email):
        assert asked_about(providers, messages[0]["content"]) == 1, "each asked upstream once, before the policy"


# ---- a fleet: Redis ----------------------------------------------------------------------------------------------


def test_the_redis_store_serves_an_answer_one_gateway_stored_to_another(launcher, tmp_path, redis_server) -> None:
    upstream = launcher.fake_upstream()
    config = {
        "policy_dir": policy(tmp_path / "policies", BASE),
        "auth": auth(),
        "pools": [pool("main", upstream.url, models=[MODEL])],
        "redis": {"url": redis_server.url},
        "response_cache": {"store": "redis", "key_prefix": "test-cache:"},
    }
    one, two = launcher.gateway(config), launcher.gateway(config)
    messages = [{"role": "user", "content": unique()}]
    first = chat(one, messages=messages)
    assert first.headers["x-portcullis-cache"] == "miss"
    deadline = time.monotonic() + 5  # stored beside the answer, not before it
    while not redis_server.client().keys("test-cache:*"):
        assert time.monotonic() < deadline, "nothing was stored in Redis"
        time.sleep(0.02)
    second = chat(two, messages=messages)
    assert second.headers["x-portcullis-cache"] == "hit" and second.json() == first.json()
    assert chat(two, "beta", messages=messages).headers["x-portcullis-cache"] == "miss"
    assert asked(upstream) == 2
    [key] = [k for k in redis_server.client().keys("test-cache:*") if redis_server.client().pttl(k) > 0][:1]
    assert 0 < redis_server.client().pttl(key) <= 60_000


def test_a_stalled_redis_store_is_a_miss_and_soon_left_alone(launcher, tmp_path, redis_server) -> None:
    """Redis stops answering (SIGSTOP): a request waits out `redis.timeout` for the lookup and is served as a miss;
    after `redis.breaker_failures` such waits the store is skipped, and requests no longer wait at all."""
    upstream = launcher.fake_upstream()
    timeout = 1.0
    config = {
        "policy_dir": policy(tmp_path / "policies", BASE),
        "auth": auth(),
        "pools": [pool("main", upstream.url, models=[MODEL])],
        "redis": {"url": redis_server.url, "timeout": timeout, "breaker_failures": 2, "breaker_cooldown": 60},
        "response_cache": {"store": "redis"},
    }
    gw = launcher.gateway(config)
    assert chat(gw, messages=[{"role": "user", "content": unique()}]).headers["x-portcullis-cache"] == "miss"
    assert redis_server.proc is not None
    redis_server.proc.send_signal(signal.SIGSTOP)
    try:
        took = []
        for _ in range(5):
            started = time.monotonic()
            response = chat(gw, messages=[{"role": "user", "content": unique()}])
            took.append(time.monotonic() - started)
            assert response.status_code == 200 and response.headers["x-portcullis-cache"] == "miss"
    finally:
        redis_server.proc.send_signal(signal.SIGCONT)
    assert took[0] >= timeout, "the first lookup waited for the stalled Redis"
    assert max(took[3:]) < timeout, f"once the breaker opened, no request waits for Redis: {took}"


def test_anonymous_callers_share_no_cache(launcher, tmp_path) -> None:
    """A gateway with no keys serves every caller as the one tenant 'anonymous': nothing is cached for them."""
    upstream = launcher.fake_upstream()
    gw = launcher.gateway({"policy_dir": policy(tmp_path / "policies", BASE), "pools": [pool("main", upstream.url)]})
    body = {"model": MODEL, "messages": [{"role": "user", "content": unique()}], "temperature": 0}
    answers = [http.post(gw.url + "/v1/chat/completions", json=body) for _ in range(2)]
    assert [a.status_code for a in answers] == [200, 200]
    assert all("x-portcullis-cache" not in a.headers for a in answers)
    assert asked(upstream) == 2


# ---- the semantic match (opt-in): the fake upstream's embeddings are bags of words ----------------------------------


def ask_near(gw: Process, text: str, tenant: str = "near", **body: Any) -> httpx.Response:
    """A chat request to the fake providers' chat pool, which says the last user text back."""
    return chat(gw, tenant, model=CHAT, messages=[{"role": "user", "content": text}], **body)


def fresh_topic(*words: str) -> str:
    """A word of its own, hashed by the fake's bag of words into a number none of `words` shares (a shared one would
    make two texts more alike than their words are)."""
    taken = {bag_of_words(word).index(1.0) for word in words}
    while True:
        topic = uuid.uuid4().hex[:8]
        if bag_of_words(topic).index(1.0) not in taken:
            return topic


def test_a_paraphrase_is_answered_with_the_answer_to_its_original(gw, upstream, providers) -> None:
    topic = fresh_topic("what", "is", "the", "capital", "of", "today")
    original = f"What is the capital of {topic}?"
    first = ask_near(gw, original)
    assert first.headers["x-portcullis-cache"] == "miss"
    embeddings = http.get(upstream.url + "/_stats").json()["embeddings"]
    paraphrase = ask_near(gw, f"what IS the capital of {topic}")  # the same words: the same embedding
    assert paraphrase.headers["x-portcullis-cache"] == "semantic-hit"
    assert paraphrase.json()["choices"][0]["message"]["content"] == original, "the original's answer"
    assert http.get(upstream.url + "/_stats").json()["embeddings"] == embeddings + 1
    assert gw.access_log(paraphrase.headers["x-request-id"])["cache"] == "semantic_hit"
    # a question that shares most words but not all is below the threshold: its own answer
    other = ask_near(gw, f"What is the capital of {topic} today?")
    assert other.headers["x-portcullis-cache"] == "miss"
    assert other.json()["choices"][0]["message"]["content"].endswith("today?")
    assert asked_about(providers, topic) == 2


def test_texts_whose_words_ask_another_question_are_no_semantic_hit(gw, providers) -> None:
    """The fake's embeddings of the same words in another order are equal (a similarity of 1): the words tell the
    two questions apart (gateway/cache/wording.py), so each gets its own answer."""
    here, there = fresh_topic("how", "long", "is", "the", "flight", "from", "to"), uuid.uuid4().hex[:8]
    assert ask_near(gw, f"How long is the flight from {here} to {there}?").headers["x-portcullis-cache"] == "miss"
    back = ask_near(gw, f"How long is the flight from {there} to {here}?")
    assert back.headers["x-portcullis-cache"] == "miss"
    assert back.json()["choices"][0]["message"]["content"].endswith(f"from {there} to {here}?"), "its own answer"
    assert (
        ask_near(gw, f"how long is the flight from {here} to {there}").headers["x-portcullis-cache"] == "semantic-hit"
    )


def test_the_semantic_match_is_per_tenant_and_leaves_out_tools_and_other_settings(gw, providers) -> None:
    topic = uuid.uuid4().hex[:8]
    assert ask_near(gw, f"Tell me about {topic}.").headers["x-portcullis-cache"] == "miss"
    assert ask_near(gw, f"tell me about {topic}", "near2").headers["x-portcullis-cache"] == "miss"
    assert ask_near(gw, f"tell me about {topic}", max_tokens=7).headers["x-portcullis-cache"] == "miss"
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
    assert ask_near(gw, f"Tell me about {topic}!", tools=[tool]).headers["x-portcullis-cache"] == "miss"
    assert ask_near(gw, f"Tell me about {topic}!", tools=[tool]).headers["x-portcullis-cache"] == "hit", "exact"
    assert ask_near(gw, f"tell me about {topic}?", tools=[tool]).headers["x-portcullis-cache"] == "miss"
    assert asked_about(providers, topic) == 5
