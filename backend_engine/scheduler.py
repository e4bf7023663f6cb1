"""Continuous batching: which sequences run this step, and how many tokens each.

A step has a token budget. Running sequences go first, decodes (one token each) before prefill
chunks, so a long prompt never stalls the streams already generating; the prompt is cut into
chunks that fit what is left, and, in a step that carries decodes, into no more than the
caller's prefill cap: every prompt token computed in that step delays those streams' next token.
Waiting sequences are then admitted in arrival order (FCFS: the
head of the queue is never overtaken), taking any prefix-cache hits. When blocks run out, the
newest running sequence is preempted: its blocks are freed and it re-enters the front of the
waiting queue to be recomputed (its own blocks usually survive in the prefix cache).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from backend_engine.block_manager import BlockManager
from backend_engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    items: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, new tokens)
    num_preempted: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, prefill_cap: int | None = None) -> ScheduledBatch:
        """This step's batch. `prefill_cap`: the most prompt tokens a step that carries decodes may compute
        (None: what the token budget leaves)."""
        out = ScheduledBatch()
        budget = self.max_num_batched_tokens
        # 1. running: decodes first, then unfinished prefills, each in arrival order
        order = sorted(self.running, key=lambda s: s.num_tokens - s.num_computed_tokens > 1)
        decodes = bool(order) and order[0].num_tokens - order[0].num_computed_tokens == 1
        prefill_left = min(budget, prefill_cap) if decodes and prefill_cap is not None else budget
        for seq in order:
            todo = seq.num_tokens - seq.num_computed_tokens
            if budget <= 0 or todo > 1 and prefill_left <= 0:
                break
            if seq.status != SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = 1 if todo == 1 else min(todo, budget, prefill_left)
            while not self.bm.ensure_slots(seq, seq.num_computed_tokens + n):
                victim = self.running[-1]
                for j, (s, k) in enumerate(out.items):
                    if s is victim:  # already scheduled this step (decodes go first): unschedule
                        del out.items[j]
                        budget += k
                        if k > 1:  # a prompt chunk: its tokens go back to the prefill allowance too
                            prefill_left += k
                        break
                self._preempt(victim)
                out.num_preempted += 1
                if victim is seq:
                    break
            if seq.status == SequenceStatus.RUNNING:
                out.items.append((seq, n))
                budget -= n
                if todo > 1:
                    prefill_left -= n
        # 2. waiting: FCFS admission, unless this step had to preempt
        while (
            self.waiting
            and min(budget, prefill_left) > 0
            and len(self.running) < self.max_num_seqs
            and not out.num_preempted
        ):
            seq = self.waiting[0]
            hits = self.bm.match_prefix(seq)
            cached = len(hits) * self.bm.block_size
            n = min(seq.num_tokens - cached, budget, prefill_left)
            need = self.bm.blocks_needed(cached + n) - len(hits)
            if need > self.bm.free_after_hits(hits):
                break
            self.waiting.popleft()
            self.bm.allocate_prefix(seq, hits)
            ok = self.bm.ensure_slots(seq, cached + n)
            assert ok, "free-block check and allocation disagree"
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            self.running.append(seq)
            out.items.append((seq, n))
            budget -= n
            prefill_left -= n
        return out

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free_sequence(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence from whichever queue holds it and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
            self.bm.free_sequence(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
