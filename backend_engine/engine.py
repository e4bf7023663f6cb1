"""The engine: add_request / step, and the background thread that serves asyncio callers.

`LLMEngine` is synchronous and single-threaded: each `step()` schedules a batch, runs one forward
pass over it, samples, applies stop conditions and returns the new output of every sequence that
produced some. `AsyncEngine` runs that loop in a thread and streams each request's outputs into
its own asyncio queue, so HTTP handlers never touch engine state.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from backend_engine import tracing
from backend_engine.backend import ArrayBackend, select_backend, set_blas_threads
from backend_engine.block_manager import BlockManager
from backend_engine.config import EngineConfig
from backend_engine.metrics import EngineMetrics
from backend_engine.model import LoadedModel, load_model
from backend_engine.model.int8_matmul import configure_threads
from backend_engine.model.llama import ForwardBatch, PrefillSpan
from backend_engine.sampling import sample_token, token_logprob
from backend_engine.scheduler import Scheduler
from backend_engine.sequence import SamplingParams, Sequence, SequenceStatus, TokenLogprob

log = logging.getLogger("portcullis.engine")


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0


@dataclass
class MemoryBudget:
    weights_bytes: int
    runtime_bytes: int
    kv_cache_bytes: int
    num_blocks: int
    block_size: int

    @property
    def kv_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def describe(self) -> str:
        mib = 1 << 20
        return (
            f"memory budget: weights {self.weights_bytes / mib:.1f} MiB, runtime overhead "
            f"{self.runtime_bytes / mib:.1f} MiB, KV cache {self.kv_cache_bytes / mib:.1f} MiB = "
            f"{self.num_blocks} blocks x {self.block_size} tokens = {self.kv_tokens} tokens"
        )


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None, backend: ArrayBackend | None = None):
        self.config = config
        if config.threads:
            set_blas_threads(config.threads)
        if config.compute == "int8":
            configure_threads(config.threads)
        self.backend = backend or select_backend(config.device)
        self.loaded = loaded or load_model(config.resolved_model(), self.backend, config.compute)
        self.model = self.loaded.model
        self.tokenizer = self.loaded.tokenizer
        mc = self.loaded.config
        self.budget = self._plan_memory()
        self.kv_cache = self.model.allocate_kv_cache(self.budget.num_blocks, config.block_size)
        self.block_manager = BlockManager(self.budget.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        # A sequence must always fit the KV cache on its own, or preemption could never make room for it.
        self.max_model_len = min(mc.max_position, config.max_model_len or mc.max_position, self.budget.kv_tokens)
        self.metrics = EngineMetrics(config.served_model_name)
        self.metrics.set_budget(
            self.budget.weights_bytes,
            self.budget.runtime_bytes,
            self.budget.kv_cache_bytes,
            self.budget.kv_tokens,
            self.budget.num_blocks,
            config.block_size,
        )
        self.kv_event_sink: Callable[[list[dict[str, Any]]], None] | None = None
        self.rng = np.random.default_rng(config.seed)
        self._seq_ids = itertools.count()
        self._by_request: dict[str, Sequence] = {}
        self._counted = (0, 0)
        log.info(
            "loaded %s in %.1fs on %s; %s",
            self.loaded.source,
            self.loaded.load_seconds,
            self.backend.device,
            self.budget.describe(),
        )

    # --- memory ---------------------------------------------------------------------------------

    def _plan_memory(self) -> MemoryBudget:
        c, cfg = self.loaded.config, self.config
        weights = self.model.weight_bytes()
        T = cfg.max_num_batched_tokens
        qkv = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        per_token = 4 * (4 * c.hidden_size + 2 * qkv + 3 * c.intermediate_size)
        attn_scores = 4 * 2 * c.num_heads * T * min(c.max_position, 8192)
        logits = 4 * 2 * cfg.max_num_seqs * c.vocab_size
        rope = 2 * 4 * c.max_position * c.head_dim // 2
        runtime = per_token * T + attn_scores + logits + rope
        per_block = self.model.kv_bytes_per_token() * cfg.block_size
        if cfg.kv_cache_bytes is not None:
            kv = cfg.kv_cache_bytes
        elif self.backend.device == "cuda":
            kv = int((self.backend.free_memory_bytes() - runtime) * cfg.kv_cache_memory_fraction)
        else:
            kv = min(cfg.cpu_default_kv_cache_bytes, max(self.backend.free_memory_bytes() // 4, per_block))
        num_blocks = kv // per_block
        if num_blocks < 1:
            raise ValueError(f"KV cache budget {kv} bytes is smaller than one block ({per_block} bytes)")
        return MemoryBudget(weights, runtime, num_blocks * per_block, int(num_blocks), cfg.block_size)

    # --- requests -------------------------------------------------------------------------------

    def validate(self, prompt_token_ids: Seq[int], params: SamplingParams) -> None:
        """Raise ValueError (HTTP 400) for a request the engine can never serve."""
        params.validate(self.config.max_logprobs)
        if not prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        vs = self.loaded.config.vocab_size
        if any((not isinstance(t, int)) or t < 0 or t >= vs for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vs})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt is {len(prompt_token_ids)} tokens; this engine's limit is "
                f"{self.max_model_len - 1} (max_model_len {self.max_model_len}, "
                f"KV cache {self.budget.kv_tokens} tokens)"
            )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Seq[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        trace_context: Any = None,
    ) -> Sequence:
        self.validate(prompt_token_ids, params)
        if request_id in self._by_request:
            raise ValueError(f"duplicate request id {request_id}")
        seq = Sequence(
            next(self._seq_ids),
            request_id,
            list(prompt_token_ids),
            params,
            cache_salt=cache_salt,
            trace_context=trace_context,
        )
        seq.rng = np.random.default_rng(params.seed) if params.seed is not None else self.rng
        seq.detokenizer = self.tokenizer.detokenizer(params.skip_special_tokens)
        self._by_request[request_id] = seq
        self.scheduler.add(seq)
        self.metrics.labels(self.metrics.prompt_tokens).inc(seq.num_prompt_tokens)
        return seq

    def abort(self, request_id: str) -> bool:
        """Stop a request now (client went away) and free its blocks."""
        seq = self._by_request.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.finish(seq)
        seq.finish_reason = "abort"
        seq.finished_time = time.monotonic()
        self.metrics.request_success.labels(model_name=self.config.served_model_name, finished_reason="abort").inc()
        self._update_gauges()
        self._publish_events()
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def reset_prefix_cache(self) -> bool:
        ok = self.block_manager.reset_prefix_cache()
        self._publish_events()
        return ok

    # --- the step -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        if sched.num_preempted:
            self.metrics.labels(self.metrics.preemptions).inc(sched.num_preempted)
        outputs: list[RequestOutput] = []
        if sched.items:
            items = [it for it in sched.items if it[1] == 1] + [it for it in sched.items if it[1] > 1]
            fb, sample_rows = self._build_batch(items)
            t0 = time.perf_counter()
            logits = self.backend.to_numpy(self.model.forward(fb, self.kv_cache))
            dt = time.perf_counter() - t0
            now = time.monotonic()
            for (seq, n), row in zip(items, sample_rows):
                seq.num_computed_tokens += n
                self.block_manager.commit_computed(seq)
                if seq.first_token_time is None:
                    seq.prefill_compute_s += dt
                if row is not None:
                    out = self._append_token(seq, logits[row], now)
                    if out is not None:
                        outputs.append(out)
        self._update_gauges()
        self._publish_events()
        return outputs

    def _build_batch(self, items: list[tuple[Sequence, int]]) -> tuple[ForwardBatch, list[int | None]]:
        bs = self.config.block_size
        ids, pos, slots = [], [], []
        decodes, prefills, rows, sample_rows = [], [], [], []
        for seq, n in items:
            start = len(ids)
            nc = seq.num_computed_tokens
            p = np.arange(nc, nc + n)
            bt = np.asarray(seq.block_table, dtype=np.int64)
            ids.extend(seq.token_ids[nc : nc + n])
            pos.append(p)
            slots.append(bt[p // bs] * bs + p % bs)
            if n == 1:
                decodes.append(seq)
            else:
                prefills.append(PrefillSpan(start, n, nc + n, bt))
            if nc + n == seq.num_tokens:
                sample_rows.append(len(rows))
                rows.append(start + n - 1)
            else:
                sample_rows.append(None)
        D = len(decodes)
        width = max((len(s.block_table) for s in decodes), default=1)
        tables = np.zeros((D, width), dtype=np.int64)
        for i, s in enumerate(decodes):
            tables[i, : len(s.block_table)] = s.block_table
        fb = ForwardBatch(
            input_ids=np.asarray(ids, dtype=np.int64),
            positions=np.concatenate(pos),
            slot_mapping=np.concatenate(slots),
            num_decodes=D,
            decode_block_tables=tables,
            decode_context_lens=np.array([s.num_computed_tokens + 1 for s in decodes], dtype=np.int64),
            prefills=prefills,
            logits_indices=np.asarray(rows, dtype=np.int64),
        )
        return fb, sample_rows

    def _append_token(self, seq: Sequence, logits: np.ndarray, now: float) -> RequestOutput | None:
        p = seq.params
        tok = sample_token(logits, p, seq.rng)
        lp = [token_logprob(logits, tok, p.logprobs)] if p.logprobs is not None else []
        seq.token_ids.append(tok)
        m = self.metrics
        m.labels(m.generation_tokens).inc()
        if seq.first_token_time is None:
            seq.first_token_time = now
            m.labels(m.ttft).observe(now - seq.arrival_time)
            if seq.first_scheduled_time is not None:
                m.labels(m.queue_time).observe(seq.first_scheduled_time - seq.arrival_time)
        elif seq.last_token_time is not None:
            m.labels(m.itl).observe(now - seq.last_token_time)
            m.labels(m.tpot).observe(now - seq.last_token_time)
        seq.last_token_time = now

        # stop conditions, in OpenAI/vLLM precedence
        reason: str | None = None
        if tok in self.tokenizer.eos_ids and not p.ignore_eos:
            reason, seq.stop_reason = "stop", None
        elif tok in p.stop_token_ids:
            reason, seq.stop_reason = "stop", tok
        else:
            before = len(seq.output_text)
            seq.output_text += seq.detokenizer.push(tok)
            if p.stop:
                hit = self._find_stop(seq.output_text, before, p.stop)
                if hit is not None:
                    idx, s = hit
                    seq.output_text = seq.output_text[: idx + (len(s) if p.include_stop_str_in_output else 0)]
                    reason, seq.stop_reason = "stop", s
        if reason is None and (seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len):
            reason = "length"
        if reason is not None and not isinstance(seq.stop_reason, str):
            seq.output_text += seq.detokenizer.flush()  # a dangling partial character becomes U+FFFD

        if reason is not None:
            self._finish(seq, reason, now)
            emit_to = len(seq.output_text)
        else:
            hold = max((len(s) for s in p.stop), default=1) - 1
            emit_to = max(seq.emitted_chars, len(seq.output_text) - hold)
        text = seq.output_text[seq.emitted_chars : emit_to]
        seq.emitted_chars = max(seq.emitted_chars, emit_to)
        return RequestOutput(
            seq.request_id,
            [tok],
            text,
            lp,
            reason is not None,
            reason,
            seq.stop_reason,
            seq.num_prompt_tokens,
            seq.num_output_tokens,
            max(seq.num_cached_tokens, 0),
        )

    @staticmethod
    def _find_stop(text: str, new_from: int, stops: list[str]) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for s in stops:
            if not s:
                continue
            i = text.find(s, max(0, new_from - len(s) + 1))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        return best

    def _finish(self, seq: Sequence, reason: str, now: float) -> None:
        seq.finish_reason = reason
        seq.finished_time = now
        self.scheduler.finish(seq)
        self._by_request.pop(seq.request_id, None)
        m = self.metrics
        m.request_success.labels(model_name=self.config.served_model_name, finished_reason=reason).inc()
        m.labels(m.e2e).observe(now - seq.arrival_time)
        try:
            tracing.record_request(seq, self.config.served_model_name)
        except Exception:  # telemetry must never fail a request
            log.exception("tracing failed")

    def _update_gauges(self) -> None:
        m, bm = self.metrics, self.block_manager
        m.labels(m.num_running).set(len(self.scheduler.running))
        m.labels(m.num_waiting).set(len(self.scheduler.waiting))
        m.labels(m.kv_usage).set(bm.usage())
        m.labels(m.gpu_kv_usage).set(bm.usage())
        q, h = bm.prefix_queries, bm.prefix_hits
        if (q, h) != self._counted:
            m.labels(m.prefix_queries).inc(q - self._counted[0])
            m.labels(m.prefix_hits).inc(h - self._counted[1])
            self._counted = (q, h)

    def _publish_events(self) -> None:
        ev = self.block_manager.drain_events()
        if ev and self.kv_event_sink is not None:
            self.kv_event_sink(ev)

    # --- convenience for tests and benchmarks ------------------------------------------------------

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams], cache_salt: str | None = None
    ) -> list[Sequence]:
        """Run prompts to completion together (continuous batching); returns finished sequences."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        base = next(self._seq_ids)
        seqs = [self.add_request(f"gen-{base}-{i}", p, sp, cache_salt) for i, (p, sp) in enumerate(zip(prompts, plist))]
        while any(s.status != SequenceStatus.FINISHED for s in seqs):
            self.step()
        return seqs


class AsyncEngine:
    """Runs LLMEngine.step in a background thread; each request streams through an asyncio queue."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: deque[tuple] = deque()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = False
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()
        self.last_error: str | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="engine-step", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread:
            self._thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _submit(self, cmd: tuple) -> None:
        self._commands.append(cmd)
        self._wake.set()

    def reset_prefix_cache(self) -> None:
        self._submit(("reset",))

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        cache_salt: str | None = None,
        trace_context: Any = None,
    ) -> AsyncIterator[RequestOutput]:
        """Validate now (raises ValueError), then yield outputs until the request finishes.

        Closing the iterator early (client disconnect) aborts the sequence and frees its blocks."""
        self.engine.validate(prompt_token_ids, params)
        rid = request_id or f"req-{next(self._ids)}"
        q: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = (asyncio.get_running_loop(), q)
        self._submit(("add", rid, list(prompt_token_ids), params, cache_salt, trace_context))
        finished = False
        try:
            while True:
                out = await q.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self._streams.pop(rid, None)
            if not finished:
                self._submit(("abort", rid))

    def _deliver(self, rid: str, item: Any) -> None:
        target = self._streams.get(rid)
        if target is not None:
            loop, q = target
            try:
                loop.call_soon_threadsafe(q.put_nowait, item)
            except RuntimeError:
                pass

    def _loop(self) -> None:
        eng = self.engine
        while not self._stop:
            while self._commands:
                cmd = self._commands.popleft()
                if cmd[0] == "add":
                    _, rid, ids, params, salt, ctx = cmd
                    if rid not in self._streams:
                        continue  # caller already gone
                    try:
                        eng.add_request(rid, ids, params, salt, ctx)
                    except Exception as e:  # noqa: BLE001 - delivered to the caller
                        self._deliver(rid, e)
                elif cmd[0] == "abort":
                    eng.abort(cmd[1])
                elif cmd[0] == "reset":
                    eng.reset_prefix_cache()
            if not eng.has_unfinished():
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            try:
                outs = eng.step()
            except Exception as e:  # noqa: BLE001 - fail every in-flight request, keep serving
                log.exception("engine step failed")
                self.last_error = repr(e)
                for rid in list(eng._by_request):
                    eng.abort(rid)
                    self._deliver(rid, RuntimeError(f"engine step failed: {e}"))
                continue
            for out in outs:
                self._deliver(out.request_id, out)
