"""Bounded input: the JSON limits of `limits:` in portcullis.yaml, each hit through a real gateway with its own named
4xx and the JSON path in `param`, and big bodies kept off the event loop so a burst of them cannot stall it.

Each test configures its gateway its own way; they share the module's fake upstream, counted as a change."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml

from tests.conftest import Launcher, Process, chat_body, pool

KEY = "sk-hostile-bounds"
AUTH = {"keys": [{"tenant": "t", "sha256": hashlib.sha256(KEY.encode()).hexdigest()}]}
HEADERS = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
CHAT = "/v1/chat/completions"


def nested(depth: int) -> object:
    """`depth` levels of objects and arrays, alternating."""
    node: object = "leaf"
    for level in range(depth):
        node = [node] if level % 2 else {"k": node}
    return node


def messages(count: int) -> list[dict]:
    return [{"role": "user", "content": "hi"}] * count


def tools(count: int) -> list[dict]:
    return [{"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}} for i in range(count)]


def post(gw, payload: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(gw.url + CHAT, content=json.dumps(payload).encode(), headers=headers or HEADERS, timeout=60)


def refused(response: httpx.Response, status: int, code: str, limit: int, param: str | None) -> str | None:
    """What is wrong with a refusal, or None: the status, the code, the limit named, the JSON path in `param`."""
    try:
        error = response.json()["error"]
    except (ValueError, KeyError):
        return f"{response.status_code} {response.text[:200]!r}"
    if (
        response.status_code != status
        or error["code"] != code
        or str(limit) not in error["message"]
        or (param is not None and error["param"] != param)
    ):
        return f"{response.status_code} {error}"
    return None


@pytest.fixture(scope="module")
def upstream(module_launcher: Launcher) -> Process:
    return module_launcher.fake_upstream()


def test_default_limits_refuse_what_is_past_them_and_serve_what_is_at_them(upstream, gateway):
    gw = gateway({"pools": [pool("main", upstream.url)], "auth": AUTH})
    served = httpx.get(upstream.url + "/_stats").json()["requests"]
    past = {
        "2049 messages": (chat_body(messages=messages(2049)), 400, "array_above_max_length", 2048, "messages"),
        "129 tools": (chat_body(tools=tools(129)), 400, "array_above_max_length", 128, "tools"),
        "a string of 1 Mi + 1 characters": (
            chat_body(messages=[{"role": "user", "content": "a" * (1024 * 1024 + 1)}]),
            400,
            "string_above_max_length",
            1024 * 1024,
            "messages[0].content",
        ),
        "a key of 1 Mi + 1 characters": (
            chat_body(metadata={"k" * (1024 * 1024 + 1): 1}),
            400,
            "string_above_max_length",
            1024 * 1024,
            "metadata",
        ),
        "65 levels of nesting": (chat_body(metadata=nested(64)), 400, "json_too_deep", 64, None),
        "128 Ki + 1 values": (chat_body(metadata=[0] * (128 * 1024)), 413, "too_many_json_values", 128 * 1024, None),
    }
    wrong = [
        f"{what}: {problem}"
        for what, (payload, *expected) in past.items()
        if (problem := refused(post(gw, payload), *expected))
    ]
    assert not wrong, "\n".join(wrong)
    assert httpx.get(upstream.url + "/_stats").json()["requests"] == served
    at = {
        "2048 messages": chat_body(messages=messages(2048)),
        "128 tools": chat_body(tools=tools(128)),
        "a string of 1 Mi characters": chat_body(messages=[{"role": "user", "content": "a" * 1024 * 1024}]),
        "64 levels of nesting": chat_body(metadata=nested(63)),
        "100k values": chat_body(metadata=[0] * 100_000),
    }
    served = {what: post(gw, payload).status_code for what, payload in at.items()}
    assert served == {what: 200 for what in at}


def test_operator_limits_apply_and_are_named(upstream, gateway):
    limits = {"max_json_depth": 8, "max_json_values": 200, "max_string_chars": 64, "max_messages": 4, "max_tools": 2}
    gw = gateway({"pools": [pool("main", upstream.url)], "auth": AUTH, "limits": limits})
    past = {
        "messages": (chat_body(messages=messages(5)), 400, "array_above_max_length", 4, "messages"),
        "tools": (chat_body(tools=tools(3)), 400, "array_above_max_length", 2, "tools"),
        "string": (
            chat_body(messages=[{"role": "user", "content": "x" * 65}]),
            400,
            "string_above_max_length",
            64,
            "messages[0].content",
        ),
        "depth": (
            chat_body(metadata={"a": [{"b": [{"c": [{"d": [1]}]}]}]}),
            400,
            "json_too_deep",
            8,
            "metadata.a[0].b[0].c[0].d",
        ),
        "values": (chat_body(metadata=list(range(200))), 413, "too_many_json_values", 200, None),
    }
    wrong = [
        f"{what}: {problem}"
        for what, (payload, *expected) in past.items()
        if (problem := refused(post(gw, payload), *expected))
    ]
    assert not wrong, "\n".join(wrong)
    within = chat_body(messages=messages(4), tools=tools(2), metadata={"a": [{"b": [{"c": 1}]}]})
    assert post(gw, within).status_code == 200


@pytest.fixture
def waf_policies(tmp_path: Path) -> str:
    directory = tmp_path / "policies"
    directory.mkdir()
    (directory / "base.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "portcullis.dev/v1",
                "kind": "Policy",
                "metadata": {"name": "t"},
                "spec": {"waf": {"packs": ["protocol", "scanners", "sqli", "xss", "lfi", "rce", "llm"]}},
            }
        )
    )
    return str(directory)


def test_a_burst_of_big_bodies_does_not_stall_the_event_loop(upstream, gateway, waf_policies):
    """Big bodies, anonymous (refused by a limit, or judged by the WAF before auth) and authenticated (a long
    prompt to tokenize), all at once: /healthz keeps answering while they are worked on."""
    gw = gateway(
        {
            "pools": [pool("main", upstream.url)],
            "auth": AUTH,
            "policy_dir": waf_policies,
            "models": [{"name": "test-model", "tokenizer": "bundled"}],
        }
    )  # ~1 s per MB of prompt
    anonymous = {"content-type": "application/json"}
    text = "the quick brown fox jumps over the lazy dog " * 23_000  # ~1 MB: under the string and prompt limits
    burst = [  # (body, headers, status): each one costs the old event loop a second or more
        (chat_body(messages=messages(100_000)), anonymous, 400),  # 3 MB, pre-auth
        (chat_body(messages=messages(100_000)), anonymous, 400),
        (chat_body(metadata={"a": text, "b": text, "c": text}), anonymous, 401),  # 3 MB of WAF-scanned text, then auth
        (chat_body(metadata=list(range(100_000))), anonymous, 401),  # 100k WAF-scanned values, then auth
        (chat_body(messages=[{"role": "user", "content": text}]), HEADERS, 200),  # 1 MB to tokenize
    ]
    latencies: list[float] = []
    done = threading.Event()

    def probe() -> None:
        with httpx.Client(timeout=30) as client:
            while not done.is_set():
                started = time.perf_counter()
                assert client.get(gw.url + "/healthz").status_code == 200
                latencies.append(time.perf_counter() - started)
                time.sleep(0.05)

    with ThreadPoolExecutor(len(burst) + 1) as pool_:
        prober = pool_.submit(probe)
        time.sleep(0.2)
        started = time.perf_counter()
        results = list(pool_.map(lambda job: post(gw, job[0], job[1]).status_code, burst))
        busy = time.perf_counter() - started
        done.set()
        prober.result()
    assert len(latencies) > 3, f"the burst took {busy:.1f}s"
    assert max(latencies) < 1.5, f"slowest /healthz {max(latencies):.2f}s during a {busy:.1f}s burst"
    assert results == [status for _, _, status in burst]
