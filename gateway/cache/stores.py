"""Where the response cache keeps answers: this process's memory, or Redis shared by a fleet.

An answer is bytes under a key (gateway/cache/key.py) with a time to live; one bigger than
`response_cache.max_entry_bytes` is never stored. The memory store is bounded in bytes too (`max_bytes`): past it
the least recently used answers go. The Redis store lets Redis expire its keys; a Redis that fails or stalls past
`redis.timeout` is a miss (and a store not made), never an error the client sees: the upstream still answers. After
`redis.breaker_failures` failures in a row it is left alone for `redis.breaker_cooldown` seconds, so a Redis that is
down costs requests no wait of `redis.timeout` each.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

from redis.exceptions import RedisError

from gateway.config import GatewayConfig
from gateway.ratelimit.failover import CircuitBreaker
from gateway.storage.redis_client import redis_client

log = logging.getLogger(__name__)


class AnswerStore(Protocol):
    name: str

    async def get(self, key: str) -> bytes | None: ...

    async def put(self, key: str, answer: bytes, ttl: float) -> None: ...

    async def aclose(self) -> None: ...


class MemoryStore:
    """Least recently used first out past `max_bytes`; an expired answer goes when it is next asked for (or pushed
    out), so expiry costs no timer."""

    name = "memory"

    def __init__(self, max_bytes: int, max_entry_bytes: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_bytes = max_bytes
        self.max_entry_bytes = max_entry_bytes
        self.size = 0  # bytes held
        self._entries: OrderedDict[str, tuple[float, bytes]] = OrderedDict()  # key -> (expires at, answer)
        self._clock = clock

    def __len__(self) -> int:
        return len(self._entries)

    async def get(self, key: str) -> bytes | None:
        found = self._entries.get(key)
        if found is None:
            return None
        expires, answer = found
        if expires <= self._clock():
            self._remove(key)
            return None
        self._entries.move_to_end(key)
        return answer

    async def put(self, key: str, answer: bytes, ttl: float) -> None:
        if len(answer) > self.max_entry_bytes or len(answer) > self.max_bytes:
            return
        if key in self._entries:
            self._remove(key)
        self._entries[key] = (self._clock() + ttl, answer)
        self.size += len(answer)
        while self.size > self.max_bytes:
            self._remove(next(iter(self._entries)))

    def _remove(self, key: str) -> None:
        _, answer = self._entries.pop(key)
        self.size -= len(answer)

    async def aclose(self) -> None:
        self._entries.clear()
        self.size = 0


class RedisStore:
    """Answers in Redis under `key_prefix`, expired by Redis itself (PX); shared by every instance."""

    name = "redis"

    def __init__(
        self, url: str, timeout: float, key_prefix: str, max_entry_bytes: int, breaker: CircuitBreaker
    ) -> None:
        self._redis = redis_client(url, timeout)
        self._prefix = key_prefix
        self.max_entry_bytes = max_entry_bytes
        self._timeout = timeout
        self._breaker = breaker

    async def get(self, key: str) -> bytes | None:
        if self._breaker.is_open:
            return None
        try:
            async with asyncio.timeout(self._timeout):
                found = await self._redis.get(self._prefix + key)
        except (RedisError, OSError, TimeoutError) as exc:
            self._breaker.record(ok=False)
            log.warning("response cache: redis get failed, served as a miss: %s", exc)
            return None
        self._breaker.record(ok=True)
        if not isinstance(found, bytes) or len(found) > self.max_entry_bytes:  # not one this gateway stored
            return None
        return found

    async def put(self, key: str, answer: bytes, ttl: float) -> None:
        if len(answer) > self.max_entry_bytes or self._breaker.is_open:
            return
        try:
            async with asyncio.timeout(self._timeout):
                await self._redis.set(self._prefix + key, answer, px=max(1, round(ttl * 1000)))
        except (RedisError, OSError, TimeoutError) as exc:
            self._breaker.record(ok=False)
            log.warning("response cache: redis set failed, answer not stored: %s", exc)
            return
        self._breaker.record(ok=True)

    async def aclose(self) -> None:
        await self._redis.aclose()


def build_answer_store(config: GatewayConfig) -> AnswerStore:
    cache, redis = config.response_cache, config.redis
    if cache.store == "redis":
        assert redis.url is not None  # the config's validation requires it
        breaker = CircuitBreaker(redis.breaker_failures, redis.breaker_cooldown, store="response cache store")
        return RedisStore(redis.url, redis.timeout, cache.key_prefix, cache.max_entry_bytes, breaker)
    return MemoryStore(cache.max_bytes, cache.max_entry_bytes)
