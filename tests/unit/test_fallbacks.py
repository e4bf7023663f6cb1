"""Fallback steps, cooldowns and the authority every step is taken on (gateway/relay/fallbacks.py,
gateway/stages/authority.py), with real pools, a real tokenize part, a real rate limiter in this process's memory and a
clock the test moves."""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path

import pytest
from opentelemetry import trace
from starlette.requests import Request

from gateway.config import FallbackConfig, FallbackTrigger, LimitsConfig, ModelConfig, PoolConfig, TenantObjectsConfig
from gateway.context import RequestContext
from gateway.edge.offload import Offload
from gateway.errors import GatewayError
from gateway.keystore.records import KeyRecord
from gateway.observability.telemetry import Metrics
from gateway.policy.loader import PolicySet, empty_policy_set
from gateway.policy.model import Policy
from gateway.ratelimit.failover import CircuitBreaker, FailoverBackend
from gateway.ratelimit.limiter import RateLimiter
from gateway.ratelimit.memory import MemoryBackend
from gateway.relay.fallbacks import Fallbacks
from gateway.relay.upstream import PoolFailed
from gateway.routing.pool import Pool, Pools
from gateway.routing.replica import Replica
from gateway.spend.leases import Lease
from gateway.stages.authority import AuthorityStage
from gateway.stages.ratelimit import RateLimitStage
from gateway.stages.tokenize import Tokenize
from gateway.tenancy.models import TenantModels
from gateway.tenancy.ownership import TenantObjects
from gateway.tenancy.sqlite_store import SqliteObjectStore

POOLS = (("a", ["big"]), ("b", ["small"]), ("c", ["huge"]), ("d", []))
POLICY_HEAD = {"apiVersion": "portcullis.dev/v1", "kind": "Policy", "metadata": {"name": "unit"}}
OBJECTS = tempfile.TemporaryDirectory(prefix="fallbacks-objects-")  # the tenant objects' store, gone at exit


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def pools(*served: tuple[str, list[str]]) -> Pools:
    return Pools(
        [Pool(PoolConfig(name=name, replicas=[{"url": f"http://{name}:1"}], models=models)) for name, models in served]
    )


class Built:
    """Fallbacks over POOLS, each step authorised by a real authority, and what the test reads back."""

    def __init__(
        self,
        *configs: dict,
        models: list[ModelConfig] | None = None,
        clock: Clock | None = None,
        spec: dict | None = None,
    ) -> None:
        policies = (
            empty_policy_set()
            if spec is None
            else PolicySet(Policy.model_validate({**POLICY_HEAD, "spec": spec}), {}, "unit")
        )
        self.metrics = Metrics()
        backend = FailoverBackend(MemoryBackend(), MemoryBackend(), False, CircuitBreaker(3, 1.0), self.metrics)
        self.limits = RateLimitStage(lambda: policies, RateLimiter(backend, self.metrics))
        self.fallbacks = Fallbacks(
            [FallbackConfig.model_validate(c) for c in configs], pools(*POOLS), self.metrics.fallbacks, clock or Clock()
        )
        tokenize = Tokenize(models or [], lambda: policies, Offload(LimitsConfig()))
        # the requests here carry no key: one tenant, whose models no record decides
        store = SqliteObjectStore(Path(OBJECTS.name) / "objects.db")
        tenant_models = TenantModels(TenantObjects(store, TenantObjectsConfig()), [])
        self.authority = AuthorityStage(tokenize, self.limits, self.fallbacks, tenant_models, trace.NoOpTracer())

    def first(self, ctx: RequestContext) -> str:
        """The pool the request's first attempt is authorised for."""
        asyncio.run(self.authority(ctx))
        assert ctx.pool is not None
        return ctx.pool.name

    def after(self, ctx: RequestContext, trigger: FallbackTrigger) -> str | None:
        """The pool the request's next attempt is authorised for once its pool failed it; None where the client
        gets that failure."""
        failure = PoolFailed(GatewayError(503, "the pool failed it", code="upstream_status"), trigger)
        try:
            asyncio.run(self.authority.after(ctx, failure))
        except PoolFailed as raised:
            assert raised is failure
            return None
        assert ctx.pool is not None
        return ctx.pool.name

    def counted(self, to: str, trigger: str, model: str = "big") -> float:
        value = self.metrics.registry.get_sample_value(
            "portcullis_fallbacks_total", {"model": model, "to": to, "trigger": trigger}
        )
        return value or 0.0


def request(model: str, **payload) -> RequestContext:
    scope = {"type": "http", "method": "POST", "path": "/", "headers": [], "query_string": b""}
    ctx = RequestContext(request=Request(scope), route="chat", span=trace.INVALID_SPAN)
    ctx.payload = {"model": model, "messages": [{"role": "user", "content": "hi"}], **payload}
    ctx.model, ctx.tenant = model, "team"
    return ctx


def key(*models: str) -> KeyRecord:
    now = time.time()
    return KeyRecord(
        id="0123456789ab", tenant="team", digest="0" * 64, created_at=now, updated_at=now, models=list(models)
    )


def test_a_model_without_fallbacks_goes_to_its_pool_and_nowhere_after():
    built = Built({"model": "big", "to": [{"model": "small"}]})
    ctx = request("small")
    assert built.first(ctx) == "b"
    assert built.after(ctx, "5xx") is None
    assert built.first(request("anything")) == "d"  # the catch-all pool


def test_targets_are_tried_in_order_each_model_target_rewriting_the_payload():
    built = Built({"model": "big", "to": [{"model": "small"}, {"pool": "d"}]})
    ctx = request("big", max_tokens=10)  # an output bound of its own: nothing for the gateway to fill in
    assert built.first(ctx) == "a"
    assert ctx.fallback_from is None and not ctx.payload_rewritten
    assert built.after(ctx, "429") == "b"
    assert (ctx.model, ctx.payload["model"], ctx.fallback_from, ctx.fallback_step) == ("small", "small", "big", 1)
    assert ctx.payload_rewritten
    assert built.after(ctx, "timeout") == "d"  # a pool target: the requested model again
    assert (ctx.model, ctx.payload["model"], ctx.fallback_step) == ("big", "big", 2)
    assert built.after(ctx, "connection_error") is None
    assert built.counted("small", "429") == 1 and built.counted("d", "timeout") == 1


def test_a_failure_the_model_does_not_fall_back_on_neither_moves_nor_cools():
    built = Built({"model": "big", "to": [{"model": "small"}], "on": ["5xx"]})
    ctx = request("big")
    built.first(ctx)
    assert built.after(ctx, "429") is None
    assert ctx.model == "big" and not built.fallbacks.cooling("big", "a")


def test_a_failed_pool_cools_down_for_that_model_only_and_for_its_cooldown():
    clock = Clock()
    built = Built(
        {"model": "big", "to": [{"model": "small"}], "cooldown": 30},
        {"model": "small", "to": [{"model": "huge"}]},
        clock=clock,
    )
    first = request("big")
    built.first(first)
    built.after(first, "5xx")
    assert built.fallbacks.cooling("big", "a") and not built.fallbacks.cooling("small", "a")
    second = request("big")
    assert built.first(second) == "b"  # straight to the fallback
    assert second.model == "small" and built.counted("small", "cooldown") == 1
    clock.now += 29.9
    assert built.first(request("big")) == "b"
    clock.now += 0.2
    assert built.first(request("big")) == "a"  # cooled off: the primary again


def test_when_every_step_cools_the_request_tries_its_own_pool_and_then_gives_up():
    built = Built({"model": "big", "to": [{"model": "small"}]})
    ctx = request("big")
    built.first(ctx)
    built.after(ctx, "5xx")
    assert built.after(ctx, "5xx") is None  # both failed: both cool
    again = request("big")
    assert built.first(again) == "a" and again.fallback_from is None
    assert built.after(again, "5xx") is None  # the cooling fallback is passed over


def test_a_zero_cooldown_cools_nothing():
    built = Built({"model": "big", "to": [{"model": "small"}], "cooldown": 0})
    ctx = request("big")
    built.first(ctx)
    built.after(ctx, "5xx")
    assert not built.fallbacks.cooling("big", "a") and built.first(request("big")) == "a"


LONG = [{"role": "user", "content": "x" * 2400}]  # 604 tokens as the estimate counts them


def test_context_length_goes_to_a_model_whose_window_fits_cooling_or_not_and_cools_nothing():
    windows = [ModelConfig(name="big", context_window=1000), ModelConfig(name="small", context_window=500)]
    windows.append(ModelConfig(name="huge", context_window=100_000))
    built = Built({"model": "big", "to": [{"pool": "d"}, {"model": "small"}, {"model": "huge"}]}, models=windows)
    earlier = request("big")  # fails everywhere: every step cools
    built.first(earlier)
    while built.after(earlier, "5xx") is not None:
        pass
    assert built.fallbacks.cooling("huge", "c")
    ctx = request("big", max_tokens=200, messages=LONG)
    built.first(ctx)
    # the pool target keeps the model (same window), small's window is too small: huge, though it cools
    assert built.after(ctx, "context_length_exceeded") == "c"
    assert ctx.model == "huge"
    assert built.fallbacks.cooling("big", "a") and not built.fallbacks.cooling("big", "b")


def test_a_model_target_whose_window_the_request_does_not_fit_is_passed_over():
    windows = [ModelConfig(name="small", context_window=100)]
    built = Built({"model": "big", "to": [{"model": "small"}, {"pool": "d"}]}, models=windows)
    ctx = request("big", max_tokens=80, messages=[{"role": "user", "content": "x" * 200}])  # 54 tokens
    built.first(ctx)
    assert built.after(ctx, "5xx") == "d"


def test_the_gateway_sends_a_prompt_too_long_for_its_model_to_the_fallback_whose_window_fits():
    models = [ModelConfig(name="big", context_window=64), ModelConfig(name="small", context_window=128)]
    models.append(ModelConfig(name="huge", context_window=4096))
    built = Built({"model": "big", "to": [{"model": "small"}, {"model": "huge"}]}, models=models)
    ctx = request("big", max_tokens=10, messages=[{"role": "user", "content": "word " * 200}])
    assert built.first(ctx) == "c"
    assert (ctx.model, ctx.payload["model"], ctx.fallback_step) == ("huge", "huge", 2)
    assert ctx.prompt_tokens is not None and ctx.prompt_tokens > 64 and ctx.max_tokens == 10
    assert built.counted("huge", "context_length_exceeded") == 1


def test_a_prompt_too_long_for_every_window_is_refused_for_the_model_asked_for():
    models = [ModelConfig(name="big", context_window=64), ModelConfig(name="huge", context_window=128)]
    built = Built({"model": "big", "to": [{"model": "huge"}]}, models=models)
    ctx = request("big", messages=[{"role": "user", "content": "word " * 400}])
    with pytest.raises(GatewayError) as refused:
        built.first(ctx)
    assert refused.value.code == "context_length_exceeded" and "64 tokens" in refused.value.message
    assert ctx.model == "big" and ctx.pool is None


def test_a_step_the_key_may_not_use_is_passed_over_and_the_client_gets_its_own_models_failure():
    built = Built({"model": "big", "to": [{"model": "small"}, {"pool": "d"}]})
    ctx = request("big")
    ctx.key = key("big")
    built.first(ctx)
    assert built.after(ctx, "5xx") == "d"  # small is not the key's: the same model on pool d is
    assert (ctx.model, ctx.fallback_step) == ("big", 2) and built.counted("small", "5xx") == 0
    alone = Built({"model": "big", "to": [{"model": "small"}]})
    only = request("big")
    only.key = key("big")
    alone.first(only)
    assert alone.after(only, "5xx") is None
    assert only.model == "big" and only.payload["model"] == "big" and only.fallback_from is None


def test_on_arrival_a_cooling_pool_is_not_passed_for_a_step_the_key_may_not_use():
    built = Built({"model": "big", "to": [{"model": "small"}]})
    earlier = request("big")
    built.first(earlier)
    built.after(earlier, "5xx")  # big cools on pool a; the request went to small
    ctx = request("big")
    ctx.key = key("big")
    assert built.first(ctx) == "a"  # cooling, but the only step this key may take
    assert ctx.model == "big" and built.counted("small", "cooldown") == 0


PRICES = {"models": {"big": {"input": 1.0, "output": 2.0}, "small": {"input": 100.0, "output": 200.0}}}


def held(ctx: RequestContext) -> Lease:
    """The budget slice the request's attempt reserved on (a budget is its only limit)."""
    assert ctx.rate_limits is not None
    [lease] = ctx.rate_limits.leases
    return lease


def served(ctx: RequestContext, url: str, prompt: int, completion: int) -> None:
    ctx.status, ctx.replica = 200, Replica(url)
    ctx.usage.prompt_tokens, ctx.usage.completion_tokens = prompt, completion


def test_a_step_its_models_budget_refuses_is_passed_over_and_the_failed_attempts_reservation_comes_back():
    """`small` costs a hundred times `big`: its reservation does not fit the budget, `big`'s does. The failed
    attempt's reservation is given back whole, and the next is reserved at its own model's price."""
    budget = {"id": "team", "key": "tenant", "limit": 0.001, "period": "day"}  # a million nanos
    built = Built(
        {"model": "big", "to": [{"model": "small"}, {"pool": "d"}]}, spec={"prices": PRICES, "budgets": [budget]}
    )
    ctx = request("big", max_tokens=10)  # 5 prompt tokens: big reserves 25,000 nanos, small 2,500,000
    built.first(ctx)
    first = held(ctx)
    assert ctx.prompt_tokens == 5 and first.used == 5 * 1_000 + 10 * 2_000
    assert built.after(ctx, "5xx") == "d" and ctx.model == "big"
    assert first.used == 0 and not first.current  # given back whole: the slice went back to the store unused
    assert ctx.rate_limits is not None and ctx.rate_limits.reserved == 5 * 1_000 + 10 * 2_000  # big's price again
    again = held(ctx)
    reserved_before = again.used
    served(ctx, "http://d:1", 7, 3)
    built.limits.settle(ctx)
    assert reserved_before - again.used == 5 * 1_000 + 10 * 2_000 - (7 * 1_000 + 3 * 2_000)


def test_a_fallback_is_reserved_and_settled_at_its_own_models_price():
    budget = {"id": "team", "key": "tenant", "limit": 1.0, "period": "day"}
    built = Built({"model": "big", "to": [{"model": "small"}]}, spec={"prices": PRICES, "budgets": [budget]})
    ctx = request("big", max_tokens=10)
    built.first(ctx)
    first = held(ctx)
    assert built.after(ctx, "5xx") == "b"
    assert first.used == 0  # nothing left of big's reservation
    assert ctx.rate_limits is not None and ctx.rate_limits.reserved == 5 * 100_000 + 10 * 200_000  # small's price
    fallback = held(ctx)
    reserved_before = fallback.used
    served(ctx, "http://b:1", 7, 3)
    built.limits.settle(ctx)
    assert reserved_before - fallback.used == 5 * 100_000 + 10 * 200_000 - (7 * 100_000 + 3 * 200_000)


def test_the_failed_attempts_slot_is_free_for_the_next_and_the_next_models_own_limit_applies():
    rules = [
        {"id": "one-at-a-time", "key": ["tenant"], "concurrency": {"limit": 1}},
        {"id": "small-rph", "key": ["tenant"], "match": {"models": ["small"]}, "requests": {"limit": 1, "per": "1h"}},
    ]
    built = Built({"model": "big", "to": [{"model": "small"}], "cooldown": 0}, spec={"rate_limits": rules})
    first = request("big")
    built.first(first)
    assert built.after(first, "5xx") == "b"  # the slot big's attempt held is small's attempt's now
    built.limits.settle(first)
    second = request("big")
    built.first(second)
    assert built.after(second, "5xx") is None  # small's own limit is spent: the client gets big's failure
    assert second.model == "big" and second.rate_limits is None  # and holds nothing
    third = request("big")
    assert built.first(third) == "a"  # the slot came back
