"""A tenant's name against the places it is written: the spend ledger in Redis keeps each row as a key id, a tenant
and a model joined by a control character, and access logs, audit lines and metrics labels print it. A name that
holds a control character is refused where a key gets it (the admin API, portcullis.yaml), so one tenant's name can
neither break the others' spend report nor pass for another row. A budget's counters are named by its id and its
payer (a tenant's name or a key's id), so no policy budget may take the id of a key's own.

One gateway on a real Redis store, the official `openai` client on its public port, the admin API on its own.
"""

from __future__ import annotations

import hashlib
import json
import time

import openai
import pytest

from tests.conftest import Launcher, Process, RedisServer, pool

STATIC_KEY = "sk-tenant-names-static-41aa"


@pytest.fixture(scope="module")
def gw(module_launcher: Launcher, module_redis_server: RedisServer) -> Process:
    return module_launcher.gateway(
        {
            "pools": [pool("main", module_launcher.fake_upstream().url)],
            "auth": {"keys": [{"tenant": "static", "sha256": hashlib.sha256(STATIC_KEY.encode()).hexdigest()}]},
            "redis": {"url": module_redis_server.url},
            "store": {"backend": "redis", "poll_interval": 0.1},
        }
    )


def chat(gw: Process, secret: str) -> None:
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=secret, max_retries=0)
    deadline = time.monotonic() + 3
    while True:  # a new key reaches the key ring by its poll
        try:
            client.chat.completions.create(model="test-model", messages=[{"role": "user", "content": "hi"}])
            return
        except openai.AuthenticationError:
            assert time.monotonic() < deadline, "the key did not reach the gateway in time"
            time.sleep(0.05)


@pytest.mark.parametrize("tenant", ["ops\x1fteam", "ops\nteam", "ops\x00", "ops\x7f", "ops\x85team"])
def test_a_tenant_name_holding_a_control_character_is_refused_and_every_report_still_reads(gw, tenant) -> None:
    made = gw.admin.post("/admin/keys", json={"tenant": tenant})
    if made.status_code == 201:  # as it was: the key serves, and its spend row is written
        chat(gw, made.json()["secret"])
    assert made.status_code == 400, made.text
    assert made.json()["error"]["param"] == "tenant"
    updated = gw.admin.post("/admin/keys", json={"tenant": "ops-team"}).json()
    assert gw.admin.patch(f"/admin/keys/{updated['id']}", json={"tenant": tenant}).status_code == 400

    chat(gw, updated["secret"])
    report = gw.admin.get("/admin/spend", params={"group_by": "tenant"})
    assert report.status_code == 200, report.text
    assert "ops-team" in [row["tenant"] for row in report.json()["data"]]


def test_a_tenant_name_holding_a_control_character_in_the_config_stops_the_start(launcher) -> None:
    keys = [{"tenant": "ops\x1fteam", "sha256": hashlib.sha256(b"any").hexdigest()}]
    with pytest.raises(RuntimeError) as failed:
        launcher.gateway({"pools": [pool("main", "http://127.0.0.1:9")], "auth": {"keys": keys}})
    assert "auth.keys[0].tenant" in str(failed.value) and "Traceback" not in str(failed.value)


@pytest.mark.parametrize("route", ["/admin/spend", "/admin/keys"])
@pytest.mark.parametrize("tenant", ["ops\x1fteam", "ops\n"])
def test_a_report_or_list_asked_for_such_a_tenant_is_a_400(gw, route, tenant) -> None:
    answer = gw.admin.get(route, params={"tenant": tenant})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "tenant", answer.text


def test_a_policy_budget_may_not_take_the_id_of_a_keys_own_budget(launcher, tmp_path) -> None:
    """A budget's counter is named by its id and its payer (a tenant's name, or a key's id). A stored key's own budget
    has the id `key`: a policy budget of that id would share its counters, per key (`key: api_key`), or per tenant
    with a tenant named like a key's id, so one tenant's spend would be charged to another's key."""
    directory = tmp_path / "policies"
    directory.mkdir()
    spec = {"budgets": [{"id": "key", "key": "tenant", "limit": 10, "period": "month"}]}
    policy = {"apiVersion": "portcullis.dev/v1", "kind": "Policy", "metadata": {"name": "test"}, "spec": spec}
    (directory / "base.yaml").write_text(json.dumps(policy))
    with pytest.raises(RuntimeError) as failed:
        launcher.gateway({"pools": [pool("main", "http://127.0.0.1:9")], "policy_dir": str(directory)})
    message = str(failed.value)
    assert "base.yaml" in message and "budgets" in message and "'key'" in message and "Traceback" not in message
