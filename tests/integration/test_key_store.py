"""Stored keys through real gateway processes: shared by instances on one redis-server, kept across a restart in a
SQLite file, refused for models they may not call. Keys are made and revoked through one instance's admin API, or
written with the store's own classes as that API does.

The two Redis tests share a redis-server and the instance they make and revoke keys through (each test its own
tenant and keys); the instance that must see the change, or is cut off, is each test's own."""

from __future__ import annotations

import asyncio
import hashlib
import re
import time
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from gateway.keystore.records import KeyRecord, digest_of, new_key_id, new_secret
from gateway.keystore.sqlite_store import SqliteKeyStore
from gateway.keystore.store import KeyStoreBackend
from tests.conftest import Launcher, Partition, Process, RedisServer, chat_body, pool

STATIC_KEY = "sk-static-operator"
STATIC_KEYS = {"keys": [{"tenant": "operator", "sha256": hashlib.sha256(STATIC_KEY.encode()).hexdigest()}]}


def new_key(tenant: str = "team-a", **settings) -> tuple[str, KeyRecord]:
    key_id = new_key_id()
    secret = new_secret(key_id)
    now = time.time()
    return secret, KeyRecord(
        id=key_id, tenant=tenant, digest=digest_of(secret), created_at=now, updated_at=now, **settings
    )


def put(store: KeyStoreBackend, record: KeyRecord) -> None:
    async def write() -> None:
        await store.put(record)
        await store.aclose()

    asyncio.run(write())


def chat(gw: Process, secret: str) -> httpx.Response:
    return httpx.post(
        gw.url + "/v1/chat/completions", json=chat_body(), headers={"authorization": f"Bearer {secret}"}, timeout=10
    )


def until_status(gw: Process, secret: str, status: int, timeout: float = 5.0) -> float:
    """Seconds until the gateway answers `status` for this key."""
    started = time.monotonic()
    while (answer := chat(gw, secret)).status_code != status:
        assert time.monotonic() - started < timeout, f"still {answer.status_code}: {answer.text}"
        time.sleep(0.02)
    return time.monotonic() - started


def openai_client(gw: Process, secret: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=secret, max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def upstream(module_launcher: Launcher) -> Process:
    return module_launcher.fake_upstream()


def on_redis(upstream: Process, redis_url: str) -> dict:
    """An instance whose keys are in Redis at `redis_url`, with a static key too."""
    return {
        "pools": [pool("main", upstream.url)],
        "auth": STATIC_KEYS,
        "redis": {"url": redis_url},
        "store": {"backend": "redis"},
    }


@pytest.fixture(scope="module")
def one(module_launcher: Launcher, upstream: Process, module_redis_server: RedisServer) -> Process:
    """The instance the Redis tests make and revoke keys through."""
    return module_launcher.gateway(on_redis(upstream, module_redis_server.url))


def test_instances_sharing_redis_see_a_key_and_its_revocation_within_a_second(
    upstream, gateway, module_redis_server, one
):
    two = gateway(on_redis(upstream, module_redis_server.url))
    created = one.admin.post("/admin/keys", json={"tenant": "team-shared"}).json()  # through one
    secret = created["secret"]
    for gw in (one, two):
        until_status(gw, secret, 200)
        reply = openai_client(gw, secret).chat.completions.create(
            model="test-model", messages=[{"role": "user", "content": "hello"}]
        )
        assert reply.choices[0].message.content

    revoked = one.admin.post(f"/admin/keys/{created['id']}/revoke", json={})  # through one: the other refuses it
    assert revoked.status_code == 200 and revoked.json()["revoked_at"]
    with pytest.raises(openai.AuthenticationError) as refused:  # the instance that revoked it, at once: no poll wait
        openai_client(one, secret).chat.completions.create(
            model="test-model", messages=[{"role": "user", "content": "hello"}]
        )
    assert refused.value.code == "invalid_api_key"  # as an unknown key: revocation is not disclosed
    assert until_status(two, secret, 401) < 1.0
    assert chat(one, STATIC_KEY).status_code == 200  # static keys work beside stored ones


def test_an_instance_cut_off_from_redis_refuses_stored_keys_past_max_key_staleness(
    upstream, gateway, module_redis_server, one
):
    """A key revoked through one instance while the other cannot reach Redis: the other serves it from its copy for
    `store.max_key_staleness`, then answers 503 key_store_unavailable for stored keys (static keys still work) and
    says so in its log and metrics; once Redis is reachable again the revocation applies within a poll."""
    partition = Partition(module_redis_server.port)
    cut_off = on_redis(upstream, f"redis://127.0.0.1:{partition.port}/0")
    two = gateway({**cut_off, "store": {"backend": "redis", "max_key_staleness": 1}})
    try:
        created = one.admin.post("/admin/keys", json={"tenant": "team-cut-off"}).json()
        until_status(two, created["secret"], 200)
        partition.cut()
        assert one.admin.post(f"/admin/keys/{created['id']}/revoke", json={}).status_code == 200

        until_status(two, created["secret"], 503)
        refused = chat(two, created["secret"])
        assert refused.json()["error"]["code"] == "key_store_unavailable" and refused.headers["retry-after"]
        assert chat(two, STATIC_KEY).status_code == 200
        assert "stored keys are refused with 503 key_store_unavailable" in two.output()
        metrics = two.admin.get("/metrics").text
        synced = float(re.search(r"^portcullis_key_store_synced_timestamp_seconds (\S+)$", metrics, re.M)[1])
        assert synced < time.time() - 1

        partition.heal()
        assert until_status(two, created["secret"], 401) < 2.0  # a poll, and a loaded machine's slack
    finally:
        partition.cut()


def test_sqlite_store_keeps_keys_across_a_restart(upstream, gateway, tmp_path: Path):
    config = {"pools": [pool("main", upstream.url)], "store": {"sqlite_path": str(tmp_path / "keys.db")}}
    first = gateway(config)
    secret, record = new_key("team-kept")
    put(SqliteKeyStore(tmp_path / "keys.db"), record)  # another process writes the file the gateway polls
    until_status(first, secret, 200)
    first.stop()

    second = gateway(config)
    assert chat(second, secret).status_code == 200  # loaded before it served its first request
    assert chat(second, "sk-unknown").status_code == 401


def test_a_key_is_refused_models_its_globs_do_not_match(upstream, gateway, tmp_path: Path):
    gw = gateway(
        {
            "pools": [pool("main", upstream.url, models=["gpt-4o", "o3", "test-model"])],
            "store": {"sqlite_path": str(tmp_path / "keys.db")},
        }
    )
    secret, record = new_key("team-limited", models=["test-*", "gpt-4o"])
    expired_secret, expired = new_key("team-limited", expires_at=time.time() - 1)
    put(SqliteKeyStore(tmp_path / "keys.db"), record)
    put(SqliteKeyStore(tmp_path / "keys.db"), expired)
    # a gateway that holds no key at all serves anyone: wait until it refuses the expired key, so it holds them
    until_status(gw, expired_secret, 401)

    client = openai_client(gw, secret)
    client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hello"}])
    listed = sorted(m.id for m in client.models.list())
    assert listed == ["gpt-4o", "test-model"], "the model list shows only what the key may call"
    with pytest.raises(openai.PermissionDeniedError) as refused:
        client.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "hello"}])
    assert refused.value.code == "model_not_allowed"
    assert refused.value.type == "permission_error"
    assert "gpt-4o-mini" in refused.value.message

    messages = anthropic.Anthropic(base_url=gw.url, api_key=secret, max_retries=0, timeout=30).messages
    with pytest.raises(anthropic.PermissionDeniedError) as refused_messages:
        messages.create(model="claude-x", max_tokens=8, messages=[{"role": "user", "content": "hello"}])
    assert refused_messages.value.body["error"]["type"] == "permission_error"  # type: ignore[index]

    with pytest.raises(openai.AuthenticationError) as expired_error:
        openai_client(gw, expired_secret).chat.completions.create(
            model="test-model", messages=[{"role": "user", "content": "hello"}]
        )
    assert expired_error.value.code == "expired_api_key"
