"""Stored keys through the admin API and `portcullis keys`, against a real gateway process with a SQLite key store.

A key made through the admin API is used with the official `openai` client on the public port; rotation, revocation
and updates reach the gateway's key ring by its poll (a fraction of a second), so the checks that follow a change
poll. Every change writes one audit line, and the audit file never holds a secret or a digest.

The tests share one gateway and its audit file: each makes keys for a tenant of its own and reads its own keys (by
tenant or id), the audit lines written while it ran, and counts as changes over the test.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import ROOT, Launcher, Process, pool

TOKEN = "admin-token-for-tests"
TOKEN_ENV = "PORTCULLIS_TEST_ADMIN_TOKEN"
STATIC_KEY = "sk-static-key-for-tests"  # so the gateway is never anonymous, whatever the store holds


@pytest.fixture(scope="module")
def audit_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("audit") / "audit.jsonl"


@pytest.fixture(scope="module")
def gw(module_launcher: Launcher, audit_path: Path) -> Process:
    """The module's gateway; its key ring looks for changed keys every 0.1 s."""
    return module_launcher.gateway(
        {
            "pools": [pool("main", module_launcher.fake_upstream().url)],
            "auth": {"keys": [{"tenant": "static", "sha256": hashlib.sha256(STATIC_KEY.encode()).hexdigest()}]},
            "admin": {"token_env": TOKEN_ENV, "audit_log": str(audit_path)},
            "store": {"poll_interval": 0.1},
        },
        env={TOKEN_ENV: TOKEN},
    )


def admin(gw: Process) -> httpx.Client:
    return httpx.Client(
        base_url=gw.admin_url, headers={"authorization": f"Bearer {TOKEN}", "x-portcullis-actor": "ops-alice"}
    )


def chat(gw: Process, secret: str, model: str = "test-model") -> str:
    """What the public port says to this secret: 'ok', or the error code the openai client raised."""
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=secret, max_retries=0)
    try:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])
    except openai.APIStatusError as exc:
        return exc.body.get("code", str(exc.status_code)) if isinstance(exc.body, dict) else str(exc.status_code)
    return "ok"


def eventually(check: Callable[[], bool], timeout: float = 3.0) -> None:
    """A change reaches the key ring by its poll: wait for it a little."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "the change did not reach the gateway in time"
        time.sleep(0.05)


def create(client: httpx.Client, tenant: str, **settings) -> dict:
    response = client.post("/admin/keys", json={"tenant": tenant, **settings})
    assert response.status_code == 201, response.text
    return response.json()


def audit_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def listed(client: httpx.Client, **params) -> list[dict]:
    return client.get("/admin/keys", params=params).json()["data"]


def test_the_admin_token_is_required(gw):
    before = listed(admin(gw))
    assert httpx.get(gw.admin_url + "/admin/keys").status_code == 401
    refused = httpx.post(gw.admin_url + "/admin/keys", json={"tenant": "acme"})
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_admin_token"
    wrong = {"authorization": "Bearer not-the-token"}
    assert httpx.get(gw.admin_url + "/admin/spend", headers=wrong).status_code == 401
    assert listed(admin(gw)) == before  # nothing was created


def test_a_created_key_works_with_the_openai_client_and_is_listed_without_secrets(gw):
    with admin(gw) as client:
        key = create(client, "created", label="ci", metadata={"owner": "alice"})
        secret = key.pop("secret")
        assert secret.startswith(f"pcl-{key['id']}-") and key["tenant"] == "created" and key["revoked_at"] is None
        eventually(lambda: chat(gw, secret) == "ok")
        assert chat(gw, secret + "x") == "invalid_api_key"
        every = listed(client)
        assert key in every and listed(client, tenant="created") == [key]
        assert client.get(f"/admin/keys/{key['id']}").json() == key
        assert listed(client, tenant="other") == []
        assert "digest" not in json.dumps(every) and secret not in json.dumps(every)


def test_rotation_keeps_the_old_secret_for_its_grace_and_zero_grace_ends_it(gw):
    with admin(gw) as client:
        key = create(client, "rotated")
        first = key["secret"]
        eventually(lambda: chat(gw, first) == "ok")
        rotated = client.post(f"/admin/keys/{key['id']}/rotate", json={"grace": 3600})
        assert rotated.status_code == 200 and rotated.json()["previous_valid_until"] > time.time() + 3500
        second = rotated.json()["secret"]
        assert second != first
        eventually(lambda: chat(gw, second) == "ok")
        assert chat(gw, first) == "ok"  # within its grace
        third = client.post(f"/admin/keys/{key['id']}/rotate", json={"grace": 0}).json()["secret"]
        eventually(lambda: chat(gw, second) == "invalid_api_key")
        assert chat(gw, first) == "invalid_api_key" and chat(gw, third) == "ok"
        bad = client.post(f"/admin/keys/{key['id']}/rotate", json={"grace": 31 * 86400})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "grace"


def test_a_revoked_key_is_refused_stays_listed_and_revoking_again_changes_nothing(gw, audit_path):
    with admin(gw) as client:
        key = create(client, "revoked")
        eventually(lambda: chat(gw, key["secret"]) == "ok")
        revoked = client.post(f"/admin/keys/{key['id']}/revoke", json={})
        assert revoked.status_code == 200 and revoked.json()["revoked_at"] is not None
        eventually(lambda: chat(gw, key["secret"]) != "ok")
        assert chat(gw, key["secret"]) == "invalid_api_key"
        lines = len(audit_lines(audit_path))
        again = client.post(f"/admin/keys/{key['id']}/revoke", json={})
        assert again.status_code == 200 and again.json()["revoked_at"] == revoked.json()["revoked_at"]
        assert len(audit_lines(audit_path)) == lines
        assert [k["id"] for k in listed(client, tenant="revoked")] == [key["id"]]
        rotate = client.post(f"/admin/keys/{key['id']}/rotate", json={})
        assert rotate.status_code == 409 and rotate.json()["error"]["code"] == "key_revoked"


def test_an_update_replaces_the_fields_given(gw):
    with admin(gw) as client:
        key = create(client, "updated", label="keep me")
        eventually(lambda: chat(gw, key["secret"]) == "ok")
        updated = client.patch(f"/admin/keys/{key['id']}", json={"models": ["other-*"], "tenant": "updated-beta"})
        assert updated.status_code == 200
        view = updated.json()
        assert (view["models"], view["tenant"], view["label"]) == (["other-*"], "updated-beta", "keep me")
        eventually(lambda: chat(gw, key["secret"]) == "model_not_allowed")
        client.patch(f"/admin/keys/{key['id']}", json={"models": []})
        eventually(lambda: chat(gw, key["secret"]) == "ok")


def test_bad_requests_are_4xx_in_the_openai_shape_and_not_audited(gw, audit_path):
    with admin(gw) as client:
        key = create(client, "refused")
        lines, keys = len(audit_lines(audit_path)), len(listed(client))
        for path in ("/admin/keys/abcdef123456", "/admin/keys/NOT-AN-ID", "/admin/keys/" + "a" * 5000):
            missing = client.get(path)
            assert missing.status_code == 404 and missing.json()["error"]["code"] == "key_not_found", path
        assert client.post("/admin/keys/abcdef123456/revoke", json={}).status_code == 404
        empty = client.post("/admin/keys", json={"tenant": ""})
        assert empty.status_code == 400 and empty.json()["error"]["param"] == "tenant"
        chosen_id = client.post("/admin/keys", json={"tenant": "acme", "id": "abcdef123456"})
        assert chosen_id.status_code == 400 and chosen_id.json()["error"]["param"] == "id"
        nested = client.patch(f"/admin/keys/{key['id']}", json={"budget": {"limit": -1}})
        assert nested.status_code == 400 and nested.json()["error"]["param"] == "budget.limit"
        malformed = client.post("/admin/keys", content=b"{not json", headers={"content-type": "application/json"})
        assert malformed.json()["error"]["code"] == "invalid_json"
        assert client.post("/admin/keys", json=["tenant"]).status_code == 400
        huge = client.post("/admin/keys", json={"tenant": "acme", "label": "x" * 70_000})
        assert huge.status_code == 413 and huge.json()["error"]["code"] == "request_too_large"
        assert client.get("/admin/spend", params={"start": "soon"}).json()["error"]["param"] == "start"
        assert len(audit_lines(audit_path)) == lines
        assert len(listed(client)) == keys


def test_a_spend_window_whose_offset_leaves_the_calendar_is_a_400(gw):
    """An ISO datetime whose offset puts it before year 1 or after 9999 in UTC names its parameter, not a 500."""
    with admin(gw) as client:
        for param, value in (("start", "0001-01-01T00:00:00+01:00"), ("end", "9999-12-31T23:59:59-01:00")):
            answer = client.get("/admin/spend", params={param: value})
            assert answer.status_code == 400, (param, answer.text)
            assert answer.json()["error"]["param"] == param
    assert "Traceback" not in gw.output()


def test_each_change_is_audited_with_before_and_after_and_no_secret(gw, audit_path):
    earlier = len(audit_lines(audit_path))
    with admin(gw) as client:
        created = client.post("/admin/keys", json={"tenant": "audited"})
        key = created.json()
        client.patch(f"/admin/keys/{key['id']}", json={"label": "renamed"})
        rotated = client.post(f"/admin/keys/{key['id']}/rotate", json={"grace": 60}).json()
        client.post(f"/admin/keys/{key['id']}/revoke", json={})
    lines = audit_lines(audit_path)[earlier:]  # what this test's changes wrote
    assert [line["action"] for line in lines] == ["create", "update", "rotate", "revoke"]
    assert lines[0]["request_id"] == created.headers["x-request-id"]
    for line in lines:
        assert line["key_id"] == key["id"] and line["tenant"] == "audited" and line["ts"].endswith("Z")
        assert line["actor"] == {"auth": "admin-token", "address": "127.0.0.1", "name": "ops-alice"}
    assert lines[0]["before"] is None and lines[0]["after"]["label"] == ""
    assert (lines[1]["before"]["label"], lines[1]["after"]["label"]) == ("", "renamed")
    assert lines[2]["before"]["previous_valid_until"] is None and lines[2]["after"]["previous_valid_until"]
    assert lines[3]["before"]["revoked_at"] is None and lines[3]["after"]["revoked_at"]
    text = audit_path.read_text()
    assert key["secret"] not in text and rotated["secret"] not in text and "digest" not in text


def test_spend_is_reported_per_key_as_json_and_csv(gw):
    with admin(gw) as client:
        key = create(client, "spender")
        eventually(lambda: chat(gw, key["secret"]) == "ok")
        assert chat(gw, key["secret"]) == "ok"
        report = client.get("/admin/spend", params={"group_by": "key,model,day", "key": key["id"]}).json()
        assert report["group_by"] == ["key", "model", "day"]
        (row,) = report["data"]
        assert (row["key_id"], row["model"], row["requests"]) == (key["id"], "test-model", 2)
        assert row["completion_tokens"] > 0 and row["period"] == time.strftime("%Y-%m-%d", time.gmtime())
        as_csv = client.get("/admin/spend", params={"group_by": "key"}, headers={"accept": "text/csv"})
        assert as_csv.headers["content-type"].startswith("text/csv")
        assert as_csv.text.splitlines()[0].startswith("key_id,requests,") and f"{key['id']},2," in as_csv.text


def test_the_openapi_document_is_served(gw):
    document = admin(gw).get("/admin/openapi.json").json()
    assert document["openapi"].startswith("3.1") and "/admin/keys/{key_id}/rotate" in document["paths"]


def cli(gw: Process, *args: str, token: str | None = TOKEN) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "PORTCULLIS_ADMIN_URL": gw.admin_url, "XDG_STATE_HOME": "/nonexistent"}
    if token:
        env["PORTCULLIS_ADMIN_TOKEN"] = token
    command = [sys.executable, "-m", "gateway.cli", "keys", *args]
    return subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=60)


def test_the_keys_cli_creates_lists_rotates_revokes_and_reports(gw, audit_path):
    made = cli(gw, "create", "--tenant", "cli-team", "--label", "from cli", "--model", "test-*", "--meta", "team=ml")
    assert made.returncode == 0, made.stderr
    fields = dict(line.split(None, 1) for line in made.stdout.splitlines())
    key_id, secret = fields["id"], fields["secret"]
    assert "shown this once" in made.stderr
    eventually(lambda: chat(gw, secret) == "ok")

    (key,) = json.loads(cli(gw, "list", "--json", "--tenant", "cli-team").stdout)
    assert (key["id"], key["models"], key["metadata"]) == (key_id, ["test-*"], {"team": "ml"})
    assert key_id in [k["id"] for k in json.loads(cli(gw, "list", "--json").stdout)]
    table = cli(gw, "list", "--tenant", "cli-team").stdout.splitlines()
    assert table[0].split()[:3] == ["id", "tenant", "label"] and table[1].startswith(key_id)

    assert cli(gw, "update", key_id, "--budget", "50", "--period", "day").returncode == 0
    assert json.loads(cli(gw, "get", key_id, "--json").stdout)["budget"]["limit"] == 50

    rotated = cli(gw, "rotate", key_id, "--grace", "0")
    new_secret = dict(line.split(None, 1) for line in rotated.stdout.splitlines())["secret"]
    eventually(lambda: chat(gw, secret) == "invalid_api_key")
    assert chat(gw, new_secret) == "ok"

    assert cli(gw, "revoke", key_id).returncode == 0
    eventually(lambda: chat(gw, new_secret) == "invalid_api_key")

    spend = cli(gw, "spend", "--by", "key,tenant", "--csv")
    assert spend.returncode == 0 and spend.stdout.splitlines()[0].startswith("key_id,tenant,requests")
    assert f"{key_id},cli-team," in spend.stdout
    assert secret not in audit_path.read_text() and new_secret not in audit_path.read_text()


def test_the_keys_cli_prints_the_apis_refusal_and_fails(gw):
    missing = cli(gw, "get", "abcdef123456")
    assert missing.returncode == 1 and "no key with id 'abcdef123456'" in missing.stderr
    bad = cli(gw, "create", "--tenant", "acme", "--limit", "Not A Rule=5")
    assert bad.returncode == 1 and "limits" in bad.stderr
    unauthorised = cli(gw, "list", token=None)
    assert unauthorised.returncode == 1 and "bearer token" in unauthorised.stderr
    gone = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "keys", "list", "--admin-url", "http://127.0.0.1:9"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert gone.returncode == 2 and "cannot reach the admin API" in gone.stderr
