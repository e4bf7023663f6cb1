"""The pipeline's request phase in process: a stage that the policy set in force leaves with nothing to do (the
response cache, the guard) is left out, and comes back with a policy set that gives it work."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from opentelemetry import trace
from starlette.requests import Request

from gateway.cache.semantic import Embedder
from gateway.cache.stores import MemoryStore
from gateway.config import LimitsConfig
from gateway.context import RequestContext
from gateway.edge.offload import Offload
from gateway.guard.runtime import Guard
from gateway.observability.telemetry import Metrics
from gateway.pipeline import Pipeline
from gateway.policy.loader import PolicySet, load_policy_dir
from gateway.routing.pool import Pools
from gateway.stages.cache import CacheStage
from gateway.stages.guard import GuardStage

DOC = {"apiVersion": "portcullis.dev/v1", "metadata": {"name": "p"}}


def policies(directory: Path, base: dict, overlay: dict | None = None) -> PolicySet:
    directory.mkdir()
    (directory / "base.yaml").write_text(json.dumps({**DOC, "kind": "Policy", "spec": base}))
    if overlay is not None:
        (directory / "tenants").mkdir()
        tenant = {**DOC, "kind": "TenantPolicy", "tenant": "acme", "spec": overlay}
        (directory / "tenants" / "acme.yaml").write_text(json.dumps(tenant))
    return load_policy_dir(directory)


def request() -> RequestContext:
    scope = {"type": "http", "method": "POST", "path": "/", "headers": [], "query_string": b""}
    return RequestContext(request=Request(scope), route="chat", span=trace.INVALID_SPAN)


class Counting:
    """Notes each request the stage is run for, and does nothing with it."""

    runs = 0

    async def __call__(self, ctx: RequestContext) -> None:
        self.runs += 1


class Seen(Counting):
    """A stage that notes each request it is run for."""

    name = "seen"


class SeenCache(Counting, CacheStage):
    """The response cache stage, noting each request it is run for (and doing nothing with it)."""


def test_the_cache_stage_runs_only_under_a_policy_set_that_turns_the_cache_on(tmp_path: Path) -> None:
    off = policies(tmp_path / "off", {})
    on_for_one = policies(tmp_path / "one", {}, {"cache": {"enabled": True}})
    on_in_base = policies(tmp_path / "base", {"cache": {"enabled": True}}, {"cache": {"enabled": False}})
    in_force = [off]
    metrics = Metrics()
    cache = SeenCache(lambda: in_force[0], MemoryStore(1 << 20, 1 << 16), metrics, 1 << 16, Embedder(Pools([])), 16)
    first = Seen()
    pipeline = Pipeline([first, cache], trace.get_tracer("test"), metrics, lambda: in_force[0])

    def run() -> None:
        asyncio.run(pipeline.run(request()))

    run()
    assert (first.runs, cache.runs) == (1, 0)
    for turned_on in (on_for_one, on_in_base):  # a reload that turns it on, for one tenant or in the base
        in_force[0] = turned_on
        run()
    assert (first.runs, cache.runs) == (3, 2)
    in_force[0] = off
    run()
    assert (first.runs, cache.runs) == (4, 2)


class SeenGuard(Counting, GuardStage):
    """The guard stage, noting each request it is run for (and doing nothing with it)."""


def test_the_guard_stage_runs_only_under_a_policy_set_where_some_guard_reads_or_refuses(tmp_path: Path) -> None:
    off = policies(tmp_path / "off", {})
    on_for_one = policies(tmp_path / "one", {}, {"guard": {"enabled": True}})
    refusing_in_base = policies(tmp_path / "refuse", {"guard": {"unknown_content": "refuse"}})
    in_force = [off]
    metrics = Metrics()
    limits = LimitsConfig()
    guard = SeenGuard(lambda: in_force[0], Guard(metrics.registry), Offload(limits), lambda model, ids: None)
    pipeline = Pipeline([guard], trace.get_tracer("test"), metrics, lambda: in_force[0])

    def run() -> None:
        asyncio.run(pipeline.run(request()))

    run()
    assert guard.runs == 0
    for given_work in (on_for_one, refusing_in_base):  # the guard on for one tenant, the base refusing unknown content
        in_force[0] = given_work
        run()
    assert guard.runs == 2
