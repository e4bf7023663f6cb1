"""Run one benchmark: dispatch the plan (concurrency cap and/or Poisson arrivals), collect, summarize."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import functools
import hashlib
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from gateway.bench.client import chat_url, stream_chat
from gateway.bench.metrics import RequestResult, measured_hit_rate, oracle_hits, summarize
from gateway.bench.workload import PlannedRequest, WorkloadSpec, build_plan


@dataclass(frozen=True)
class BenchConfig(WorkloadSpec):
    """A whole run: the workload (WorkloadSpec's fields) plus target, load shape, SLOs and reporting.

    Vary one field for another run with dataclasses.replace(config, base_url=..., name=...): the plan, and so the
    request sequence, stays the same as long as the workload fields and the seed do.
    """

    base_url: str = "http://127.0.0.1:8080"
    model: str | None = None  # None: the first id from GET /v1/models
    name: str = "run"
    concurrency: int | None = 16  # max requests in flight; None: unbounded (with a request_rate)
    output_len: int = 32  # max_tokens per request
    temperature: float = 0.0
    ignore_eos: bool = False  # send ignore_eos (vLLM / the bundled engine) so every output is full
    api_keys: tuple[str, ...] = ()  # tenant i sends Bearer api_keys[i % len]; () sends none
    extra_body: dict[str, Any] = field(default_factory=dict)  # merged into every request body
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    max_duration_s: float | None = None  # hard cap: stop dispatching and cancel what is in flight
    request_timeout_s: float = 600.0
    tokenizer: str | None = None  # "bundled" or a tokenizer.json path, for the oracle hit rate
    block_size: int = 16  # oracle granularity (the engine's KV block size)
    keep_requests: bool = True  # per-request rows in the result
    reset_prefix_cache: tuple[str, ...] = ()  # engine base URLs to POST /reset_prefix_cache to before the run

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        if self.concurrency is None and self.request_rate is None:
            raise ValueError("give a concurrency, a request_rate, or both")
        if self.output_len < 1:
            raise ValueError("output_len must be >= 1")
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")

    def workload_spec(self) -> WorkloadSpec:
        names = {f.name for f in dataclasses.fields(WorkloadSpec)}
        return WorkloadSpec(**{k: v for k, v in dataclasses.asdict(self).items() if k in names})


def plan_fingerprint(plan: list[PlannedRequest]) -> str:
    """sha256 over everything the plan fixes; equal fingerprints mean the same request sequence."""
    h = hashlib.sha256()
    for p in plan:
        h.update(f"{p.index}|{p.arrival_s:.9f}|{p.tenant}|{p.conversation}|{p.turn}|".encode())
        h.update((p.system or "").encode() + b"|" + p.user.encode() + b"\n")
    return h.hexdigest()


def conversation_messages(
    plan_by_turn: dict[tuple[int, int], PlannedRequest], replies: dict[tuple[int, int], str], p: PlannedRequest
) -> list[dict[str, str]]:
    """system + every earlier turn (user, the reply actually returned) + this turn's user message."""
    messages = [{"role": "system", "content": p.system}] if p.system is not None else []
    for t in range(p.turn):
        messages.append({"role": "user", "content": plan_by_turn[(p.conversation, t)].user})
        messages.append({"role": "assistant", "content": replies.get((p.conversation, t), "")})
    messages.append({"role": "user", "content": p.user})
    return messages


@functools.lru_cache(maxsize=4)
def _tokenizer(spec: str):
    from gateway.bench.tokenize import load_tokenizer

    return load_tokenizer(spec)


async def _first_model(client: httpx.AsyncClient, url: str, headers: dict[str, str]) -> str:
    models_url = url.removesuffix("/chat/completions") + "/models"
    resp = await client.get(models_url, headers=headers)
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


async def _reset_prefix_cache(client: httpx.AsyncClient, engine_url: str) -> str:
    """Empty an engine's prefix cache (the bundled engine and vLLM serve POST /reset_prefix_cache): "ok" or why not."""
    try:
        resp = await client.post(engine_url.rstrip("/").removesuffix("/v1") + "/reset_prefix_cache", timeout=30.0)
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}"[:200]
    return "ok" if resp.status_code < 300 else f"HTTP {resp.status_code}: {resp.text[:150]}"


async def run_benchmark_async(config: BenchConfig, *, transport: httpx.AsyncBaseTransport | None = None) -> dict:
    """run_benchmark inside a running event loop; `transport` replaces the network (tests)."""
    plan = build_plan(config.workload_spec())
    plan_by_turn = {(p.conversation, p.turn): p for p in plan}
    url = chat_url(config.base_url)
    keys = config.api_keys

    def headers_for(tenant: int) -> dict[str, str]:
        return {"authorization": f"Bearer {keys[tenant % len(keys)]}"} if keys else {}

    results: dict[int, RequestResult] = {}
    sent_messages: dict[int, list[dict[str, str]]] = {}
    replies: dict[tuple[int, int], str] = {}
    finished = {key: asyncio.Event() for key in plan_by_turn}
    sem = asyncio.Semaphore(config.concurrency) if config.concurrency else None
    limit = config.concurrency or min(len(plan), 1000)
    timeout = httpx.Timeout(config.request_timeout_s, connect=min(30.0, config.request_timeout_s))
    started_at = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")

    async with httpx.AsyncClient(
        timeout=timeout,
        trust_env=False,
        transport=transport,
        limits=httpx.Limits(max_connections=limit, max_keepalive_connections=limit),
    ) as client:
        resets = {engine: await _reset_prefix_cache(client, engine) for engine in config.reset_prefix_cache}
        model = config.model or await _first_model(client, url, headers_for(0))
        t0 = time.perf_counter()
        deadline = t0 + config.max_duration_s if config.max_duration_s else None

        async def one(p: PlannedRequest) -> None:
            key = (p.conversation, p.turn)
            result = results[p.index] = RequestResult(p.index, p.tenant, p.conversation, p.turn)
            try:
                if p.turn:
                    await finished[(p.conversation, p.turn - 1)].wait()
                messages = sent_messages[p.index] = conversation_messages(plan_by_turn, replies, p)
                body = {
                    **config.extra_body,
                    "model": model,
                    "messages": messages,
                    "max_tokens": config.output_len,
                    "temperature": config.temperature,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                if config.ignore_eos:
                    body["ignore_eos"] = True
                await stream_chat(client, url, body, headers_for(p.tenant), result, t0)
            except asyncio.CancelledError:
                result.cancelled = True
                result.error = result.error or "cancelled at --max-duration"
                raise
            except Exception as exc:  # one request's bug must not end the run
                result.error = f"{type(exc).__name__}: {exc}"[:200]
            finally:
                replies[key] = result.text
                finished[key].set()
                if sem:
                    sem.release()

        tasks: list[asyncio.Task] = []
        for p in plan:
            if deadline and t0 + p.arrival_s >= deadline:
                break
            delay = t0 + p.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if sem:
                try:
                    remaining = deadline - time.perf_counter() if deadline else None
                    await asyncio.wait_for(sem.acquire(), remaining)
                except TimeoutError:
                    break
            tasks.append(asyncio.create_task(one(p)))
        if tasks:
            remaining = max(0.0, deadline - time.perf_counter()) if deadline else None
            _, pending = await asyncio.wait(tasks, timeout=remaining)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        duration = time.perf_counter() - t0

    ordered = [results[i] for i in sorted(results)]
    summary = summarize(ordered, duration, config.slo_ttft_ms, config.slo_tpot_ms)
    result = {
        "name": config.name,
        "base_url": config.base_url,
        "model": model,
        "started_at": started_at,
        "config": {
            k: (list(v) if isinstance(v, tuple) else v)
            for k, v in dataclasses.asdict(config).items()
            if k != "api_keys"
        }
        | {"api_keys": len(config.api_keys)},
        "reset_prefix_cache": resets or None,
        "plan": {"num_requests": len(plan), "sent": len(results), "fingerprint": plan_fingerprint(plan)},
        **summary,
        "prefix_cache": _prefix_cache(config, ordered, sent_messages),
    }
    if config.keep_requests:
        result["requests"] = [r.to_json() for r in ordered]
    return result


def _prefix_cache(
    config: BenchConfig, ordered: list[RequestResult], sent_messages: dict[int, list[dict[str, str]]]
) -> dict:
    measured, cached, prompt = measured_hit_rate(ordered)
    out = {
        "measured_hit_rate": measured,
        "cached_tokens": cached,
        "prompt_tokens": prompt,
        "oracle_hit_rate": None,
        "oracle_cached_tokens": None,
        "oracle_prompt_tokens": None,
        "oracle_hit_rate_with_outputs": None,
        "tokenizer": config.tokenizer,
        "block_size": config.block_size,
    }
    if config.tokenizer:
        ok = sorted((r for r in ordered if r.success), key=lambda r: r.start_s)
        tok = _tokenizer(config.tokenizer)
        prompts = [tok.encode(sent_messages[r.index]) for r in ok]
        hits = oracle_hits(prompts, config.block_size)
        for r, prompt, hit in zip(ok, prompts, hits):
            r.oracle_prompt_tokens, r.oracle_cached_tokens = len(prompt), hit
        total = sum(len(p) for p in prompts)
        with_outputs = oracle_hits(
            prompts, config.block_size, cached=[p + tok.encode_text(r.text) for p, r in zip(prompts, ok)]
        )
        out.update(
            oracle_hit_rate=sum(hits) / total if total else None,
            oracle_cached_tokens=sum(hits),
            oracle_prompt_tokens=total,
            oracle_hit_rate_with_outputs=sum(with_outputs) / total if total else None,
        )
    return out


def run_benchmark(config: BenchConfig) -> dict:
    """Run one benchmark to completion and return its JSON-ready result (see gateway/bench/__init__.py)."""
    return asyncio.run(run_benchmark_async(config))
