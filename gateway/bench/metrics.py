"""Per-request measurements and the summary math, with vLLM `bench serve` definitions.

- TTFT: send -> first chunk carrying output text.
- E2E latency: send -> last stream event (the usage chunk when the target sends one).
- TPOT (per request): (E2E - TTFT) / (output_tokens - 1), for requests with more than one output token;
  the first token is excluded. output_tokens is usage.completion_tokens, else the number of text chunks.
- ITL: gaps between consecutive text chunks, pooled over all requests (a chunk may carry several tokens).
- Throughputs divide by the benchmark's wall-clock duration; goodput counts requests meeting every given SLO
  (TTFT, TPOT; a one-token request has TPOT 0) per second.
- Percentiles interpolate linearly (numpy's default). Times are reported in milliseconds.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class RequestResult:
    index: int
    tenant: int
    conversation: int
    turn: int
    start_s: float = 0.0  # send time, seconds after the benchmark started
    success: bool = False
    status: int | None = None
    error: str | None = None
    cancelled: bool = False
    ttft_s: float | None = None
    e2el_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    chunks: int = 0  # chunks that carried output text
    text: str = ""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    replica: str | None = None
    oracle_prompt_tokens: int | None = None  # with a tokenizer: the prompt as tokenized for the oracle
    oracle_cached_tokens: int | None = None

    @property
    def output_tokens(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else self.chunks

    @property
    def tpot_s(self) -> float | None:
        """None for requests without a usable E2E/TTFT; 0 for a single output token."""
        if self.ttft_s is None or self.e2el_s is None:
            return None
        n = self.output_tokens
        return (self.e2el_s - self.ttft_s) / (n - 1) if n > 1 else 0.0

    def to_json(self) -> dict:
        def ms(v: float | None) -> float | None:
            return None if v is None else round(v * 1000, 3)

        return {
            "index": self.index,
            "tenant": self.tenant,
            "conversation": self.conversation,
            "turn": self.turn,
            "start_s": round(self.start_s, 6),
            "success": self.success,
            "status": self.status,
            "error": self.error,
            "cancelled": self.cancelled,
            "ttft_ms": ms(self.ttft_s),
            "tpot_ms": ms(self.tpot_s) if self.success else None,
            "e2el_ms": ms(self.e2el_s),
            "output_tokens": self.output_tokens,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "replica": self.replica,
            "oracle_prompt_tokens": self.oracle_prompt_tokens,
            "oracle_cached_tokens": self.oracle_cached_tokens,
        }


def stats_ms(values_s: Iterable[float]) -> dict[str, float | None]:
    """mean, p50, p90, p99 in milliseconds; None each when there are no values."""
    arr = np.asarray(list(values_s), dtype=float) * 1000.0
    if arr.size == 0:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    return {"mean": float(arr.mean()), **{f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES}}


def meets_slo(r: RequestResult, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    if not r.success:
        return False
    if slo_ttft_ms is not None and (r.ttft_s is None or r.ttft_s * 1000 > slo_ttft_ms):
        return False
    tpot = r.tpot_s
    if slo_tpot_ms is not None and (tpot is None or tpot * 1000 > slo_tpot_ms):
        return False
    return True


def replica_share(results: Sequence[RequestResult]) -> dict[str, dict] | None:
    """Requests per `x-portcullis-replica` value over requests that got one; None if none did."""
    counts = Counter(r.replica for r in results if r.replica is not None)
    total = sum(counts.values())
    if not total:
        return None
    return {name: {"requests": n, "share": n / total} for name, n in sorted(counts.items())}


def per_tenant(results: Sequence[RequestResult]) -> dict[str, dict]:
    """Requests, failures, TTFT p50/p99 and measured hit rate per tenant (fairness under a hot-tenant skew)."""
    out = {}
    for tenant in sorted({r.tenant for r in results}):
        rows = [r for r in results if r.tenant == tenant and not r.cancelled]
        ok = [r for r in rows if r.success]
        ttft = stats_ms(r.ttft_s for r in ok if r.ttft_s is not None)
        out[str(tenant)] = {
            "requests": len(rows),
            "completed": len(ok),
            "failed": len(rows) - len(ok),
            "ttft_p50_ms": ttft["p50"],
            "ttft_p99_ms": ttft["p99"],
            "measured_hit_rate": measured_hit_rate(ok)[0],
        }
    return out


def summarize(
    results: Sequence[RequestResult],
    duration_s: float,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
) -> dict:
    ok = [r for r in results if r.success]
    failed = [r for r in results if not r.success and not r.cancelled]
    cancelled = [r for r in results if r.cancelled]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens or 0 for r in ok)
    duration = max(duration_s, 1e-9)
    summary = {
        "duration_s": duration_s,
        "completed": len(ok),
        "failed": len(failed),
        "cancelled": len(cancelled),
        "errors": dict(Counter(r.error or f"status {r.status}" for r in failed).most_common(10)),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft_ms": stats_ms(r.ttft_s for r in ok if r.ttft_s is not None),
        "tpot_ms": stats_ms(r.tpot_s for r in ok if r.output_tokens > 1 and r.tpot_s is not None),
        "itl_ms": stats_ms(x for r in ok for x in r.itl_s),
        "e2el_ms": stats_ms(r.e2el_s for r in ok if r.e2el_s is not None),
        "goodput": None,
        "replica_share": replica_share([r for r in results if not r.cancelled]),
        "per_tenant": per_tenant(results),
    }
    if slo_ttft_ms is not None or slo_tpot_ms is not None:
        good = sum(meets_slo(r, slo_ttft_ms, slo_tpot_ms) for r in results)
        summary["goodput"] = {
            "slo_ttft_ms": slo_ttft_ms,
            "slo_tpot_ms": slo_tpot_ms,
            "good_requests": good,
            "request_goodput": good / duration,
            "attainment": good / len(ok) if ok else None,
        }
    return summary


def measured_hit_rate(results: Sequence[RequestResult]) -> tuple[float | None, int, int]:
    """sum(cached_tokens) / sum(prompt_tokens) over successful requests whose usage reported cached_tokens."""
    counts = [
        (r.cached_tokens, r.prompt_tokens)
        for r in results
        if r.success and r.cached_tokens is not None and r.prompt_tokens
    ]
    cached = sum(c for c, _ in counts)
    prompt = sum(p for _, p in counts)
    return (cached / prompt if prompt else None), cached, prompt


def oracle_hits(
    prompts: Sequence[Sequence[int]], block_size: int = 16, cached: Sequence[Sequence[int]] | None = None
) -> list[int]:
    """Per prompt, in order: tokens an ideal, unbounded prefix cache would serve from earlier prompts.

    That is the longest common prefix with any earlier prompt, in whole blocks, of the first len - 1 tokens (the
    last prompt token is always computed, as in the engine and vLLM). A trie of blocks makes it exact and linear.
    `cached[i]`, when given, is what request i leaves in the cache instead of its prompt: prompt + output tokens
    for a cache that also keeps decoded blocks (the bundled engine, vLLM), which multi-turn conversations reuse.
    """
    trie: dict[tuple[int, tuple[int, ...]], int] = {}
    hits = []
    for i, tokens in enumerate(prompts):
        full = max(len(tokens) - 1, 0) // block_size
        node, hit = 0, 0
        for b in range(full):
            child = trie.get((node, tuple(tokens[b * block_size : (b + 1) * block_size])))
            if child is None:
                break
            hit, node = hit + block_size, child
        hits.append(hit)
        stored = tokens if cached is None else cached[i]
        node = 0
        for b in range(len(stored) // block_size):
            key = (node, tuple(stored[b * block_size : (b + 1) * block_size]))
            node = trie.get(key) or trie.setdefault(key, len(trie) + 1)
    return hits


def oracle_hit_rate(prompts: Sequence[Sequence[int]], block_size: int = 16) -> float | None:
    total = sum(len(p) for p in prompts)
    return sum(oracle_hits(prompts, block_size)) / total if total else None
