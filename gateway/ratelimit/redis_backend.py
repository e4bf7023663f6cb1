"""Redis backend: limits shared exactly across gateway instances, one pipelined round trip per decision.

Each limit is one key, decided atomically by a Lua script run with EVALSHA (reloaded on NOSCRIPT after a Redis
restart). Keys carry a hash tag per limit key, so each script touches one slot and Redis Cluster can place it.
Scripts read Redis's own clock, so gateway clocks never disagree about a window.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from redis import exceptions as redis_errors
from redis.asyncio import BlockingConnectionPool, Redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from gateway.ratelimit.checks import BackendError, Check, RateCheck, Settlement
from gateway.ratelimit.gcra import Outcome

_LUA = Path(__file__).parent / "lua"
_US = 1_000_000


class _Script:
    def __init__(self, name: str) -> None:
        self.source = (_LUA / f"{name}.lua").read_text()
        self.sha = hashlib.sha1(self.source.encode()).hexdigest()


class RedisBackend:
    name = "redis"

    def __init__(self, url: str, timeout: float, max_connections: int = 64) -> None:
        pool = BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=timeout, socket_timeout=timeout,
            socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 0))
        self._redis = Redis(connection_pool=pool)
        self._gcra = _Script("gcra")
        self._adjust = _Script("gcra_adjust")
        self._slot = _Script("slot_acquire")

    async def acquire(self, checks: list[Check]) -> list[Outcome]:
        def commands(pipe) -> None:
            for check in checks:
                if isinstance(check, RateCheck):
                    pipe.evalsha(self._gcra.sha, 1, check.key, check.interval * _US, check.tolerance * _US,
                                 check.cost)
                else:
                    pipe.evalsha(self._slot.sha, 1, check.key, check.limit, int(check.lease * 1000), check.member)

        replies = await self._run(commands)
        return [Outcome(bool(a), int(r), retry / _US, reset / _US) for a, r, retry, reset in replies]

    async def settle(self, settlement: Settlement) -> None:
        def commands(pipe) -> None:
            for check, delta in settlement.adjustments:
                pipe.evalsha(self._adjust.sha, 1, check.key, check.interval * _US, delta)
            for slot in settlement.releases:
                pipe.zrem(slot.key, slot.member)

        if settlement.adjustments or settlement.releases:
            await self._run(commands)

    async def aclose(self) -> None:
        await self._redis.aclose()

    async def _run(self, commands) -> list:
        """Send a pipeline; if Redis forgot our scripts (restart, SCRIPT FLUSH), load them and send it again."""
        try:
            for attempt in range(2):
                pipe = self._redis.pipeline(transaction=False)
                commands(pipe)
                replies = await pipe.execute(raise_on_error=False)
                if not any(isinstance(r, redis_errors.NoScriptError) for r in replies) or attempt:
                    break
                for script in (self._gcra, self._adjust, self._slot):
                    await self._redis.script_load(script.source)
            errors = [r for r in replies if isinstance(r, Exception)]
            if errors:
                raise errors[0]
            return replies
        except (redis_errors.RedisError, OSError) as exc:
            raise BackendError(f"redis: {type(exc).__name__}: {exc}") from exc
