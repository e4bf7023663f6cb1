"""The WAF in a real gateway process: OpenAI-shaped blocks, audit log, redaction, per-tenant overlays before auth,
and hot reload (a broken edit keeps the old policy serving; a good edit takes effect without dropping requests)."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import chat_body, pool

KEYS = {"sk-a": "team-a", "sk-b": "team-b"}
AUTH = {
    "keys": [
        {"tenant": t, "label": "ops" if t == "team-a" else "", "sha256": hashlib.sha256(k.encode()).hexdigest()}
        for k, t in KEYS.items()
    ]
}
URL = "/v1/chat/completions"

# One client for the module's requests: a bare httpx.post builds a client, and its TLS context, per call.
http = httpx.Client()


@pytest.fixture(scope="module")
def upstream(module_launcher):
    """The module's upstream; each test keeps its own gateway (its own policy, or a policy it reloads)."""
    return module_launcher.fake_upstream()


def write(directory: Path, waf: dict, overlays: dict | None = None) -> None:
    (directory / "tenants").mkdir(parents=True, exist_ok=True)
    doc = {"apiVersion": "portcullis.dev/v1", "kind": "Policy", "metadata": {"name": "t"}, "spec": {"waf": waf}}
    (directory / "base.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    for tenant, spec in (overlays or {}).items():
        over = {
            "apiVersion": "portcullis.dev/v1",
            "kind": "TenantPolicy",
            "metadata": {"name": tenant},
            "tenant": tenant,
            "spec": spec,
        }
        (directory / "tenants" / f"{tenant}.yaml").write_text(yaml.safe_dump(over))


def start(gateway, upstream, directory: Path):
    return gateway({"pools": [pool("main", upstream.url)], "auth": AUTH, "policy_dir": str(directory)})


def post(gw, key="sk-b", query="", **body) -> httpx.Response:
    return http.post(
        gw.url + URL + query, json=chat_body(**body), headers={"authorization": f"Bearer {key}"}, timeout=10
    )


def audit_lines(gw) -> list[dict]:
    out = []
    for line in gw.output().splitlines():
        if line.startswith("{") and '"type":"waf"' in line:
            out.append(json.loads(line))
    return out


def test_blocks_are_openai_shaped_audited_and_never_reach_the_upstream(upstream, gateway, tmp_path):
    before = http.get(upstream.url + "/_stats").json()["requests"]
    write(tmp_path / "p", {"packs": ["protocol", "scanners", "sqli", "xss", "lfi", "rce", "llm"]})
    gw = start(gateway, upstream, tmp_path / "p")
    assert post(gw).status_code == 200
    blocked = post(gw, query="?id=1%27%20or%20%271%27=%271")
    assert blocked.status_code == 403
    error = blocked.json()["error"]
    assert error["code"] == "waf_blocked" and "sqli-100" in error["param"].split(",")
    assert blocked.headers["x-request-id"] in error["message"]
    key = post(gw, messages=[{"role": "user", "content": "-----BEGIN RSA PRIVATE KEY-----\nMIIE"}])
    assert key.status_code == 403 and key.json()["error"]["param"] == "llm-secret-100"
    assert post(gw, messages=[{"role": "user", "content": "Why is ' OR 1=1 -- dangerous in SQL?"}]).status_code == 200
    assert http.get(upstream.url + "/_stats").json()["requests"] - before == 2

    policy = gw.admin.get("/admin/policy").json()
    assert policy["version"].startswith("sha256:") and policy["waf"]["rules"] > 40
    time.sleep(0.2)
    audits = audit_lines(gw)
    assert [a["action"] for a in audits] == ["block", "block"]
    first = audits[0]
    assert first["policy_version"] == policy["version"] and len(first["trace_id"]) == 32
    assert first["tenant"] == "team-b" and first["request_id"] == blocked.headers["x-request-id"]
    assert {r["id"] for r in first["rules"]} >= {"sqli-100"}
    assert all("1' or" not in r["match"] for r in first["rules"])  # matched text is masked
    assert "BEGIN RSA" not in json.dumps(audits[1])


def test_secrets_are_redacted_before_the_upstream_sees_them(upstream, gateway, tmp_path):
    write(tmp_path / "p", {"packs": ["llm"]})
    gw = start(gateway, upstream, tmp_path / "p")
    response = post(gw, messages=[{"role": "user", "content": "deploy with AKIAIOSFODNN7EXAMPLE please"}])
    assert response.status_code == 200
    sent = http.get(upstream.url + "/_stats").json()["last_body"]
    assert sent["messages"][0]["content"] == "deploy with [REDACTED:secret] please"


def test_tenant_overlays_apply_before_auth(upstream, gateway, tmp_path):
    rule = {
        "id": "ops-only-model",
        "when": {
            "all": [{"target": "model", "equals": "test-model"}, {"not": {"target": "key_label", "equals": "ops"}}]
        },
    }
    write(tmp_path / "p", {"packs": ["sqli"], "rules": [rule]}, {"team-a": {"waf": {"mode": "monitor"}}})
    gw = start(gateway, upstream, tmp_path / "p")
    attack = "?id=1%27%20or%20%271%27=%271"
    assert post(gw, "sk-a", attack).status_code == 200  # team-a: monitor only
    assert post(gw, "sk-b", attack).status_code == 403
    assert post(gw, "sk-b").json()["error"]["param"] == "ops-only-model"  # label from the key store
    assert post(gw, "sk-unknown").status_code == 403  # unknown key: base policy, no label
    assert post(gw, "sk-unknown", model="other").status_code == 401  # the WAF passed it; auth refused


def metric(gw, name: str, **labels: str) -> float:
    """One series' value on the admin plane's /metrics; 0 before it is written."""
    for family in text_string_to_metric_families(gw.admin.get("/metrics").text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return 0.0


def test_a_rule_in_monitor_mode_is_counted_with_what_it_would_have_done(upstream, gateway, tmp_path):
    """A security team trying a rule out sees, per pack and rule, what it would have blocked, while the requests
    are served; the enforced policy's blocks are counted the same way."""
    watch = {"id": "watch-test-model", "action": "monitor", "when": {"target": "model", "equals": "test-model"}}
    write(tmp_path / "p", {"packs": ["sqli"], "rules": [watch]}, {"team-a": {"waf": {"mode": "monitor"}}})
    gw = start(gateway, upstream, tmp_path / "p")
    attack = "?id=1%27%20or%20%271%27=%271"
    assert post(gw, "sk-a", attack).status_code == 200  # team-a: the policy in monitor mode, served
    assert post(gw, "sk-b", attack).status_code == 403  # team-b: enforced

    matches = "portcullis_waf_rule_matches_total"
    assert metric(gw, matches, pack="sqli", rule="sqli-100", action="monitor") == 1
    assert metric(gw, matches, pack="sqli", rule="sqli-100", action="block") == 1
    assert metric(gw, matches, pack="policy", rule="watch-test-model", action="monitor") == 2, "a monitor rule"
    assert metric(gw, "portcullis_waf_requests_total", action="monitor") == 1
    assert metric(gw, "portcullis_waf_requests_total", action="block") == 1

    assert post(gw, "sk-b").status_code == 200  # only the monitor rule matches: served, and counted
    assert metric(gw, matches, pack="policy", rule="watch-test-model", action="monitor") == 3
    assert metric(gw, "portcullis_waf_requests_total", action="log") == 1
    version = gw.admin.get("/admin/policy").json()["version"]
    assert metric(gw, "portcullis_policy_info", version=version) == 1


def test_hot_reload_keeps_serving_through_a_broken_edit_and_applies_a_good_one(upstream, gateway, tmp_path):
    directory = tmp_path / "p"
    rule = {"id": "no-foo", "description": "first", "when": {"target": "prompt", "regex": "foo"}}
    write(directory, {"rules": [rule]})
    gw = start(gateway, upstream, directory)
    version = gw.admin.get("/admin/policy").json()["version"]
    statuses: list[int] = []
    errors: list[str] = []
    stop = threading.Event()

    def hammer() -> None:
        with httpx.Client(timeout=10) as client:
            while not stop.is_set():
                try:
                    statuses.append(
                        client.post(
                            gw.url + URL, json=chat_body(), headers={"authorization": "Bearer sk-b"}
                        ).status_code
                    )
                except httpx.HTTPError as exc:
                    errors.append(repr(exc))

    worker = threading.Thread(target=hammer)
    worker.start()
    try:
        text = (directory / "base.yaml").read_text()
        (directory / "base.yaml").write_text(text.replace("regex: foo", "regex: '(?<=x)foo'"))
        status = _wait(gw, lambda s: s["last_error"])
        assert "base.yaml:" in status["last_error"] and "rule id no-foo" in status["last_error"]
        assert status["version"] == version
        assert post(gw, messages=[{"role": "user", "content": "foo"}]).status_code == 403  # old policy serves

        write(directory, {"rules": [{**rule, "when": {"target": "prompt", "regex": "bar"}}]})
        status = _wait(gw, lambda s: s["version"] != version and not s["last_error"])
        assert status["reloads"] == 1
        assert post(gw, messages=[{"role": "user", "content": "foo"}]).status_code == 200
        assert post(gw, messages=[{"role": "user", "content": "bar"}]).status_code == 403
        deadline = time.monotonic() + 30  # a slow machine: let the hammer reach its count after the reloads too
        while len(statuses) <= 20 and not errors and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        stop.set()
        worker.join()
    assert errors == [] and len(statuses) > 20 and set(statuses) == {200}


def _wait(gw, ready, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        status = gw.admin.get("/admin/policy").json()
        if ready(status) or time.monotonic() > deadline:
            return status
        time.sleep(0.1)


def test_sighup_reloads_and_never_kills_the_gateway(upstream, gateway, tmp_path):
    import signal

    directory = tmp_path / "p"
    write(directory, {"rules": [{"id": "no-foo", "when": {"target": "prompt", "regex": "foo"}}]})
    gw = start(gateway, upstream, directory)
    gw.proc.send_signal(signal.SIGHUP)  # nothing changed: a reload that keeps the same version
    time.sleep(0.5)
    assert gw.proc.poll() is None
    status = gw.admin.get("/admin/policy").json()
    assert status["last_error"] is None and status["reloads"] == 0
    assert post(gw, messages=[{"role": "user", "content": "foo"}]).status_code == 403
