"""Run a request's CPU-heavy work (parsing, the WAF, tokenizing a big body) off the event loop, a few at a time.

The event loop serves every connection, so a stage that spends a second on one body (a WAF pass over 100k values,
tokenizing a 4 MB prompt) stalls /healthz, streams in flight and every small request for that second. Big inputs
therefore run on a small executor of their own: a flood of big bodies waits in its queue instead of taking the
loop, or the default executor that `asyncio.to_thread` shares. Small inputs stay inline, because the hop to a
thread (~50-100 µs) would cost more than their work. The worker threads still hold the GIL while they run Python
code; the interpreter hands it back every switch interval (5 ms), which is what keeps the loop answering.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from gateway.config import LimitsConfig

T = TypeVar("T")


class Offload:
    def __init__(self, limits: LimitsConfig) -> None:
        self._min_bytes = limits.offload_min_bytes
        self._min_values = limits.offload_min_values
        self._executor = ThreadPoolExecutor(max_workers=limits.offload_workers, thread_name_prefix="offload")

    def is_big(self, body_bytes: int, json_values: int = 0) -> bool:
        """Whether a body is worth a thread hop (its values are unknown before it is parsed)."""
        return body_bytes >= self._min_bytes or json_values >= self._min_values

    async def run(self, big: bool, work: Callable[..., T], *args: object) -> T:
        """`work(*args)`: inline when small, on the offload executor when big (a cancelled wait drops a queued job)."""
        if not big:
            return work(*args)
        return await asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(work, *args))

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
