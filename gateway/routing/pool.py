"""A pool of interchangeable upstream replicas behind one pooled httpx client."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

from gateway.config import PoolConfig


@dataclass(slots=True, eq=False)
class Replica:
    url: str
    outstanding: int = 0  # requests in flight from this gateway

    @property
    def address(self) -> tuple[str, int]:
        parts = urlsplit(self.url)
        return parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)


Ordering = Callable[[list[Replica]], list[Replica]]


def round_robin() -> Ordering:
    """Rotate the starting replica on every request; the rest follow as retry candidates."""
    counter = itertools.count()

    def order(replicas: list[Replica]) -> list[Replica]:
        start = next(counter) % len(replicas)
        return replicas[start:] + replicas[:start]

    return order


def least_outstanding() -> Ordering:
    """Fewest in-flight requests first; ties broken round-robin so idle pools still spread load."""
    rotate = round_robin()

    def order(replicas: list[Replica]) -> list[Replica]:
        return sorted(rotate(replicas), key=lambda r: r.outstanding)

    return order


POLICIES: dict[str, Callable[[], Ordering]] = {"round_robin": round_robin, "least_outstanding": least_outstanding}


class Pool:
    def __init__(self, config: PoolConfig, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.config = config
        self.name = config.name
        self.replicas = [Replica(url=r.url) for r in config.replicas]
        self.api_key = config.api_key()  # read once at start; the file never holds it
        self._order = POLICIES[config.routing]()
        t = config.timeouts
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=t.connect, read=t.read, write=t.write, pool=t.pool),
            limits=httpx.Limits(max_connections=config.max_connections,
                                max_keepalive_connections=config.max_connections),
            transport=transport,
            trust_env=False,
        )

    def candidates(self) -> list[Replica]:
        """Replicas in the order this request should try them."""
        return self._order(self.replicas)

    async def aclose(self) -> None:
        await self.client.aclose()


class Pools:
    """All configured pools; picks the one serving a model (explicit model lists win over catch-alls)."""

    def __init__(self, pools: list[Pool]) -> None:
        self.pools = pools

    def for_model(self, model: str) -> Pool | None:
        explicit = next((p for p in self.pools if model in p.config.models), None)
        return explicit or next((p for p in self.pools if not p.config.models), None)

    async def aclose(self) -> None:
        for pool in self.pools:
            await pool.aclose()
