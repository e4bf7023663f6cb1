"""Fallback target selection and cooldowns (gateway/fallbacks.py), with real pools, a real tokenize stage and a
clock the test moves."""

from __future__ import annotations

import asyncio

import pytest
from opentelemetry import trace
from starlette.requests import Request

from gateway.config import FallbackConfig, LimitsConfig, ModelConfig, PoolConfig
from gateway.context import Placement, RequestContext
from gateway.errors import GatewayError
from gateway.fallbacks import ContextWindowFallback, Fallbacks
from gateway.offload import Offload
from gateway.policy.loader import empty_policy_set
from gateway.routing.pool import Pool, Pools
from gateway.routing.replica import KvHold
from gateway.stages.tokenize import TokenizeStage
from gateway.telemetry import Metrics


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def pools(*served: tuple[str, list[str]]) -> Pools:
    return Pools(
        [Pool(PoolConfig(name=name, replicas=[{"url": f"http://{name}:1"}], models=models)) for name, models in served]
    )


POOLS = (("a", ["big"]), ("b", ["small"]), ("c", ["huge"]), ("d", []))


def fallbacks(*configs: dict, models: list[ModelConfig] | None = None, clock: Clock | None = None):
    metrics = Metrics()
    built = Fallbacks(
        [FallbackConfig.model_validate(c) for c in configs],
        pools(*POOLS),
        models or [],
        metrics.fallbacks,
        clock or Clock(),
    )
    return built, metrics


def request(model: str, **payload) -> RequestContext:
    scope = {"type": "http", "method": "POST", "path": "/", "headers": [], "query_string": b""}
    ctx = RequestContext(request=Request(scope), route="chat", span=trace.INVALID_SPAN)
    ctx.payload = {"model": model, "messages": [{"role": "user", "content": "hi"}], **payload}
    ctx.model = model
    return ctx


def placed(ctx: RequestContext, pool: Pool | None) -> Pool:
    """What admission does with the pool it is given."""
    assert pool is not None
    ctx.placement = Placement(pool, pool.request_shape(0, 0, None), KvHold())
    return pool


def counted(metrics: Metrics, to: str, trigger: str, model: str = "big") -> float:
    value = metrics.registry.get_sample_value(
        "portcullis_fallbacks_total", {"model": model, "to": to, "trigger": trigger}
    )
    return value or 0.0


def test_a_model_without_fallbacks_goes_to_its_pool_and_nowhere_after():
    chosen, _ = fallbacks({"model": "big", "to": [{"model": "small"}]})
    ctx = request("small")
    assert placed(ctx, chosen.first(ctx)).name == "b"
    assert chosen.after(ctx, "5xx") is None
    assert chosen.first(request("anything")).name == "d"  # the catch-all pool


def test_targets_are_tried_in_order_each_model_target_rewriting_the_payload():
    chosen, metrics = fallbacks({"model": "big", "to": [{"model": "small"}, {"pool": "d"}]})
    ctx = request("big")
    assert placed(ctx, chosen.first(ctx)).name == "a"
    assert ctx.fallback_from is None and not ctx.payload_rewritten
    assert placed(ctx, chosen.after(ctx, "429")).name == "b"
    assert (ctx.model, ctx.payload["model"], ctx.fallback_from, ctx.fallback_step) == ("small", "small", "big", 1)
    assert ctx.payload_rewritten
    assert placed(ctx, chosen.after(ctx, "timeout")).name == "d"  # a pool target: the requested model again
    assert (ctx.model, ctx.payload["model"], ctx.fallback_step) == ("big", "big", 2)
    assert chosen.after(ctx, "connection_error") is None
    assert counted(metrics, "small", "429") == 1 and counted(metrics, "d", "timeout") == 1


def test_a_failure_the_model_does_not_fall_back_on_neither_moves_nor_cools():
    chosen, _ = fallbacks({"model": "big", "to": [{"model": "small"}], "on": ["5xx"]})
    ctx = request("big")
    placed(ctx, chosen.first(ctx))
    assert chosen.after(ctx, "429") is None
    assert ctx.model == "big" and not chosen.cooling("big", "a")


def test_a_failed_pool_cools_down_for_that_model_only_and_for_its_cooldown():
    clock = Clock()
    chosen, metrics = fallbacks(
        {"model": "big", "to": [{"model": "small"}], "cooldown": 30},
        {"model": "small", "to": [{"model": "huge"}]},
        clock=clock,
    )
    first = request("big")
    placed(first, chosen.first(first))
    chosen.after(first, "5xx")
    assert chosen.cooling("big", "a") and not chosen.cooling("small", "a")
    second = request("big")
    assert chosen.first(second).name == "b"  # straight to the fallback
    assert second.model == "small" and counted(metrics, "small", "cooldown") == 1
    clock.now += 29.9
    assert chosen.first(request("big")).name == "b"
    clock.now += 0.2
    assert chosen.first(request("big")).name == "a"  # cooled off: the primary again


def test_when_every_step_cools_the_request_tries_its_own_pool_and_then_gives_up():
    chosen, _ = fallbacks({"model": "big", "to": [{"model": "small"}]})
    ctx = request("big")
    placed(ctx, chosen.first(ctx))
    placed(ctx, chosen.after(ctx, "5xx"))
    assert chosen.after(ctx, "5xx") is None  # both failed: both cool
    again = request("big")
    assert placed(again, chosen.first(again)).name == "a" and again.fallback_from is None
    assert chosen.after(again, "5xx") is None  # the cooling fallback is passed over


def test_a_zero_cooldown_cools_nothing():
    chosen, _ = fallbacks({"model": "big", "to": [{"model": "small"}], "cooldown": 0})
    ctx = request("big")
    placed(ctx, chosen.first(ctx))
    chosen.after(ctx, "5xx")
    assert not chosen.cooling("big", "a") and chosen.first(request("big")).name == "a"


def test_context_length_goes_to_a_model_whose_window_fits_cooling_or_not_and_cools_nothing():
    windows = [ModelConfig(name="big", context_window=1000), ModelConfig(name="small", context_window=500)]
    windows.append(ModelConfig(name="huge", context_window=100_000))
    chosen, _ = fallbacks(
        {"model": "big", "to": [{"pool": "d"}, {"model": "small"}, {"model": "huge"}]}, models=windows
    )
    earlier = request("big")  # fails everywhere: every step cools
    placed(earlier, chosen.first(earlier))
    while (pool := chosen.after(earlier, "5xx")) is not None:
        placed(earlier, pool)
    assert chosen.cooling("huge", "c")
    ctx = request("big", max_tokens=200)
    ctx.prompt_tokens = 600
    placed(ctx, chosen.first(ctx))
    # the pool target keeps the model (same window), small's window is too small: huge, though it cools
    assert placed(ctx, chosen.after(ctx, "context_length_exceeded")).name == "c"
    assert ctx.model == "huge"
    assert chosen.cooling("big", "a") and not chosen.cooling("big", "b")


def test_a_model_target_whose_window_the_request_does_not_fit_is_passed_over():
    windows = [ModelConfig(name="small", context_window=100)]
    chosen, _ = fallbacks({"model": "big", "to": [{"model": "small"}, {"pool": "d"}]}, models=windows)
    ctx = request("big", max_tokens=80)
    ctx.prompt_tokens = 50
    placed(ctx, chosen.first(ctx))
    assert placed(ctx, chosen.after(ctx, "5xx")).name == "d"


def tokenize_stage(models: list[ModelConfig]) -> TokenizeStage:
    return TokenizeStage(models, empty_policy_set, Offload(LimitsConfig()))


def test_the_gateway_sends_a_prompt_too_long_for_its_model_to_the_fallback_whose_window_fits():
    models = [ModelConfig(name="big", context_window=64), ModelConfig(name="small", context_window=128)]
    models.append(ModelConfig(name="huge", context_window=4096))
    chosen, metrics = fallbacks({"model": "big", "to": [{"model": "small"}, {"model": "huge"}]}, models=models)
    stage = ContextWindowFallback(tokenize_stage(models), chosen)
    ctx = request("big", max_tokens=10)
    ctx.payload["messages"] = [{"role": "user", "content": "word " * 200}]
    asyncio.run(stage(ctx))
    assert (ctx.model, ctx.payload["model"], ctx.fallback_step) == ("huge", "huge", 2)
    assert ctx.prompt_tokens is not None and ctx.prompt_tokens > 64 and ctx.max_tokens == 10
    assert counted(metrics, "huge", "context_length_exceeded") == 1
    assert placed(ctx, chosen.first(ctx)).name == "c"  # admission starts at the step the stage chose


def test_a_prompt_too_long_for_every_window_is_refused_for_the_model_asked_for():
    models = [ModelConfig(name="big", context_window=64), ModelConfig(name="huge", context_window=128)]
    chosen, _ = fallbacks({"model": "big", "to": [{"model": "huge"}]}, models=models)
    stage = ContextWindowFallback(tokenize_stage(models), chosen)
    ctx = request("big")
    ctx.payload["messages"] = [{"role": "user", "content": "word " * 400}]
    with pytest.raises(GatewayError) as refused:
        asyncio.run(stage(ctx))
    assert refused.value.code == "context_length_exceeded" and "64 tokens" in refused.value.message
    assert ctx.model == "big"
