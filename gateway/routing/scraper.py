"""Active health and load: scrape each replica's Prometheus `/metrics` (vLLM names) on a short interval."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from gateway.routing.replica import Replica

log = logging.getLogger(__name__)


def engine_load(text: str) -> tuple[int, int, float, int]:
    """(running, waiting, KV usage fraction, total KV blocks) from vLLM-compatible metrics text."""
    values = {"vllm:num_requests_running": 0.0, "vllm:num_requests_waiting": 0.0, "vllm:kv_cache_usage_perc": 0.0}
    total_blocks = 0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in values:
                values[sample.name] += sample.value
            elif sample.name == "vllm:cache_config_info" and "num_gpu_blocks" in sample.labels:
                total_blocks = int(float(sample.labels["num_gpu_blocks"]))
    return (int(values["vllm:num_requests_running"]), int(values["vllm:num_requests_waiting"]),
            values["vllm:kv_cache_usage_perc"], total_blocks)


async def scrape(session: aiohttp.ClientSession, replica: Replica, timeout: float) -> bool:
    try:
        async with session.get(replica.url + "/metrics", timeout=aiohttp.ClientTimeout(total=timeout),
                               raise_for_status=True) as response:
            replica.observe(*engine_load(await response.text()))
        return True
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        log.debug("scrape of %s failed: %s", replica.url, exc)
        return False


async def scrape_forever(pool, on_change) -> None:
    """Scrape every replica of `pool` each interval; health follows; `on_change()` after each round."""
    config = pool.config
    while True:
        results = await asyncio.gather(*(scrape(pool.session, r, config.scrape_interval * 2)
                                         for r in pool.replicas))
        for replica, ok in zip(pool.replicas, results):
            replica.record(ok, config.health.failures_to_eject, config.health.eject_seconds)
        with contextlib.suppress(Exception):
            on_change()
        await asyncio.sleep(config.scrape_interval)
