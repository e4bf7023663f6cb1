"""One classifier scan of a request's texts through the members' micro-batchers, with a bounded cost.

A scan of a long document is hundreds of windows per member. So that it costs no more than it must, and nothing
that another request needs:
- a window a member reads twice (a repeated passage, a quoted boilerplate) is scored once;
- a member's windows beyond one batch go to its batcher's long-scan lane, which takes turns with short requests'
  batches instead of queueing them behind the whole document (gateway/guard/batcher.py);
- a long text is read first by the ensemble's screening model (a shallow classifier) or by one member, and the
  members read only the spans of the windows it leans malicious on (as soon as it has scored each) and of its few
  highest-scoring ones (gateway/guard/ensemble.py, `Cut`): the blend still takes each member's largest margin, and
  a document costs about one screen's (or member's) reading instead of all the members';
- each window's share of its classifier call's CPU seconds is charged to the scan, and a scan past its budget is
  stopped and refused: the budget bounds what one request can take of the classifier;
- where the caller says at which score a text's finding refuses the request, the scan stops at the first text that
  reaches it: the blend of each member's largest margin so far only grows as more windows are read, so that text is
  refused whatever the rest would score. Findings that serve the request (flag, redact, monitor) need every
  passage's score, so they are scanned whole.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING

import numpy as np

from gateway.errors import GatewayError

if TYPE_CHECKING:  # the model modules load with the first policy that enables the guard
    from gateway.guard.batcher import MicroBatcher
    from gateway.guard.ensemble import Cut, GuardEnsemble, Window

_Key = tuple[int, tuple[int, ...]]  # (member, token ids): one window as a member reads it


class ScanOverBudget(GatewayError):
    """A scan stopped at its budget of classifier CPU time: refused, since serving it would leave part of it unread."""

    def __init__(self, budget: float, scored: int) -> None:
        super().__init__(
            413,
            f"the guard may spend {budget:g} s of classifier CPU time on a request, and this request's scanned text "
            f"used it up after {scored} windows: send less text",
            code="prompt_too_long_to_scan",
            param="guard.injection.cpu_budget",
        )


class _Progress:
    """Each text's largest margin per member so far, each window's margin, the seconds spent, and why it stopped."""

    def __init__(
        self,
        model: GuardEnsemble,
        batchers: list[MicroBatcher],
        cut: Cut,
        budget: float | None,
        blocks: Sequence[float | None],
    ) -> None:
        self.model = model
        self.batchers = batchers
        self.cut = cut
        self.best = np.full((len(cut.texts), len(model.scanners)), -np.inf)
        self.margins: dict[_Key, float] = {}
        self.pending: dict[_Key, list[int]] = {}  # submitted, not scored yet: the texts that hold each
        self.futures: list[asyncio.Future[tuple[float, float]]] = []
        self.left = 0  # windows submitted and not scored yet
        # a deferred text's first-pass windows, by key: the (text, span) each stands for; and the spans read again
        self.first_spans: dict[_Key, list[tuple[int, tuple[int, int]]]] = {}
        for t, windows in cut.deferred.items():
            for k, span in windows:
                self.first_spans.setdefault((cut.first_pass, tuple(cut.items[k][2])), []).append((t, span))
        self.second_read: set[tuple[int, tuple[int, int]]] = set()
        self.spent = 0.0
        self.budget = budget
        self.blocks = blocks
        self.blocked = False
        self.over_budget = False
        self.error: BaseException | None = None
        self.idle = asyncio.Event()  # nothing left to score, or stopped

    @property
    def stopped(self) -> bool:
        return self.blocked or self.over_budget or self.error is not None

    async def read(self, items: Sequence[Window]) -> None:
        """Score these windows (those not scored or pending already), and what they lead to, until none is left or
        the scan stops."""
        self.idle.clear()
        self.submit(items)
        if self.left > 0 and not self.stopped:
            await self.idle.wait()

    def submit(self, items: Sequence[Window]) -> None:
        new: dict[_Key, list[int]] = {}
        for t, m, ids in items:
            key = (m, tuple(ids))
            if key in self.margins:
                self._take(self.margins[key], m, [t])
            else:
                (self.pending.get(key) or new.setdefault(key, [])).append(t)
        self.pending.update(new)
        self.left += len(new)
        for m, batcher in enumerate(self.batchers):
            keys = [key for key in new if key[0] == m]
            submitted = batcher.submit([list(ids) for _, ids in keys], long=len(keys) > batcher.max_batch)
            for key, future in zip(keys, submitted):
                future.add_done_callback(partial(self._scored, key))
            self.futures += submitted

    def read_again(self, t: int, span: tuple[int, int]) -> None:
        """The windows of the members other than the first pass over one first-pass window's span of text `t`,
        once."""
        if (t, span) not in self.second_read:
            self.second_read.add((t, span))
            self.submit(self.model.second_pass(self.cut, t, span))

    def _scored(self, key: _Key, future: asyncio.Future[tuple[float, float]]) -> None:
        if future.cancelled() or self.stopped:
            return
        if future.exception() is not None:
            self.error = future.exception()
            self.idle.set()
            return
        margin, seconds = future.result()
        self.margins[key] = margin
        self.spent += seconds
        self.left -= 1
        self._take(margin, key[0], self.pending.pop(key))
        if key in self.first_spans and margin > self.model.second_pass_rule[1]:
            for t, span in self.first_spans[key]:  # the first pass leans malicious: the members read its span now
                self.read_again(t, span)
        if self.budget is not None and self.spent > self.budget and self.left > 0:
            self.over_budget = True
        if self.left == 0 or self.stopped:
            self.idle.set()

    def _take(self, margin: float, member: int, texts: list[int]) -> None:
        for t in texts:
            if margin <= self.best[t, member]:
                continue
            self.best[t, member] = margin
            block_at = self.blocks[t] if self.blocks else None
            if block_at is not None and float(self.model.calibrated(self.best[t], self.cut.weights[t])) >= block_at:
                self.blocked = True

    def top_spans(self, t: int) -> list[tuple[int, int]]:
        """The character spans of text `t`'s highest-scoring first-pass windows."""
        key = self.cut.first_pass

        def margin(window: tuple[int, tuple[int, int]]) -> float:
            return self.margins[(key, tuple(self.cut.items[window[0]][2]))]

        top = self.model.second_pass_rule[0]
        return [span for _, span in sorted(self.cut.deferred[t], key=margin, reverse=True)[:top]]


async def scan(
    model: GuardEnsemble,
    batchers: list[MicroBatcher],
    cut: Cut,
    budget: float | None = None,
    blocks: Sequence[float | None] = (),
) -> tuple[list[float], list[bool]]:
    """Each text's score from these windows, and whether it is the text's whole score (every window it needs read).
    `budget`: classifier CPU seconds the scan may spend (ScanOverBudget past it). `blocks`: for each text, the score
    at which its finding refuses the request (None where it does not); at the first text to reach it the scan stops,
    and the scores of the texts not read whole are lower bounds (0 for a text some member has not read yet)."""
    progress = _Progress(model, batchers, cut, budget, blocks)
    second_pass_done = False
    try:
        await progress.read(cut.items)
        if cut.deferred and not progress.stopped:  # the first pass is read: its top windows, by every member
            progress.idle.clear()
            for t in cut.deferred:
                for span in progress.top_spans(t):
                    progress.read_again(t, span)
            if progress.left > 0 and not progress.stopped:
                await progress.idle.wait()
            second_pass_done = not progress.stopped
    finally:  # stopped early, or the request went away: windows not yet taken into a call are dropped
        for future in progress.futures:
            future.cancel()
    if progress.error is not None:
        raise progress.error
    if progress.over_budget:
        raise ScanOverBudget(budget or 0.0, len(progress.margins))
    if not progress.blocked and not model.read_by_every_member(progress.best):
        raise ValueError("a text without a window or a score from every member of the guard")
    unread = {t for texts in progress.pending.values() for t in texts}
    unread |= set() if second_pass_done else set(cut.deferred)
    scores = [float(s) for s in model.calibrated(progress.best, cut.weights)]
    return scores, [t not in unread for t in range(len(cut.texts))]
