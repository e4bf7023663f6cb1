"""One classifier scan of a request's texts through the members' micro-batchers, with a bounded cost.

A scan of a long document is hundreds of windows per member. So that it costs no more than it must, and nothing
that another request needs:
- a window a member reads twice (a repeated passage, a quoted boilerplate) is scored once;
- a member's windows beyond one batch go to its batcher's long-scan lane, which takes turns with short requests'
  batches instead of queueing them behind the whole document (gateway/guard/batcher.py);
- each window's share of its classifier call's seconds is charged to the scan, and a scan past its budget is
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
    from gateway.guard.ensemble import GuardEnsemble, Window


class ScanOverBudget(GatewayError):
    """A scan stopped at its budget of classifier time: refused, since serving it would leave part of it unread."""

    def __init__(self, budget: float, scored: int, windows: int) -> None:
        super().__init__(
            413,
            f"the guard may spend {budget:g} s of classifier time on a request, and this request's scanned text "
            f"used it up after {scored} of its {windows} windows: send less text",
            code="prompt_too_long_to_scan",
            param="guard.injection.cpu_budget",
        )


class _Progress:
    """Each text's largest margin per member so far, the seconds spent, and when the scan is over."""

    def __init__(
        self, model: GuardEnsemble, texts: int, windows: int, budget: float | None, blocks: Sequence[float | None]
    ) -> None:
        self.model = model
        self.best = np.full((texts, len(model.members)), -np.inf)
        self.windows = windows
        self.left = windows
        self.spent = 0.0
        self.budget = budget
        self.blocks = blocks
        self.blocked = False
        self.error: BaseException | None = None
        self.over = asyncio.Event()

    @property
    def over_budget(self) -> bool:
        return self.budget is not None and self.spent > self.budget and self.left > 0

    def scored(self, readers: list[int], member: int, future: asyncio.Future[tuple[float, float]]) -> None:
        """One window's score, for the texts that hold it."""
        if future.cancelled() or self.over.is_set():
            return
        if future.exception() is not None:
            self.error = future.exception()
            self.over.set()
            return
        margin, seconds = future.result()
        self.spent += seconds
        self.left -= 1
        for t in readers:
            if margin <= self.best[t, member]:
                continue
            self.best[t, member] = margin
            block_at = self.blocks[t] if self.blocks else None
            if block_at is not None and float(self.model.calibrated(self.best[t])) >= block_at:
                self.blocked = True
        if self.left == 0 or self.blocked or self.over_budget:
            self.over.set()


async def scan(
    model: GuardEnsemble,
    batchers: list[MicroBatcher],
    texts: int,
    items: list[Window],
    budget: float | None = None,
    blocks: Sequence[float | None] = (),
) -> list[float]:
    """Each text's score from these windows. `budget`: classifier seconds the scan may spend (ScanOverBudget past
    it). `blocks`: for each text, the score at which its finding refuses the request (None where it does not); at
    the first text to reach it the scan stops, and the scores are lower bounds (0 for a text some member has not
    read yet)."""
    readers: dict[tuple[int, tuple[int, ...]], list[int]] = {}
    for t, m, ids in items:
        readers.setdefault((m, tuple(ids)), []).append(t)
    progress = _Progress(model, texts, len(readers), budget, blocks)
    futures: list[asyncio.Future[tuple[float, float]]] = []
    for m, batcher in enumerate(batchers):
        keys = [key for key in readers if key[0] == m]
        submitted = batcher.submit([list(ids) for _, ids in keys], long=len(keys) > batcher.max_batch)
        for key, future in zip(keys, submitted):
            future.add_done_callback(partial(progress.scored, readers[key], m))
        futures += submitted
    try:
        await progress.over.wait()
    finally:  # stopped early, or the request went away: windows not yet taken into a call are dropped
        for future in futures:
            future.cancel()
    if progress.error is not None:
        raise progress.error
    if progress.over_budget:
        raise ScanOverBudget(budget or 0.0, progress.windows - progress.left, progress.windows)
    if not progress.blocked and not np.isfinite(progress.best).all():
        raise ValueError("a text without a window or a score from every member of the guard")
    return [float(s) for s in model.calibrated(progress.best)]
