"""A batch's requests smuggling what the gateway refuses in a request sent alone: each request of an OpenAI batch
input file and of an Anthropic Message Batch meets the WAF's rules and the input guard (the real bundled classifier,
the PII and secret detectors) with the key's tenant's policy when the batch is made, through a real gateway in front
of tests/fake_providers.py (OpenAI's Files and Batches) and tests/fake_upstream.py (Anthropic's Message Batches,
echoed), called with the official SDKs.

One gateway serves the module (it loads the classifier): tenant `ann` has the base policy (WAF rule on a code name,
injection and secrets blocked, PII redacted), tenant `mo` only monitors, tenant `tight` has half a second of
classifier time a request. "Nothing went upstream" is read from the
fake's record of what it received, by the gateway's request id.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
import yaml

from gateway.tenancy.batch_requests import MAX_SCANNED_REQUESTS
from tests.conftest import Launcher, Process, pool
from tests.hostile.test_tenant_objects import GPT, UPSTREAM_KEY, fake_provider, received
from tests.integration.test_guard_gateway import BENIGN, INJECTION, guard_policy, series

KEYS = {"ann": "sk-portcullis-ann-b47c", "mo": "sk-portcullis-mo-b47c", "tight": "sk-portcullis-tight-b47c"}
CLAUDE = "claude-sonnet-4-5"
AWS_KEY = "AKIAIOSFODNN7EXAMPLE"
CODE_NAME = "Project Nightjar"  # what the policy's own WAF rule refuses in a prompt


def waf_policy(mode: str) -> dict[str, Any]:
    rule = {"id": "no-code-name", "action": "block", "status": 403, "when": {"target": "prompt", "regex": CODE_NAME}}
    return {"mode": mode, "packs": [], "rules": [rule]}


def with_waf(path: str, waf: dict[str, Any]) -> None:
    """The policy file at `path` with a WAF section too."""
    document = yaml.safe_load(Path(path).read_text())
    document["spec"]["waf"] = waf
    Path(path).write_text(yaml.safe_dump(document))


@pytest.fixture(scope="module")
def fake(module_launcher: Launcher) -> Process:
    return fake_provider(module_launcher)


@pytest.fixture(scope="module")
def claude_upstream(module_launcher: Launcher) -> Process:
    return module_launcher.fake_upstream()


@pytest.fixture(scope="module")
def gw(module_launcher: Launcher, fake: Process, claude_upstream: Process, tmp_path_factory) -> Process:
    guard = {"enabled": True, "injection": {"action": "block"}, "pii": {"pii": "redact", "secrets": "block"}}
    watch = {"injection": {"action": "monitor"}, "pii": {"pii": "monitor", "secrets": "monitor"}}
    tight = {"injection": {"cpu_budget": 0.5}}
    policies = guard_policy(tmp_path_factory.mktemp("batch"), guard, {"mo": watch, "tight": tight})
    with_waf(f"{policies}/base.yaml", waf_policy("block"))
    with_waf(f"{policies}/tenants/mo.yaml", {"mode": "monitor"})
    auth = {"keys": [{"tenant": t, "sha256": hashlib.sha256(k.encode()).hexdigest()} for t, k in KEYS.items()]}
    pools = [
        pool(
            "openai",
            fake.url,
            models=[GPT],
            api_key_env="BATCH_UPSTREAM_KEY",
            passthrough=["/v1/files*", "/v1/batches*"],
        ),
        pool("claude", claude_upstream.url, api="anthropic", models=[CLAUDE], passthrough=["/v1/messages/batches*"]),
    ]
    config = {"pools": pools, "auth": auth, "policy_dir": policies}
    return module_launcher.gateway(config, env={"BATCH_UPSTREAM_KEY": UPSTREAM_KEY})


def openai_client(gw: Process, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=KEYS[tenant], max_retries=0, timeout=120)


def chat_line(number: int, prompt: str) -> dict[str, Any]:
    body = {"model": GPT, "messages": [{"role": "user", "content": prompt}]}
    return {"custom_id": f"r{number}", "method": "POST", "url": "/v1/chat/completions", "body": body}


def responses_line(number: int, prompt: str) -> dict[str, Any]:
    return {
        "custom_id": f"r{number}",
        "method": "POST",
        "url": "/v1/responses",
        "body": {"model": GPT, "input": prompt},
    }


def batch(gw: Process, tenant: str, endpoint: str, lines: list[dict[str, Any]]) -> Any:
    """The batch made with the lines as its input file (uploaded through the gateway): the raw answer."""
    client = openai_client(gw, tenant)
    text = "".join(json.dumps(line) + "\n" for line in lines)
    input_file = client.files.create(file=("batch.jsonl", text.encode()), purpose="batch").id
    return client.batches.with_raw_response.create(input_file_id=input_file, endpoint=endpoint, completion_window="24h")


def batches_sent(fake: Process, request_id: str) -> list[dict[str, Any]]:
    return [r for r in received(fake, request_id) if r["path"] == "/v1/batches"]


def refused(fake: Process, error: openai.APIStatusError, status: int, code: str, where: str) -> None:
    """The batch was refused with `status` and `code`, naming the request, and nothing of it went upstream."""
    assert error.status_code == status and error.code == code, error.body
    assert error.body["param"].startswith(where), error.body
    assert batches_sent(fake, error.response.headers["x-request-id"]) == [], "the batch reached the upstream"


def test_an_injection_in_a_chat_batchs_line_is_refused_naming_the_line(gw, fake) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        batch(gw, "ann", "/v1/chat/completions", [chat_line(1, BENIGN), chat_line(2, INJECTION)])
    refused(fake, caught.value, 400, "prompt_blocked", "input_file_id line 2: guard.injection")


def test_a_secret_in_a_responses_batchs_line_is_refused(gw, fake) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        batch(gw, "ann", "/v1/responses", [responses_line(1, f"deploy with key {AWS_KEY} please")])
    refused(fake, caught.value, 400, "prompt_blocked", "input_file_id line 1: guard.secret")


def test_a_waf_rule_matching_a_lines_prompt_refuses_the_batch(gw, fake) -> None:
    lines = [chat_line(1, BENIGN), chat_line(2, BENIGN), chat_line(3, f"summarise the {CODE_NAME} roadmap")]
    with pytest.raises(openai.PermissionDeniedError) as caught:
        batch(gw, "ann", "/v1/chat/completions", lines)
    refused(fake, caught.value, 403, "waf_blocked", "input_file_id line 3: no-code-name")


def test_a_line_the_policy_would_redact_or_the_gateway_cannot_read_refuses_the_batch(gw, fake) -> None:
    """A file cannot be rewritten: PII the policy redacts in a request refuses a batch; a line on a route the gateway
    does not serve, or without a body to read, is never skipped."""
    with pytest.raises(openai.BadRequestError) as caught:
        batch(gw, "ann", "/v1/chat/completions", [chat_line(1, "mail the invoice to jane.doe@example.com")])
    refused(fake, caught.value, 400, "batch_request_redacted", "input_file_id line 1")
    unserved = {**chat_line(2, INJECTION), "url": "/v1/moderations"}
    for line in (unserved, {**chat_line(2, INJECTION), "body": "not an object"}):
        with pytest.raises(openai.BadRequestError) as caught:
            batch(gw, "ann", "/v1/chat/completions", [chat_line(1, BENIGN), line])
        refused(fake, caught.value, 400, "batch_request_unreadable", "input_file_id line 2")


def test_a_batch_naming_its_input_file_other_than_by_its_id_is_refused(gw, fake) -> None:
    """An upstream that takes `input_file_id` as an object or a list would run a file whose requests the gateway
    never read: only one id, a string, is taken."""
    client = openai_client(gw, "ann")
    text = json.dumps(chat_line(1, INJECTION)) + "\n"
    input_file = client.files.create(file=("batch.jsonl", text.encode()), purpose="batch").id
    for named in ({"id": input_file}, [input_file], {"type": "file"}, 5):
        body = {"input_file_id": named, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
        answer = httpx.post(f"{gw.url}/v1/batches", json=body, headers={"authorization": f"Bearer {KEYS['ann']}"})
        error = answer.json()["error"]
        assert (answer.status_code, error["param"]) == (400, "input_file_id"), (named, answer.text)
        assert batches_sent(fake, answer.headers["x-request-id"]) == [], f"{named!r} reached the upstream"


def test_a_clean_batch_reaches_the_upstream(gw, fake) -> None:
    made = batch(gw, "ann", "/v1/chat/completions", [chat_line(1, BENIGN), chat_line(2, "Name three rivers.")])
    assert made.parse().status == "validating"
    assert batches_sent(fake, made.headers["x-request-id"]), "the batch never reached the upstream"


def test_a_monitoring_tenants_batch_is_made_and_its_findings_counted(gw, fake) -> None:
    """`monitor` records what each request holds, as for a request sent alone, and makes the batch."""
    monitored = {
        category: f'portcullis_guard_verdicts_total{{category="{category}",provenance="user",result="monitor",'
        for category in ("prompt_injection", "secret")
    }
    before = {category: series(gw, prefix) for category, prefix in monitored.items()}
    lines = [chat_line(1, INJECTION), chat_line(2, f"key {AWS_KEY}, {CODE_NAME}, jane.doe@example.com")]
    made = batch(gw, "mo", "/v1/chat/completions", lines)
    assert made.parse().status == "validating"
    assert batches_sent(fake, made.headers["x-request-id"]), "the batch never reached the upstream"
    for category, prefix in monitored.items():
        assert series(gw, prefix) > before[category], f"no {category} finding was counted"


def test_an_injection_in_a_message_batchs_inline_request_is_refused(gw, claude_upstream) -> None:
    claude = anthropic.Anthropic(base_url=gw.url, api_key=KEYS["ann"], max_retries=0, timeout=120)

    def request(number: int, prompt: str) -> dict[str, Any]:
        params = {"model": CLAUDE, "max_tokens": 16, "messages": [{"role": "user", "content": prompt}]}
        return {"custom_id": f"r{number}", "params": params}

    passed = httpx.get(claude_upstream.url + "/_stats").json()["passed_through"]
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.batches.create(requests=[request(0, BENIGN), request(1, INJECTION)])  # type: ignore[list-item]
    error = caught.value.body
    assert isinstance(error, dict) and error["type"] == "error", error  # Anthropic's error shape
    assert error["error"]["message"].startswith("requests[1].params: prompt blocked by the guard"), error
    assert httpx.get(claude_upstream.url + "/_stats").json()["passed_through"] == passed, "the batch went upstream"

    made = claude.messages.batches.with_raw_response.create(requests=[request(0, BENIGN)])  # type: ignore[list-item]
    assert made.status_code == 201
    assert httpx.get(claude_upstream.url + "/_stats").json()["passed_through"] == passed + 1


def test_a_batch_past_the_guards_bound_is_refused_before_it_is_scanned(gw, fake) -> None:
    lines = [chat_line(n, BENIGN) for n in range(1, MAX_SCANNED_REQUESTS + 2)]
    with pytest.raises(openai.APIStatusError) as caught:
        batch(gw, "ann", "/v1/chat/completions", lines)
    where = f"input_file_id line {MAX_SCANNED_REQUESTS + 1}"
    refused(fake, caught.value, 413, "batch_too_large_to_scan", where)


def test_a_batchs_scans_share_one_requests_cpu_budget(gw, fake) -> None:
    """Each request alone scans well within the budget; all of them together do not."""
    lines = [chat_line(n, f"What is {n} plus {n * 7}, and why?") for n in range(1, 401)]
    with pytest.raises(openai.APIStatusError) as caught:
        batch(gw, "tight", "/v1/chat/completions", lines)
    refused(fake, caught.value, 413, "batch_too_large_to_scan", "guard.injection.cpu_budget")


def test_an_anonymous_callers_batch_meets_the_waf_too(module_launcher: Launcher, fake: Process, tmp_path) -> None:
    """Without keys the gateway keeps no objects apart, and still reads a batch's requests (here with the WAF
    alone)."""
    policies = guard_policy(tmp_path, {"enabled": False})
    with_waf(f"{policies}/base.yaml", waf_policy("block"))
    passthrough = ["/v1/files*", "/v1/batches*"]
    openai_pool = pool("openai", fake.url, models=[GPT], api_key_env="BATCH_UPSTREAM_KEY", passthrough=passthrough)
    anonymous = module_launcher.gateway(
        {"pools": [openai_pool], "policy_dir": policies}, env={"BATCH_UPSTREAM_KEY": UPSTREAM_KEY}
    )
    client = openai.OpenAI(base_url=anonymous.url + "/v1", api_key="no-key-needed", max_retries=0, timeout=30)
    text = json.dumps(chat_line(1, f"what is {CODE_NAME}?")) + "\n"
    input_file = client.files.create(file=("batch.jsonl", text.encode()), purpose="batch").id
    with pytest.raises(openai.PermissionDeniedError) as caught:
        client.batches.create(input_file_id=input_file, endpoint="/v1/chat/completions", completion_window="24h")
    refused(fake, caught.value, 403, "waf_blocked", "input_file_id line 1: no-code-name")

    text = "".join(json.dumps(chat_line(n, BENIGN)) + "\n" for n in range(1, MAX_SCANNED_REQUESTS + 2))
    input_file = client.files.create(file=("batch.jsonl", text.encode()), purpose="batch").id
    with pytest.raises(openai.APIStatusError) as caught:  # the WAF's reading is bounded too
        client.batches.create(input_file_id=input_file, endpoint="/v1/chat/completions", completion_window="24h")
    refused(fake, caught.value, 413, "batch_too_large_to_scan", f"input_file_id line {MAX_SCANNED_REQUESTS + 1}")
