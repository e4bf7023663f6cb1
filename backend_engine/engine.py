"""The engine: add_request / step.

`LLMEngine` is synchronous and single-threaded: each `step()` schedules a batch, runs one forward
pass over it, samples, applies stop conditions and returns the new output of every sequence that
produced some. `async_engine.AsyncEngine` runs that loop in a thread for asyncio callers.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from backend_engine import tracing
from backend_engine.backend import ArrayBackend, select_backend, set_blas_threads
from backend_engine.batch import build_forward_batch, decodes_first
from backend_engine.block_manager import BlockManager
from backend_engine.config import EngineConfig
from backend_engine.memory import plan_memory
from backend_engine.metrics import EngineMetrics
from backend_engine.model import LoadedModel, load_model
from backend_engine.model.int8_matmul import configure_threads
from backend_engine.sampling import sample_token, token_logprob
from backend_engine.scheduler import Scheduler
from backend_engine.sequence import SamplingParams, Sequence, SequenceStatus, TokenLogprob
from backend_engine.stop import apply_stop_conditions, held_back_chars

log = logging.getLogger("portcullis.engine")

RATE_SAMPLE_TOKENS = 32  # smaller steps measure per-step overhead more than the rate of computing tokens


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


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None, backend: ArrayBackend | None = None):
        self.config = config
        if config.compute == "int8":
            # numpy runs only attention here, in products too small to share between threads, and a second
            # OpenBLAS thread spinning beside onnxruntime's made a 1,000-token prefill take twice the CPU (3.4 s
            # against 1.9-2.2 s) and 25-40 % longer
            set_blas_threads(1)
            configure_threads(config.threads)
        elif config.threads:
            set_blas_threads(config.threads)
        self.backend = backend or select_backend(config.device)
        self.loaded = loaded or load_model(config.resolved_model(), self.backend, config.compute)
        self.model = self.loaded.model
        self.tokenizer = self.loaded.tokenizer
        mc = self.loaded.config
        self.budget = plan_memory(self.model, self.backend, config)
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
        self._token_rate: float | None = None  # tokens a second in steps of RATE_SAMPLE_TOKENS or more
        log.info(
            "loaded %s in %.1fs on %s; %s",
            self.loaded.source,
            self.loaded.load_seconds,
            self.backend.device,
            self.budget.describe(),
        )

    # --- requests -------------------------------------------------------------------------------

    def validate(self, prompt_token_ids: Seq[int], params: SamplingParams) -> None:
        """Raise ValueError (HTTP 400) for a request the engine can never serve."""
        params.validate(self.config.max_logprobs)
        if not prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        vs = self.loaded.config.vocab_size
        if any((not isinstance(t, int)) or t < 0 or t >= vs for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vs})")
        if any(not 0 <= t < vs for t in params.logit_bias):
            raise ValueError(f"logit_bias token ids must be in [0, {vs})")
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

    def abort_all(self) -> list[str]:
        """Abort every request in flight (after a failed step); returns their ids."""
        request_ids = list(self._by_request)
        for request_id in request_ids:
            self.abort(request_id)
        return request_ids

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def reset_prefix_cache(self) -> bool:
        ok = self.block_manager.reset_prefix_cache()
        self._publish_events()
        return ok

    # --- embeddings -----------------------------------------------------------------------------

    def validate_embedding_input(self, token_ids: Seq[int]) -> None:
        """Raise ValueError (HTTP 400) for an input the engine cannot embed."""
        if not token_ids:
            raise ValueError("each input must contain at least one token")
        vs = self.loaded.config.vocab_size
        if any((not isinstance(t, int)) or t < 0 or t >= vs for t in token_ids):
            raise ValueError(f"token ids must be integers in [0, {vs})")
        if len(token_ids) > self.max_model_len:
            raise ValueError(
                f"input is {len(token_ids)} tokens; this engine's limit is {self.max_model_len} (max_model_len)"
            )

    def embedding_groups(self, inputs: list[list[int]]) -> list[list[int]]:
        """Indices of `inputs` in order, grouped for one `embed` call each: at most one step's token budget (or
        one input alone) and at most the blocks of one max_model_len sequence, which the KV cache always holds
        once nothing else runs, so every group is eventually admitted."""
        bm = self.block_manager
        block_limit = bm.blocks_needed(self.max_model_len)
        groups: list[list[int]] = []
        tokens = blocks = 0
        for i, ids in enumerate(inputs):
            need = bm.blocks_needed(len(ids))
            if not groups or tokens + len(ids) > self.config.max_num_batched_tokens or blocks + need > block_limit:
                groups.append([])
                tokens = blocks = 0
            groups[-1].append(i)
            tokens += len(ids)
            blocks += need
        return groups

    def embed(self, inputs: list[list[int]]) -> list[np.ndarray] | None:
        """Each input's final hidden states mean-pooled (float32, on the host), or None, with nothing done, while
        the free KV blocks cannot hold the inputs (the caller retries after a step).

        The inputs are prefilled like prompts, in passes of at most one step's token budget, into scratch blocks
        that are freed, never cached, before this returns."""
        bm = self.block_manager
        if sum(bm.blocks_needed(len(ids)) for ids in inputs) > bm.num_free_blocks:
            return None
        seqs = [Sequence(next(self._seq_ids), "embedding", list(ids), SamplingParams()) for ids in inputs]
        sums: dict[int, Any] = {}
        try:
            for seq in seqs:
                ok = bm.ensure_slots(seq, seq.num_tokens)
                assert ok, "free-block check and allocation disagree"
            pending = deque(seqs)
            while pending:
                items: list[tuple[Sequence, int]] = []
                budget = self.config.max_num_batched_tokens
                while pending and budget > 0:
                    seq = pending[0]
                    n = min(seq.num_tokens - seq.num_computed_tokens, budget)
                    items.append((seq, n))
                    budget -= n
                    if seq.num_computed_tokens + n < seq.num_tokens:
                        break  # the rest of this input is the next pass's first chunk
                    pending.popleft()
                items = decodes_first(items)
                fb, _rows = build_forward_batch(items, self.config.block_size)
                hidden = self.model.final_hidden_states(fb, self.kv_cache)
                start = 0
                for seq, n in items:
                    part = hidden[start : start + n].sum(axis=0)
                    sums[seq.seq_id] = part if seq.seq_id not in sums else sums[seq.seq_id] + part
                    seq.num_computed_tokens += n
                    start += n
        finally:
            for seq in seqs:
                bm.free_sequence(seq)
            self._publish_events()  # taking free blocks may have evicted cached prefixes
        return [self.backend.to_numpy(sums[seq.seq_id]) / np.float32(seq.num_tokens) for seq in seqs]

    # --- the step -------------------------------------------------------------------------------

    def _prefill_cap(self) -> int | None:
        """The prompt tokens a step beside decoding streams may compute: `max_decode_stall` seconds' worth at the
        measured rate, at least a block (None until a step has been measured, or with the stall bound off)."""
        if not self.config.max_decode_stall or self._token_rate is None:
            return None
        return max(self.config.block_size, int(self._token_rate * self.config.max_decode_stall))

    def _measure(self, tokens: int, seconds: float) -> None:
        """The tokens a second this device computes, from steps large enough that per-step overhead does not
        dominate them; a moving average, so a slow step (another process on the cores) moves it only partly."""
        if tokens < RATE_SAMPLE_TOKENS or seconds <= 0:
            return
        rate = tokens / seconds
        self._token_rate = rate if self._token_rate is None else 0.7 * self._token_rate + 0.3 * rate

    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule(self._prefill_cap())
        if sched.num_preempted:
            self.metrics.labels(self.metrics.preemptions).inc(sched.num_preempted)
        outputs: list[RequestOutput] = []
        if sched.items:
            items = decodes_first(sched.items)
            fb, sample_rows = build_forward_batch(items, self.config.block_size)
            t0 = time.perf_counter()
            logits = self.backend.to_numpy(self.model.forward(fb, self.kv_cache))
            dt = time.perf_counter() - t0
            self._measure(sched.num_tokens, dt)
            now = time.monotonic()
            for (seq, n), row in zip(items, sample_rows):
                seq.num_computed_tokens += n
                self.block_manager.commit_computed(seq)
                if seq.first_token_time is None:
                    seq.prefill_compute_s += dt
                if row is not None:
                    outputs.append(self._append_token(seq, logits[row], now))
        self._update_gauges()
        self._publish_events()
        return outputs

    def _append_token(self, seq: Sequence, logits: np.ndarray, now: float) -> RequestOutput:
        """Sample seq's next token, finish seq if a stop condition holds, and return what the client may see."""
        p = seq.params
        assert seq.rng is not None, "add_request gives every sequence a generator"
        tok = sample_token(logits, p, seq.rng)
        lp = [token_logprob(logits, tok, p.logprobs)] if p.logprobs is not None else []
        seq.token_ids.append(tok)
        self._observe_token_latency(seq, now)
        reason = apply_stop_conditions(seq, tok, self.tokenizer.eos_ids, self.max_model_len)
        if reason is not None:
            self._finish(seq, reason, now)
            emit_to = len(seq.output_text)
        else:
            emit_to = max(seq.emitted_chars, len(seq.output_text) - held_back_chars(p))
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

    def _observe_token_latency(self, seq: Sequence, now: float) -> None:
        """Count a generated token: time to first token and queue time, or the gap since the last one."""
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
