"""Authority per attempt: a request its pool failed is sent to a fallback only on the terms of the model that serves
it there. The key must be allowed that model, that model's rate limits apply, and the budget is reserved at that
model's price before the attempt; a fallback step the request may not take is skipped, and when none is left the
client gets its own model's failure.

Real parts: a gateway process whose keys are in its SQLite store and whose budgets are in a real redis-server, and
two fake upstream processes that count what they were sent: `cheap` fails every request (503), `premium` serves.
`cheap` falls back to `premium`, which costs a hundred times as much. The tests share the gateway, each with a key
and tenant of its own; `cheap` cools down after its first failure, so later requests meet the fallback on arrival
as well as after a failure.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml

from gateway.keystore.records import KeyRecord, digest_of, new_key_id, new_secret
from gateway.keystore.sqlite_store import SqliteKeyStore
from tests.conftest import Launcher, Process, RedisServer, chat_body, pool

CHEAP, PREMIUM = "cheap", "premium"
# per million tokens: a premium token costs a hundred cheap ones
PRICES = {"models": {CHEAP: {"input": 1.0, "output": 2.0}, PREMIUM: {"input": 100.0, "output": 200.0}}}
PREMIUM_NANOS = {"input": 100_000, "output": 200_000}  # a token's price in nanos
BUDGET = 0.005  # per tenant and day: a premium request reserves about 0.003 (10 output tokens) and costs 0.0013
ADMIN_TOKEN, ADMIN_TOKEN_ENV = "authority-admin-token", "PORTCULLIS_TEST_ADMIN_TOKEN"
# tenant overlays: a tight per-model limit on premium for one tenant, a loose one for another
PREMIUM_LIMITED = {"limited": 2, "allowed": 100}


def policies(directory: Path) -> str:
    (directory / "tenants").mkdir(parents=True)
    head = {"apiVersion": "portcullis.dev/v1", "metadata": {"name": "authority"}}
    budget = {"id": "team-spend", "key": "tenant", "limit": BUDGET, "period": "day"}
    base = {**head, "kind": "Policy", "spec": {"prices": PRICES, "budgets": [budget]}}
    (directory / "base.yaml").write_text(yaml.safe_dump(base))
    for tenant, limit in PREMIUM_LIMITED.items():
        rule = {
            "id": "premium-rph",
            "key": ["tenant"],
            "match": {"models": [PREMIUM]},
            "requests": {"limit": limit, "per": "1h"},
        }
        overlay = {**head, "kind": "TenantPolicy", "tenant": tenant, "spec": {"rate_limits": [rule]}}
        (directory / "tenants" / f"{tenant}.yaml").write_text(yaml.safe_dump(overlay))
    return str(directory)


def stored_key(store: Path, tenant: str, models: list[str]) -> str:
    """A key put in the store before the gateway starts (it loads its keys before it serves); its secret."""
    key_id = new_key_id()
    secret, now = new_secret(key_id), time.time()
    record = KeyRecord(
        id=key_id, tenant=tenant, digest=digest_of(secret), created_at=now, updated_at=now, models=models
    )

    async def put() -> None:
        backend = SqliteKeyStore(store)
        await backend.put(record)
        await backend.aclose()

    asyncio.run(put())
    return secret


@pytest.fixture(scope="module")
def upstreams(module_launcher: Launcher) -> tuple[Process, Process]:
    return module_launcher.fake_upstream(CHEAP, fail_status=503), module_launcher.fake_upstream(PREMIUM)


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """The key store's file and a secret per tenant: `cheap-only` may call only cheap, the others both."""
    store = tmp_path_factory.mktemp("keys") / "keys.db"
    models = {"cheap-only": [CHEAP], "limited": [CHEAP, PREMIUM], "allowed": [CHEAP, PREMIUM]}
    models["budgeted"] = [CHEAP, PREMIUM]
    return store, {tenant: stored_key(store, tenant, allowed) for tenant, allowed in models.items()}


@pytest.fixture(scope="module")
def gw(
    module_launcher: Launcher,
    module_redis_server: RedisServer,
    upstreams: tuple[Process, Process],
    keys: tuple[Path, dict[str, str]],
    tmp_path_factory: pytest.TempPathFactory,
) -> Process:
    cheap, premium = upstreams
    return module_launcher.gateway(
        {
            "pools": [pool(CHEAP, cheap.url, models=[CHEAP]), pool(PREMIUM, premium.url, models=[PREMIUM])],
            "models": [{"name": CHEAP, "context_window": 256}, {"name": PREMIUM, "context_window": 8192}],
            "fallbacks": [{"model": CHEAP, "to": [{"model": PREMIUM}]}],
            "policy_dir": policies(tmp_path_factory.mktemp("policies")),
            "redis": {"url": module_redis_server.url},
            "store": {"sqlite_path": str(keys[0])},
            "admin": {"token_env": ADMIN_TOKEN_ENV},
            "telemetry": {"access_log": True},
        },
        env={ADMIN_TOKEN_ENV: ADMIN_TOKEN},
    )


def requests_seen(upstream: Process) -> int:
    return httpx.get(upstream.url + "/_stats").json()["requests"]


def ask(gw: Process, secret: str, **fields) -> httpx.Response:
    body = chat_body(**{"model": CHEAP, "max_tokens": 10, **fields})
    return httpx.post(
        gw.url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {secret}"}, timeout=60
    )


def assert_cheaps_own_failure(response: httpx.Response) -> None:
    """The client hears what its own model's pool said, not about a model it never asked for."""
    assert response.status_code == 503, response.text
    assert response.json()["error"]["message"] == "cheap forced failure"
    assert response.headers["x-portcullis-model"] == CHEAP


def test_a_key_allowed_only_cheap_is_never_served_by_premium_through_its_fallback(gw, upstreams, keys):
    cheap, premium = upstreams
    secret = keys[1]["cheap-only"]
    before = requests_seen(cheap), requests_seen(premium)
    assert ask(gw, secret, model=PREMIUM).status_code == 403  # asked for directly: refused, as before
    for _ in range(2):  # after cheap's failure, then on arrival while cheap cools down
        assert_cheaps_own_failure(ask(gw, secret))
    # a prompt too long for cheap's window, which premium's would take: cheap's own refusal
    long = ask(gw, secret, messages=[{"role": "user", "content": "word " * 400}])
    assert long.status_code == 400 and long.json()["error"]["code"] == "context_length_exceeded", long.text
    assert "256 tokens" in long.json()["error"]["message"]
    assert requests_seen(premium) - before[1] == 0
    assert requests_seen(cheap) - before[0] == 2


def test_premiums_own_rate_limit_holds_when_premium_serves_through_a_fallback(gw, upstreams, keys):
    _, premium = upstreams
    secret = keys[1]["limited"]
    before = requests_seen(premium)
    served = [ask(gw, secret) for _ in range(PREMIUM_LIMITED["limited"])]
    assert [(r.status_code, r.headers["x-portcullis-model"]) for r in served] == [(200, PREMIUM)] * 2
    assert_cheaps_own_failure(ask(gw, secret))  # premium's limit is spent: no fallback left
    assert requests_seen(premium) - before == PREMIUM_LIMITED["limited"]


def test_a_fallback_the_key_may_take_serves_on_its_own_models_limits_and_price(gw, upstreams, keys):
    secret = keys[1]["allowed"]
    response = ask(gw, secret)
    assert response.status_code == 200, response.text
    assert response.headers["x-portcullis-model"] == PREMIUM
    # the answer says where the request stands on premium's limits, the ones it was decided on
    assert response.headers["ratelimit"].startswith(f'"premium-rph";r={PREMIUM_LIMITED["allowed"] - 1};')
    logged = gw.access_log(response.headers["x-request-id"])
    assert (logged["model"], logged["fallback_from"]) == (PREMIUM, CHEAP)
    price = logged["prompt_tokens"] * PREMIUM_NANOS["input"] + logged["completion_tokens"] * PREMIUM_NANOS["output"]
    assert round(logged["cost"] * 1e9) == price > 0


def test_parallel_requests_falling_back_to_a_pricier_model_stay_within_the_budget(gw, upstreams, keys):
    _, premium = upstreams
    secret = keys[1]["budgeted"]
    before = requests_seen(premium)
    alone = ask(gw, secret)  # one on its own fits: the burst's outcome is then the budget's, not the timing's
    assert (alone.status_code, alone.headers["x-portcullis-model"]) == (200, PREMIUM), alone.text
    with ThreadPoolExecutor(30) as pool_:
        answers = [alone, *pool_.map(lambda _: ask(gw, secret), range(30))]
    served = [a for a in answers if a.status_code == 200]
    admin = {"authorization": f"Bearer {ADMIN_TOKEN}"}
    deadline = time.monotonic() + 30

    def written(report: list[dict]) -> int:
        return sum(row["requests"] + row["refused_requests"] for row in report)

    while True:  # each request is written to the ledger once its response has ended
        report = httpx.get(
            gw.admin_url + "/admin/spend", params={"group_by": "model", "tenant": "budgeted"}, headers=admin
        ).json()["data"]
        rows = {row["model"]: row for row in report}
        if written(report) == len(answers) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert written(report) == len(answers)
    assert sum(row["cost_nanos"] for row in report) <= BUDGET * 1e9
    assert all(a.headers["x-portcullis-model"] == PREMIUM for a in served)
    for refused in (a for a in answers if a.status_code != 200):
        assert_cheaps_own_failure(refused)
    assert requests_seen(premium) - before == len(served)
    served_here = rows[PREMIUM]
    assert served_here["requests"] == len(served)
    price = served_here["prompt_tokens"] * PREMIUM_NANOS["input"]
    assert served_here["cost_nanos"] == price + served_here["completion_tokens"] * PREMIUM_NANOS["output"]
    assert rows.get(CHEAP, {"cost_nanos": 0})["cost_nanos"] == 0  # its failures cost nothing
