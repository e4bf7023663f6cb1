"""What a config reload swaps and what it refuses, in process: the fleet a reload builds carries over the pools
configured as they were and closes the others only once no request holds the fleet they were in; a change to a
setting only a restart applies is named by its key path."""

from __future__ import annotations

import asyncio
from pathlib import Path

from opentelemetry import trace

from gateway.config import AuthConfig, GatewayConfig, LimitsConfig, StoreConfig, TenantObjectsConfig
from gateway.edge.offload import Offload
from gateway.fleet import FleetBuilder, Fleets
from gateway.guard.runtime import Guard
from gateway.keystore.keyring import KeyRing
from gateway.keystore.sqlite_store import SqliteKeyStore
from gateway.observability.telemetry import Metrics
from gateway.policy.loader import empty_policy_set
from gateway.ratelimit.failover import CircuitBreaker, FailoverBackend
from gateway.ratelimit.limiter import RateLimiter
from gateway.ratelimit.memory import MemoryBackend
from gateway.relay.upstream import Upstream
from gateway.reload.config import needing_restart
from gateway.routing.pool import Pool
from gateway.stages.guard import GuardStage
from gateway.stages.ratelimit import RateLimitStage
from gateway.stages.waf import WafStage
from gateway.tenancy.batch_requests import BatchRequestChecks
from gateway.tenancy.ownership import TenantObjects
from gateway.tenancy.sqlite_store import SqliteObjectStore


def config(**fields: object) -> GatewayConfig:
    pools = [
        {"name": "kept", "replicas": [{"url": "http://127.0.0.1:1"}], "models": ["a"]},
        {"name": "changed", "replicas": [{"url": "http://127.0.0.1:2"}], "models": ["b"]},
    ]
    return GatewayConfig.model_validate({"pools": pools, **fields})


def builder(directory: Path) -> FleetBuilder:
    metrics = Metrics()
    backend = FailoverBackend(MemoryBackend(), MemoryBackend(), False, CircuitBreaker(3, 1.0), metrics)
    offload = Offload(LimitsConfig())
    tracer = trace.NoOpTracer()
    keys = KeyRing(AuthConfig(), SqliteKeyStore(str(directory / "keys.db")), StoreConfig(), metrics.key_store_synced)
    waf = WafStage(empty_policy_set, keys, offload, metrics)
    guard = GuardStage(empty_policy_set, Guard(metrics.registry), offload, lambda model, ids: None)
    return FleetBuilder(
        empty_policy_set,
        offload,
        RateLimitStage(empty_policy_set, RateLimiter(backend, metrics)),
        TenantObjects(SqliteObjectStore(directory / "objects.db"), TenantObjectsConfig()),
        Upstream(tracer, metrics, offload, False),
        BatchRequestChecks(empty_policy_set, waf, guard, offload, LimitsConfig()),
        tracer,
        metrics,
    )


def test_only_settings_a_restart_applies_are_named_each_by_its_key_path():
    running = config()
    reloaded = config(
        pools=[{"name": "new", "replicas": [{"url": "http://127.0.0.1:3"}]}],
        models=[{"name": "m", "context_window": 100}],
        auth={"keys": [{"tenant": "t", "sha256": "0" * 64}]},
        fallbacks=[{"model": "x", "to": [{"pool": "new"}]}],
    )
    assert needing_restart(running, reloaded) == []
    restart = config(listen={"port": 9000}, auth={"anonymous": False}, limits={"max_messages": 5})
    assert sorted(needing_restart(running, restart)) == ["auth.anonymous", "limits.max_messages", "listen.port"]


def test_a_reload_keeps_unchanged_pools_and_closes_the_others_once_their_requests_ended(tmp_path: Path):
    async def scenario() -> list[str]:
        build = builder(tmp_path)
        first = build.build(config())
        fleets = Fleets(first)
        closed: list[str] = []
        for pool in first.pools.pools:
            pool.aclose = _recording(pool, closed)  # type: ignore[method-assign]
        in_flight = fleets.current.enter()  # a request that arrived before the reload
        moved = config().model_dump()
        moved["pools"][1]["replicas"] = [{"url": "http://127.0.0.1:4"}]
        second = build.build(GatewayConfig.model_validate(moved), first)
        fleets.swap(second)
        kept, changed = first.pools.pools
        assert second.pools.pools[0] is kept and second.pools.pools[1] is not changed
        await asyncio.sleep(0.05)
        still_open = list(closed)
        in_flight.leave()
        await asyncio.sleep(0.05)
        await fleets.aclose()
        return still_open + ["--"] + closed

    assert asyncio.run(scenario()) == ["--", "changed", "kept"]


def _recording(pool: Pool, closed: list[str]):
    async def aclose() -> None:
        closed.append(pool.name)

    return aclose
