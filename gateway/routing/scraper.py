"""Active health and load: scrape each replica's Prometheus `/metrics` (vLLM or SGLang names) on a short interval,
or, for pools whose policy needs no load figures, probe a health path."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from gateway.routing.replica import Replica

if TYPE_CHECKING:  # the pool starts these loops: a runtime import would be circular
    from gateway.routing.pool import Pool

log = logging.getLogger(__name__)


_RUNNING = {"vllm:num_requests_running", "sglang:num_running_reqs"}
_WAITING = {"vllm:num_requests_waiting", "sglang:num_queue_reqs"}
# vLLM renamed gpu_cache_usage_perc to kv_cache_usage_perc; both, like SGLang's token_usage, are fractions 0..1
_KV_USAGE = {"vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage"}


def engine_load(text: str, block_size: int = 16) -> tuple[int, int, float, int]:
    """(running, waiting, KV usage fraction, total KV blocks of `block_size` tokens) from an engine's metrics text.

    vLLM names (and the bundled engine, which uses them) or SGLang's (python/sglang/srt/metrics/collector.py:
    `sglang:num_running_reqs`, `sglang:num_queue_reqs`, `sglang:token_usage`, `sglang:max_total_num_tokens`; the
    `sglang_` spelling too). Counts add up over series (data-parallel ranks), usage is their mean; SGLang series
    of tensor-parallel ranks other than 0 repeat rank 0's figures and are skipped.
    """
    running = waiting = 0.0
    usage: list[float] = []
    total_blocks = kv_tokens = 0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = "sglang:" + sample.name[7:] if sample.name.startswith("sglang_") else sample.name
            if name.startswith("sglang:") and sample.labels.get("tp_rank", "0") != "0":
                continue
            if name in _RUNNING:
                running += sample.value
            elif name in _WAITING:
                waiting += sample.value
            elif name in _KV_USAGE:
                usage.append(sample.value)
            elif name == "sglang:max_total_num_tokens":
                kv_tokens += int(sample.value)
            elif name == "vllm:cache_config_info" and "num_gpu_blocks" in sample.labels:
                total_blocks = int(float(sample.labels["num_gpu_blocks"]))
    return (
        int(running),
        int(waiting),
        sum(usage) / len(usage) if usage else 0.0,
        total_blocks or kv_tokens // block_size,
    )


async def scrape(session: aiohttp.ClientSession, replica: Replica, timeout: float, block_size: int = 16) -> bool:
    try:
        async with session.get(
            replica.url + "/metrics", timeout=aiohttp.ClientTimeout(total=timeout), raise_for_status=True
        ) as response:
            replica.observe(*engine_load(await response.text(), block_size))
        return True
    except (aiohttp.ClientError, TimeoutError, ValueError, OverflowError) as exc:  # NaN, ±Inf: no count
        log.debug("scrape of %s failed: %s", replica.url, exc)
        return False


async def probe(
    session: aiohttp.ClientSession, replica: Replica, path: str, timeout: float, headers: dict[str, str]
) -> bool:
    """A plain health check: any 2xx answer to GET `path` within `timeout` is healthy."""
    try:
        async with session.get(
            replica.url + path, timeout=aiohttp.ClientTimeout(total=timeout), headers=headers, raise_for_status=True
        ):
            return True
    except (aiohttp.ClientError, TimeoutError) as exc:
        log.debug("health probe of %s failed: %s", replica.url, exc)
        return False


async def check_forever(
    pool: Pool,
    check: Callable[[Replica], Awaitable[bool]],
    interval: float,
    on_change: Callable[[], None] | None = None,
) -> None:
    """Check every replica of `pool` each interval; health follows; `on_change()` after each round."""
    health = pool.config.health
    while True:
        # one replica's check failing in a way nobody foresaw must not stop the checks of all: it counts as failed
        results = await asyncio.gather(*(check(r) for r in pool.replicas), return_exceptions=True)
        for replica, ok in zip(pool.replicas, results):
            if isinstance(ok, Exception):
                log.error("health check of %s failed unexpectedly", replica.url, exc_info=ok)
            replica.record(ok is True, health.failures_to_eject, health.eject_seconds)
        if on_change is not None:
            with contextlib.suppress(Exception):
                on_change()
        await asyncio.sleep(interval)


def scrape_forever(pool: Pool, on_change: Callable[[], None]) -> Coroutine[Any, Any, None]:
    interval = pool.config.scrape_interval
    size = pool.config.block_size
    return check_forever(pool, lambda r: scrape(pool.session, r, interval * 2, size), interval, on_change)


def probe_forever(pool: Pool, path: str) -> Coroutine[Any, Any, None]:
    """Probe the pool's health `path` (the pool's configured one, when it has one)."""
    health = pool.config.health
    headers = {"Authorization": f"Bearer {pool.api_key}"} if pool.api_key else {}
    return check_forever(pool, lambda r: probe(pool.session, r, path, health.interval, headers), health.interval)
