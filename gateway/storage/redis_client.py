"""Redis connections, built one way from the operator's `redis.url` and `redis.timeout` for every part that uses
Redis (rate limits, keys, spend).

Each gives up on a Redis that stops answering after `redis.timeout`, to connect and to each reply, and never retries
on its own: redis-py's defaults (5 s, three retries with backoff) let one call to a frozen Redis hold an admin request
or a stopping gateway for many seconds, while the caller already knows what a failure means (a 503, rows kept for the
next flush, the next poll).
"""

from __future__ import annotations

from typing import Any

from redis.asyncio import ConnectionPool, Redis
from redis.asyncio.connection import parse_url
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff


def connection_options(url: str, timeout: float) -> dict[str, Any]:
    """Keyword arguments for a redis-py connection, or a pool of them, to `url` bounded by `timeout` seconds."""
    return {
        **parse_url(url),
        "socket_connect_timeout": timeout,
        "socket_timeout": timeout,
        "retry": Retry(NoBackoff(), 0),
    }


def redis_client(url: str, timeout: float) -> Redis:
    """A pooled client for `url` whose every command gives up after `timeout` seconds; `aclose` closes its pool."""
    return Redis.from_pool(ConnectionPool(**connection_options(url, timeout)))
