"""What the gateway scans with: one classifier, or several whose verdicts on a text are blended into one score.

Why blend: an encoder with an English vocabulary reads English attacks best, while a multilingual one reads the
rest of the world (and flags fewer ordinary prompts that merely look like attacks); out of fold, the weighted sum of
their logit margins was as good as the better of the two on every figure and better than both on most
(guard_models/README.md). Each member tokenizes a text its own
way, so windows do not line up across members: a text's blended margin is the weighted sum of each member's largest
window margin, and one Platt calibration maps that onto a probability, fitted the same way as a single model's.

An ensemble folder holds only `config.json`, whose `portcullis.members` lists member folders (relative to it) with
their weights, beside the ensemble's own `calibration` and `threshold`. A member listed with `"weighed_by_reading":
true` counts on each text for the share of it that its vocabulary reads as words (gateway/guard/reading.py): an
English-vocabulary member has no say on Tamil or Russian, which it reads letter by letter, and the weight it leaves
goes to the others. Any other folder is a single model, scored exactly as `GuardModel` scores it.

`portcullis.screen` may name a screening model, `{"model": folder, "margin": number, "top": count}`: a shallow
classifier that reads a long text first in place of a member (see `Cut`), at a fraction of a member's cost a window,
and that the blend never counts. The members read the spans of its `top` highest-scoring windows and of every one
whose margin is above `margin`: a weaker reader than a member, a screen is given a deeper `top` to miss nothing.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from gateway.config import usable_cores
from gateway.guard.model import DEFAULT_MODEL_DIR, GuardModel, GuardModelError, calibration_of, load_model
from gateway.guard.reading import VocabularyReading, blend_weights

if TYPE_CHECKING:
    from collections.abc import Sequence

    from tokenizers import Tokenizer

log = logging.getLogger(__name__)

# (text index, member index, token ids): one window of one text, in one member's tokens
Window = tuple[int, int, list[int]]

# The first-pass windows of a long text whose spans the members read where a member reads it first: its
# highest-scoring few and every one it leans malicious on (a margin above 0); a screen names its own
MEMBER_FIRST_PASS = (4, 0.0)

# A text is first counted on its first max_tokens * PREFIX_CHARS_PER_TOKEN characters: text at least that dense
# (prose takes ~4 characters a token) is refused without tokenizing a body of megabytes in full.
PREFIX_CHARS_PER_TOKEN = 8


class TooManyTokens(Exception):
    """Texts longer than a scan may be, in one member's tokens (`needed`: at least that many)."""

    def __init__(self, needed: int) -> None:
        super().__init__(f"{needed} tokens")
        self.needed = needed


@dataclass(frozen=True)
class Cut:
    """A scan's windows over `texts`. A long text is read by the first-pass model alone first (`deferred`: each
    such text's first-pass windows, as item index and character span): the first pass is the screening model where
    the ensemble has one, else one member. The members that have not read the text read only the spans of the
    windows the first pass leans malicious on or scores highest (gateway/guard/scan.py), so a document costs about
    one screen's (or member's) reading, not all of the members'."""

    texts: list[str]
    items: list[Window]
    deferred: dict[int, list[tuple[int, tuple[int, int]]]]
    first_pass: int  # the scanner index (`GuardEnsemble.scanners`), -1 when no text is deferred
    window: int | None
    stride: int
    weights: np.ndarray  # each text's member weights in the blend (texts × members)


@dataclass
class GuardEnsemble:
    """Members, their weights, and the calibration and threshold of the blend; the screening model of long texts,
    where the folder names one; which first-pass windows' spans the members read."""

    folder: Path
    members: list[GuardModel]
    weights: list[float]
    calibration: tuple[float, float]
    threshold: float | None
    name: str
    screen: GuardModel | None = None
    # the first pass's `top` highest-scoring windows and every one above `margin`: a member's, or the screen's own
    second_pass_rule: tuple[int, float] = MEMBER_FIRST_PASS
    # by member: how its vocabulary reads a text, where its weight follows that (None: the configured weight)
    readings: list[VocabularyReading | None] | None = None

    @property
    def scanners(self) -> list[GuardModel]:
        """Every model a scan may read with, by the index its windows carry: the members, then the screen."""
        return self.members + ([self.screen] if self.screen else [])

    @property
    def max_length(self) -> int:
        return min(member.max_length for member in self.members)

    @property
    def providers(self) -> list[str]:
        return self.members[0].providers

    @property
    def device(self) -> str:
        return self.members[0].device

    @property
    def path(self) -> Path:
        """The ONNX file of a single model; the ensemble's config.json otherwise."""
        return self.members[0].path if len(self.members) == 1 else self.folder / "config.json"

    @property
    def labels(self) -> dict[int, str]:
        return self.members[0].labels

    @property
    def malicious(self) -> list[int]:
        return self.members[0].malicious

    @property
    def first_pass(self) -> int:
        """The scanner that reads a long text first: the screen where there is one, else the member with the widest
        vocabulary, which reads the most languages (the multilingual model of the bundled pair)."""
        if self.screen is not None:
            return len(self.members)
        return max(range(len(self.members)), key=lambda m: self.members[m].tokenizer.get_vocab_size())

    def windows(
        self,
        texts: list[str],
        window: int | None = None,
        stride: int = 32,
        max_tokens: int | None = None,
        first_pass_above: int | None = None,
    ) -> Cut:
        """Every member's windows of every text, except that a text of more than `first_pass_above` of the
        first-pass scanner's tokens is read by that scanner alone first (see `Cut`); a screen reads no other text.
        TooManyTokens when the texts hold more than `max_tokens` of a scanner's tokens."""
        scanners = self.scanners
        encodings = []
        by_tokenizer: dict[int, list] = {}  # a screen cut from a member shares its tokenizer: encoded once
        for member in scanners:
            if id(member.tokenizer) in by_tokenizer:
                encodings.append(by_tokenizer[id(member.tokenizer)])
                continue
            if max_tokens is not None:
                prefix = max_tokens * PREFIX_CHARS_PER_TOKEN
                heads = [text[:prefix] for text in texts if len(text) > prefix]
                # a cut may split a word into more pieces than it has whole: count one fewer per head
                least = sum(len(e.ids) - 1 for e in member.tokenizer.encode_batch(heads, add_special_tokens=False))
                if least > max_tokens:
                    raise TooManyTokens(least)
            encoded = member.tokenizer.encode_batch(texts, add_special_tokens=False)
            needed = sum(len(e.ids) for e in encoded)
            if max_tokens is not None and needed > max_tokens:
                raise TooManyTokens(needed)
            encodings.append(encoded)
            by_tokenizer[id(member.tokenizer)] = encoded
        first = self.first_pass if len(scanners) > 1 and first_pass_above is not None else -1
        spans: dict[int, list[tuple[int, int]]] = {}  # a long text's first-pass windows, as character spans
        if first >= 0:
            for t, encoding in enumerate(encodings[first]):
                if first_pass_above is not None and len(encoding.ids) > first_pass_above:
                    ranges = scanners[first].window_ranges(len(encoding.ids), window, stride)
                    offsets = encoding.offsets  # a new list of every token's offsets at each read: read once
                    spans[t] = [(offsets[start][0], offsets[end - 1][1]) for start, end in ranges]
        items: list[Window] = []
        deferred: dict[int, list[tuple[int, tuple[int, int]]]] = {}
        for m, member in enumerate(scanners):
            for t, encoding in enumerate(encodings[m]):
                if t in spans:
                    if m != first:
                        continue
                    deferred[t] = [(len(items) + k, span) for k, span in enumerate(spans[t])]
                elif member is self.screen:
                    continue
                items.extend((t, m, ids) for ids in member.cut_windows(encoding.ids, window, stride))
        return Cut(texts, items, deferred, first, window, stride, self.text_weights(encodings))

    def text_weights(self, encodings: list[list]) -> np.ndarray:
        """Each text's member weights (texts × members), from each member's encodings of the texts."""
        shares = np.ones((len(encodings[0]) if encodings else 0, len(self.members)))
        for m, reading in enumerate(self.readings or []):
            if reading is not None:
                shares[:, m] = [reading.share(encoding.ids) for encoding in encodings[m]]
        return blend_weights(self.weights, shares)

    def second_pass(self, cut: Cut, t: int, span: tuple[int, int]) -> list[Window]:
        """The windows of the members other than the first pass over one first-pass window's characters of text
        `t`."""
        piece = cut.texts[t][span[0] : span[1]]
        return [
            (t, m, ids)
            for m, member in enumerate(self.members)
            if m != cut.first_pass
            for ids in member.encode_windows(piece, cut.window, cut.stride)
        ]

    def blend(self, cut: Cut, margins: Sequence[float]) -> np.ndarray:
        """Each text's calibrated score from the margins of its windows (`cut.items`). Every member must have scanned
        every text: a text some member did not read is an error, never a pass."""
        best = np.full((len(cut.texts), len(self.scanners)), -np.inf)
        for (t, m, _), margin in zip(cut.items, margins):
            best[t, m] = np.fmax(best[t, m], margin)
        if not self.read_by_every_member(best):
            raise ValueError("a text without a window or a score from every member of the guard")
        return self.calibrated(best, cut.weights)

    def read_by_every_member(self, best: np.ndarray) -> bool:
        """Whether every member has a margin for every text (the last axis: each scanner's largest margin)."""
        return bool(np.isfinite(best[..., : len(self.members)]).all())

    def calibrated(self, best: np.ndarray, weights: np.ndarray) -> np.ndarray:
        """The calibrated blend of each member's largest margin (the last axis, by scanner: a screen's is not
        counted) with the text's member weights (`Cut.weights`); -inf for a member that has not read the text yet
        counts as its least possible margin, so the score is a lower bound that only grows. A member of weight 0 on a
        text counts for nothing there, read or not."""
        scale, bias = self.calibration
        margins = best[..., : len(self.members)]
        blended = np.multiply(
            margins, weights, out=np.zeros(np.broadcast_shapes(margins.shape, weights.shape)), where=weights > 0
        )
        blended = blended.sum(axis=-1)
        return 1.0 / (1.0 + np.exp(-(scale * blended + bias)))

    def score_texts(
        self, texts: list[str], window: int | None = None, stride: int = 32, batch_size: int = 32
    ) -> list[float]:
        """Each text's score without the batcher (CLI, evaluation): the same windows and blend as the gateway."""
        cut = self.windows(texts, window, stride)
        windows = cut.items
        margins = [0.0] * len(windows)
        order = sorted(range(len(windows)), key=lambda k: (windows[k][1], len(windows[k][2])))
        for start in range(0, len(order), batch_size):
            chunk = order[start : start + batch_size]
            by_member: dict[int, list[int]] = {}
            for k in chunk:
                by_member.setdefault(windows[k][1], []).append(k)
            for m, ks in by_member.items():
                for k, margin in zip(ks, self.scanners[m].margins([windows[k][2] for k in ks])):
                    margins[k] = float(margin)
        return [float(s) for s in self.blend(cut, margins)]


def load_guard(
    folder: str | Path | None = None, *, device: str = "auto", precision: str = "auto", threads: int = 0
) -> GuardEnsemble:
    """Load a model folder or an ensemble folder (see the module docstring); the default is the bundled guard."""
    folder = Path(folder) if folder else DEFAULT_MODEL_DIR
    config_path = folder / "config.json"
    extra: dict = {}
    if config_path.is_file():
        try:
            extra = json.loads(config_path.read_text()).get("portcullis") or {}
        except ValueError as exc:
            raise GuardModelError(f"{config_path}: not JSON ({exc})") from None
    listed = extra.get("members")
    if listed is None:
        model = load_model(folder, device=device, precision=precision, threads=threads)
        return GuardEnsemble(folder, [model], [1.0], model.calibration, model.threshold, model.name)
    try:
        paths = [(folder / str(member["model"])).resolve() for member in listed]
        weights = [float(member["weight"]) for member in listed]
        by_reading = [member.get("weighed_by_reading", False) for member in listed]
    except (TypeError, KeyError, ValueError):
        raise GuardModelError(
            f"{config_path}: portcullis.members must be a list of {{model: folder, weight: number}}"
        ) from None
    if any(not isinstance(flag, bool) for flag in by_reading):
        raise GuardModelError(f"{config_path}: a member's weighed_by_reading must be true or false")
    if not paths or any(not w > 0 for w in weights):
        raise GuardModelError(f"{config_path}: portcullis.members needs at least one member, each of positive weight")
    # the members run at once: unless told otherwise, each takes its share of the cores instead of all of them
    # (on 2 cores, 1 thread each cut the bundled pair's p50 at 128 tokens from 14.3 to 11.9 ms)
    threads = threads or max(1, usable_cores() // len(paths))
    tokenizers: dict[Path, Tokenizer] = {}  # a screen cut from a member shares its tokenizer's file, and its memory
    members = [
        load_model(path, device=device, precision=precision, threads=threads, tokenizers=tokenizers) for path in paths
    ]
    screen, second_pass_rule = _screen(extra.get("screen"), folder, config_path, device, precision, threads, tokenizers)
    if "calibration" not in extra or "threshold" not in extra:
        log.warning("guard ensemble %s: no calibration or threshold in config.json; scores are uncalibrated", folder)
    scanners = members + ([screen] if screen else [])
    if len({model.providers[0] for model in scanners}) > 1:
        log.warning("guard ensemble %s: models run on %s", folder, [model.providers[0] for model in scanners])
    threshold = extra.get("threshold")
    readings = [VocabularyReading(m.tokenizer) if flag else None for m, flag in zip(members, by_reading)]
    return GuardEnsemble(
        folder,
        members,
        weights,
        calibration_of(extra, folder),
        float(threshold) if threshold is not None else None,
        str(extra.get("name") or folder.name),
        screen,
        second_pass_rule,
        readings,
    )


def _screen(
    listed: object,
    folder: Path,
    config_path: Path,
    device: str,
    precision: str,
    threads: int,
    tokenizers: dict[Path, Tokenizer],
) -> tuple[GuardModel | None, tuple[int, float]]:
    """The screening model `portcullis.screen` names and which of its windows the members read (top, margin)."""
    if listed is None:
        return None, MEMBER_FIRST_PASS
    malformed = GuardModelError(
        f"{config_path}: portcullis.screen must be {{model: folder, margin: number, top: count}}"
    )
    if not isinstance(listed, dict) or "model" not in listed:
        raise malformed
    top = listed.get("top", MEMBER_FIRST_PASS[0])
    try:
        margin = float(listed.get("margin", MEMBER_FIRST_PASS[1]))
    except (TypeError, ValueError):
        raise malformed from None
    if not isinstance(top, int) or isinstance(top, bool):
        raise malformed
    path = (folder / str(listed["model"])).resolve()
    if not np.isfinite(margin) or top < 1:
        raise GuardModelError(f"{config_path}: portcullis.screen needs a finite margin and a top of at least 1")
    screen = load_model(path, device=device, precision=precision, threads=threads, tokenizers=tokenizers)
    return screen, (top, margin)
