"""The spend ledger's interface, one for the embedded SQLite file and for Redis.

Costs are whole nanos of the price table's currency (1e-9, Google's `Money.nanos`): each request's cost is rounded
to a nano once, so a ledger's total is exactly the sum of the costs its requests settled on, however many instances
add to it. Rows are kept per hour, so a report for any day, month or fixed window sums whole hours.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple, Protocol

NANOS = 1_000_000_000
HOUR = 3600

GroupBy = Literal["key", "tenant", "model", "hour", "day", "month"]


class SpendKey(NamedTuple):
    """One ledger row's identity: the hour (Unix seconds at its start) and who spent on what (a tuple: built and
    hashed for every request)."""

    hour: int
    key_id: str  # "" for a request no stored or static key identified
    tenant: str
    model: str


@dataclass(slots=True)
class SpendTotals:
    requests: int = 0  # served: an upstream answered them
    prompt_tokens: int = 0  # not from a prefix cache
    cached_tokens: int = 0
    completion_tokens: int = 0
    cost_nanos: int = 0
    refused_requests: int = 0  # not served: refused by the gateway, or failed upstream (charged nothing, mostly)
    cache_hits: int = 0  # answered from the response cache: no upstream asked, not among `requests`
    cache_hit_tokens: int = 0  # their prompt and completion tokens, not among the token counts above

    def add(self, other: SpendTotals) -> None:
        self.requests += other.requests
        self.refused_requests += other.refused_requests
        self.prompt_tokens += other.prompt_tokens
        self.cached_tokens += other.cached_tokens
        self.completion_tokens += other.completion_tokens
        self.cost_nanos += other.cost_nanos
        self.cache_hits += other.cache_hits
        self.cache_hit_tokens += other.cache_hit_tokens


def amount_text(nanos: int) -> str:
    """An amount of whole nanos as exact decimal text ('0.000016', never '1.6e-05')."""
    if nanos < 0:
        return "-" + amount_text(-nanos)
    digits = str(nanos).rjust(10, "0")  # a budget's header writes one per answer: slicing text beats divmod here
    fraction = digits[-9:].rstrip("0")
    return f"{digits[:-9]}.{fraction}" if fraction else digits[:-9]


class SpendStore(Protocol):
    name: str

    async def add(self, rows: Sequence[tuple[SpendKey, SpendTotals]], batch: int) -> None:
        """Add these totals to the ledger (increments: many instances add to the same rows). `batch` numbers the
        ledger's flushes, rising: a store that may have added a batch it then failed to confirm gets the same
        batch again, and adds it once."""

    async def rows(self, start: int, end: int) -> list[tuple[SpendKey, SpendTotals]]:
        """Every row whose hour lies in [start, end)."""

    async def aclose(self) -> None: ...
