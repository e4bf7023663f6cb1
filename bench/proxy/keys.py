"""`--keys` and `--limits`: what authority costs a proxied request. A stored key (SQLite or Redis) with a budget rule
against the config's static key, and rate limits in memory or Redis, all with quotas no run reaches."""

from __future__ import annotations

import time
from pathlib import Path

from bench.harness.gateways import sqlite_path
from bench.harness.processes import Service
from bench.harness.upstream import MODEL, REQUEST

# Rate limits as a typical policy sets them (requests per key, tokens per tenant, concurrency per tenant), with
# quotas no benchmark reaches: every request pays for a full decision and its settlement, none is refused.
LIMITS_POLICY = {
    "apiVersion": "portcullis.dev/v1",
    "kind": "Policy",
    "metadata": {"name": "bench-limits"},
    "spec": {
        "rate_limits": [
            {"id": "key-rpm", "key": ["api_key"], "requests": {"limit": 10**9, "per": "1m"}},
            {"id": "tenant-tpm", "key": ["tenant"], "tokens": {"limit": 10**12, "per": "1m"}},
            {"id": "tenant-slots", "key": ["tenant"], "concurrency": {"limit": 10**6}},
        ]
    },
}


# What the key-store rows add: a price table and a budget rule per tenant, with a limit no run spends, so
# every request reserves spend and settles its cost, and none is refused.
BUDGETS_POLICY = {
    "apiVersion": "portcullis.dev/v1",
    "kind": "Policy",
    "metadata": {"name": "bench-budgets"},
    "spec": {
        "prices": {"models": {MODEL: {"input": 1.0, "output": 2.0}}},
        "budgets": [
            {"id": "tenant-spend", "key": "tenant", "limit": 9_000_000, "period": "month"},
        ],
    },
}


# output tokens whose price alone (2.0 per million) is past BUDGETS_POLICY's limit: a request that reserves them is
# refused for its budget, and the refusal says what is left
PROBE_MAX_TOKENS = 5 * 10**12


# --keys' baseline: the same policy less the prices and budgets (not the repo's, which may gain stages meanwhile).
NO_BUDGETS_POLICY = {**BUDGETS_POLICY, "metadata": {"name": "bench-no-budgets"}, "spec": {}}
STATIC_KEY_ROW = "portcullis_static_key"  # --keys' baseline: the config's key
# a second static-key gateway, paired with the first like the key-store rows: how far two identical gateways' ratio
# strays on this machine, the noise floor to read the others against
CONTROL_ROW = "portcullis_static_key_control"
KEY_STORE_ROWS = (  # target, label, store backend: a stored key and BUDGETS_POLICY
    ("portcullis_keys_sqlite", "Portcullis + key store (SQLite) + budget", "sqlite"),
    ("portcullis_keys_redis", "Portcullis + key store (Redis) + budget", "redis"),
)


def store_key(store: str, tmp: Path, name: str, redis_url: str | None = None) -> str:
    """Write a key for tenant 'bench' into gateway `name`'s key store (its SQLite file, or Redis at `redis_url`), as
    the admin API would, before that gateway starts; returns the secret wrk is to send."""
    import asyncio

    from gateway.keystore.records import KeyRecord, digest_of, new_key_id, new_secret
    from gateway.keystore.redis_store import RedisKeyStore
    from gateway.keystore.sqlite_store import SqliteKeyStore

    key_id = new_key_id()
    secret = new_secret(key_id)
    at = time.time()
    record = KeyRecord(tenant="bench", label=name, id=key_id, digest=digest_of(secret), created_at=at, updated_at=at)

    async def put() -> None:
        if store == "redis":
            assert redis_url is not None
            backend: RedisKeyStore | SqliteKeyStore = RedisKeyStore(redis_url, timeout=2.0)
        else:
            backend = SqliteKeyStore(sqlite_path(tmp, name))
        try:
            await backend.put(record)
        finally:
            await backend.aclose()

    asyncio.run(put())
    return secret


def budget_left(service: Service, key: str) -> str:
    """What is left of the key's tightest budget (`x-portcullis-budget`), as a refusal says it: asked with a request
    whose output budget alone costs more than BUDGETS_POLICY's limit (answers far from a soft threshold carry no
    budget header). Fails when the request is not refused for its budget, i.e. the budgets are not on."""
    import httpx

    response = httpx.post(
        f"http://127.0.0.1:{service.port}/v1/chat/completions",
        json={**REQUEST, "max_tokens": PROBE_MAX_TOKENS},
        headers={"authorization": f"Bearer {key}"},
        timeout=30,
    )
    budget = response.headers.get("x-portcullis-budget")
    code = response.json().get("error", {}).get("code") if response.status_code == 429 else None
    if code != "budget_exceeded" or budget is None:
        raise RuntimeError(
            f"{service.name}: answered {response.status_code} to a request past its budget; budgets off?"
        )
    return budget


def keys_table(keys_ab: dict[str, dict]) -> str:
    """Each key-store row against the static-key row, from alternating pairs: what the acceptance reads."""
    first = next(iter(keys_ab.values()))
    header = (
        f"{'against Portcullis, static key':<42} {'RPS ratio':>9} {'quartiles':>15} {'CPU/req ratio':>13} "
        f"{'quartiles':>15} {'redis us/req':>12} {'err':>5}"
    )
    lines = [
        f"\nalternating pairs ({first['pairs']} x {first['seconds']:g} s each, c32, access log off), medians:",
        header,
        "-" * len(header),
    ]
    for ab in keys_ab.values():
        store = ab.get("store_cpu_us_per_request")
        redis_cpu = f"{sorted(store)[len(store) // 2]:.1f}" if store else "-"
        lines.append(
            f"{ab['label']:<42} {ab['median_ratio']:>9.3f} {str(ab['ratio_quartiles']):>15} "
            f"{ab['median_cpu_ratio']:>13.3f} {str(ab['cpu_ratio_quartiles']):>15} {redis_cpu:>12} "
            f"{sum(ab['errors'].values()):>5}"
        )
    return "\n".join(lines)
