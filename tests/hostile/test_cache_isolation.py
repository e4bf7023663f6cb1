"""`cache_isolation: tenant` against every route a tenant can reach a pool's prefix cache by: each request the pool
is sent carries its tenant's own `cache_salt`, whatever the client sent and whatever shape the client spoke, so no
tenant hits (or times) another's cached prefixes. A Messages request to an OpenAI-compatible pool is translated to
chat completions on its way: the salt must survive the translation.

One gateway in front of tests/fake_upstream.py (which keeps the last body it was sent), called with the official
`openai` and `anthropic` SDKs.
"""

from __future__ import annotations

import hashlib
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.conftest import Launcher, Process, pool

KEYS = {"ann": "sk-cache-ann-5b20", "bob": "sk-cache-bob-9e4c"}


@pytest.fixture(scope="module")
def upstream(module_launcher: Launcher) -> Process:
    return module_launcher.fake_upstream("cache")


@pytest.fixture(scope="module")
def gw(module_launcher: Launcher, upstream: Process) -> Process:
    auth = {"keys": [{"tenant": t, "sha256": hashlib.sha256(k.encode()).hexdigest()} for t, k in KEYS.items()]}
    return module_launcher.gateway({"pools": [pool("main", upstream.url, cache_isolation="tenant")], "auth": auth})


def sent(upstream: Process) -> dict[str, Any]:
    body: dict[str, Any] = httpx.get(upstream.url + "/_stats").json()["last_body"]
    return body


def salt_by_chat(gw: Process, upstream: Process, tenant: str) -> str:
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=KEYS[tenant], max_retries=0)
    client.chat.completions.create(
        model="test-model", messages=[{"role": "user", "content": "hi"}], extra_body={"cache_salt": "chosen"}
    )
    salt: str = sent(upstream)["cache_salt"]
    return salt


def test_a_translated_messages_request_carries_its_tenants_salt(gw, upstream) -> None:
    salts = {tenant: salt_by_chat(gw, upstream, tenant) for tenant in KEYS}
    assert salts["ann"] != salts["bob"] and "chosen" not in salts.values()
    for tenant in KEYS:
        claude = anthropic.Anthropic(base_url=gw.url, api_key=KEYS[tenant], max_retries=0)
        claude.messages.create(
            model="test-model",
            max_tokens=16,
            messages=[{"role": "user", "content": "hi"}],
            extra_body={"cache_salt": "chosen"},
        )
        body = sent(upstream)
        assert "messages" in body and body.get("cache_salt") == salts[tenant], body


def test_a_pool_whose_tenants_share_its_prefix_cache_is_warned_of_at_start(module_launcher, upstream, gw) -> None:
    """Sharing is the default (shared system prompts stay cached across tenants), and an unsafe one where tenants
    must not learn about each other: the start says so for each such pool, and not for an isolated one."""
    auth = {"keys": [{"tenant": t, "sha256": hashlib.sha256(k.encode()).hexdigest()} for t, k in KEYS.items()]}
    pools = [pool("isolated", upstream.url, cache_isolation="tenant"), pool("open", upstream.url, models=["other"])]
    shared = module_launcher.gateway({"pools": pools, "auth": auth})
    assert "pools[open].cache_isolation: shared: tenants share its engines' prefix cache" in shared.output()
    assert "pools[isolated]" not in shared.output()
    assert "cache_isolation: shared" not in gw.output()
