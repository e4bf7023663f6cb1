"""A scan's bounds, with stand-in classifiers: a repeated window scored once, the budget stopping a scan, a blocking
finding ending it early, findings that serve the request scanned whole, and a long text read first by one member or
by a screening model."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest

from gateway.guard.batcher import MicroBatcher
from gateway.guard.ensemble import MEMBER_FIRST_PASS, Cut, GuardEnsemble, Window
from gateway.guard.model import GuardModel
from gateway.guard.scan import ScanOverBudget, scan

TOP = MEMBER_FIRST_PASS[0]  # the first-pass windows whose spans the other members read, by rank


class Member:
    """A classifier whose margin for a window is its first id / 100 - 5 (id 900: a clear attack), computing `delay`
    seconds a window."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.read: list[list[int]] = []

    def __call__(self, batch: list[list[int]]) -> np.ndarray:
        self.read += batch
        until = time.thread_time() + self.delay * len(batch)
        while time.thread_time() < until:  # CPU time, what a scan is charged
            pass
        return np.array([ids[0] / 100 - 5 for ids in batch])


class Blend(GuardEnsemble):
    """The ensemble's own blend, screen and second-pass rules over stand-in models: equal weights, no calibration;
    the members read a first-pass window's span as the same window."""

    def __init__(self, screen: bool = False, second_pass_rule: tuple[int, float] = MEMBER_FIRST_PASS) -> None:
        super().__init__(Path("."), [object(), object()], [0.5, 0.5], (1.0, 0.0), None, "blend")  # type: ignore[list-item]
        self.screen = cast(GuardModel, object()) if screen else None
        self.second_pass_rule = second_pass_rule

    def second_pass(self, cut: Cut, t: int, span: tuple[int, int]) -> list[Window]:
        ids = [cut.items[k][2] for k, first in cut.deferred[t] if first == span]
        return [(t, m, window) for m in range(len(self.members)) if m != cut.first_pass for window in ids]


def scanned(
    members: list[Member], cut: Cut, blend: Blend | None = None, **bounds: Any
) -> tuple[list[float], list[MicroBatcher]]:
    batchers = [MicroBatcher(member, max_batch=4, max_wait_us=0, long_batch=2) for member in members]

    async def main() -> list[float]:
        try:
            scores, _ = await scan(blend or Blend(), batchers, cut, **bounds)
            return scores
        finally:
            for batcher in batchers:
                await batcher.aclose()

    return asyncio.run(main()), batchers


def cut_of(
    items: list[Window],
    texts: int = 1,
    deferred: dict | None = None,
    first_pass: int = 0,
    weights: np.ndarray | None = None,
) -> Cut:
    weights = np.full((texts, 2), 0.5) if weights is None else weights
    return Cut(["x"] * texts, items, deferred or {}, first_pass if deferred else -1, None, 32, weights)


def test_each_text_is_blended_with_its_own_weights() -> None:
    """A text one member cannot read (weight 0 there) scores the other's margin alone, here and where a finding
    refuses at a score: the same windows, blended per text."""
    items: list[Window] = [(t, m, [ids]) for t in range(2) for m, ids in ((0, 100), (1, 900))]
    weights = np.array([[0.5, 0.5], [0.0, 1.0]])
    scores, _ = scanned([Member(), Member()], cut_of(items, texts=2, weights=weights))
    assert scores == pytest.approx([1 / (1 + np.exp(-0.0)), 1 / (1 + np.exp(-4.0))])
    blocked, _ = scanned([Member(), Member()], cut_of(items[2:], texts=2, weights=weights), blocks=[None, 0.9])
    assert blocked[1] == pytest.approx(1 / (1 + np.exp(-4.0)))


def test_a_repeated_window_is_scored_once() -> None:
    members = [Member(), Member()]
    items: list[Window] = [(t, m, [100, 7]) for t in range(3) for m in range(2)] + [(1, 0, [200])]
    scores, _ = scanned(members, cut_of(items, texts=3))
    assert [len(member.read) for member in members] == [2, 1]
    assert scores[0] == scores[2] < scores[1]


def test_a_scan_past_its_budget_is_refused_and_stopped() -> None:
    """40 windows of 10 ms each per member (0.4 s a member) under a budget of 0.1 s: refused with a 413, and the
    windows not yet taken into a call are not scored."""
    members = [Member(delay=0.01), Member(delay=0.01)]
    items: list[Window] = [(0, m, [100, k]) for m in range(2) for k in range(40)]
    with pytest.raises(ScanOverBudget) as refused:
        scanned(members, cut_of(items), budget=0.1)
    assert refused.value.status == 413 and refused.value.param == "guard.injection.cpu_budget"
    assert sum(len(member.read) for member in members) < 40
    scores, _ = scanned([Member(), Member()], cut_of(items), budget=10.0)
    assert len(scores) == 1


def test_a_blocking_finding_ends_the_scan_and_one_that_serves_reads_everything() -> None:
    """The attack in the third of 60 windows: a text whose finding blocks stops soon after it; without `blocks`
    (flag, redact, monitor) every window is read and the score is the same or higher."""
    items: list[Window] = [(0, m, [900 if k == 2 else 100, k]) for m in range(2) for k in range(60)]
    members = [Member(delay=0.001), Member(delay=0.001)]
    blocked, _ = scanned(members, cut_of(items), blocks=[0.9])
    assert blocked[0] >= 0.9
    assert sum(len(member.read) for member in members) < 60
    everything = [Member(), Member()]
    whole, _ = scanned(everything, cut_of(items), blocks=[None])
    assert [len(member.read) for member in everything] == [60, 60] and whole[0] >= blocked[0]


def test_a_long_text_is_read_by_the_first_pass_member_and_the_others_read_its_suspects() -> None:
    """Member 0 reads 20 windows, the 13th an attack; member 1 reads only the spans of the highest-scoring few."""
    first: list[Window] = [(0, 0, [900 if k == 12 else 100 + k, k]) for k in range(20)]
    deferred = {0: [(k, (10 * k, 10 * k + 12)) for k in range(20)]}
    members = [Member(), Member()]
    scores, _ = scanned(members, cut_of(first, deferred=deferred))
    assert len(members[0].read) == 20 and len(members[1].read) == TOP
    assert [900, 12] in members[1].read, "the attack's span is read by the second member"
    assert scores[0] > 0.9


def test_a_blocking_finding_in_a_long_text_ends_the_first_pass_early() -> None:
    """The second member reads a first-pass window's span as soon as the first member leans malicious on it, so an
    attack in the third of 60 windows of a long text stops the scan long before the first pass is over."""
    first: list[Window] = [(0, 0, [900 if k == 2 else 100 + k, k]) for k in range(60)]
    deferred = {0: [(k, (10 * k, 10 * k + 12)) for k in range(60)]}
    members = [Member(delay=0.002), Member(delay=0.002)]
    scores, _ = scanned(members, cut_of(first, deferred=deferred), blocks=[0.9])
    assert scores[0] >= 0.9
    assert len(members[0].read) < 30 and members[1].read == [[900, 2]]


def test_a_screen_reads_a_long_text_first_and_every_member_reads_its_suspects_and_top_windows() -> None:
    """The screen (scanner 2) reads 20 windows, the 13th an attack: both members read only the spans of its top
    few, the attack's among them, and the blend is theirs alone (the screen's margin is not counted)."""
    first: list[Window] = [(0, 2, [900 if k == 12 else 100 + k, k]) for k in range(20)]
    deferred = {0: [(k, (10 * k, 10 * k + 12)) for k in range(20)]}
    members = [Member(), Member(), Member()]
    scores, _ = scanned(members, cut_of(first, deferred=deferred, first_pass=2), Blend(screen=True))
    assert [len(member.read) for member in members] == [TOP, TOP, 20]
    assert [900, 12] in members[0].read and [900, 12] in members[1].read
    assert scores[0] == pytest.approx(1 / (1 + np.exp(-4.0)))  # each member's largest margin: 900 / 100 - 5


def test_a_screens_top_and_margin_set_which_spans_the_members_read() -> None:
    """Every screened window leans malicious above a margin of -4.5 (its margins run -4.0 to -3.81), none above 0:
    the members read every span, or the screen's top few (member first passes' or its own)."""
    first: list[Window] = [(0, 2, [100 + k, k]) for k in range(20)]
    deferred = {0: [(k, (10 * k, 10 * k + 12)) for k in range(20)]}
    for reads, read in (((TOP, -4.5), 20), ((TOP, 0.0), TOP), ((9, 0.0), 9)):
        members = [Member(), Member(), Member()]
        scanned(members, cut_of(first, deferred=deferred, first_pass=2), Blend(screen=True, second_pass_rule=reads))
        assert [len(member.read) for member in members] == [read, read, 20]
