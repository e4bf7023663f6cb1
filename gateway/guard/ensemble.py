"""What the gateway scans with: one classifier, or several whose verdicts on a text are blended into one score.

Why blend: an encoder with an English vocabulary reads English attacks best, while a multilingual one reads the
rest of the world (and flags fewer ordinary prompts that merely look like attacks); out of fold, the weighted sum of
their logit margins was as good as the better of the two on every figure and better than both on most
(guard_models/README.md). Each member tokenizes a text its own
way, so windows do not line up across members: a text's blended margin is the weighted sum of each member's largest
window margin, and one Platt calibration maps that onto a probability, fitted the same way as a single model's.

An ensemble folder holds only `config.json`, whose `portcullis.members` lists member folders (relative to it) with
their weights, beside the ensemble's own `calibration` and `threshold`. Any other folder is a single model, scored
exactly as `GuardModel` scores it.
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

if TYPE_CHECKING:
    from collections.abc import Sequence

log = logging.getLogger(__name__)

# (text index, member index, token ids): one window of one text, in one member's tokens
Window = tuple[int, int, list[int]]

# A text is first counted on its first max_tokens * PREFIX_CHARS_PER_TOKEN characters: text at least that dense
# (prose takes ~4 characters a token) is refused without tokenizing a body of megabytes in full.
PREFIX_CHARS_PER_TOKEN = 8


class TooManyTokens(Exception):
    """Texts longer than a scan may be, in one member's tokens (`needed`: at least that many)."""

    def __init__(self, needed: int) -> None:
        super().__init__(f"{needed} tokens")
        self.needed = needed


@dataclass
class GuardEnsemble:
    """Members, their weights, and the calibration and threshold of the blend."""

    folder: Path
    members: list[GuardModel]
    weights: list[float]
    calibration: tuple[float, float]
    threshold: float | None
    name: str

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

    def windows(
        self, texts: list[str], window: int | None = None, stride: int = 32, max_tokens: int | None = None
    ) -> list[Window]:
        """Every member's windows of every text. TooManyTokens when the texts hold more than `max_tokens` of a
        member's tokens."""
        out: list[Window] = []
        for m, member in enumerate(self.members):
            if max_tokens is not None:
                prefix = max_tokens * PREFIX_CHARS_PER_TOKEN
                heads = [text[:prefix] for text in texts if len(text) > prefix]
                # a cut may split a word into more pieces than it has whole: count one fewer per head
                least = sum(len(e.ids) - 1 for e in member.tokenizer.encode_batch(heads, add_special_tokens=False))
                if least > max_tokens:
                    raise TooManyTokens(least)
            encodings = member.tokenizer.encode_batch(texts, add_special_tokens=False)
            needed = sum(len(e.ids) for e in encodings)
            if max_tokens is not None and needed > max_tokens:
                raise TooManyTokens(needed)
            for t, encoding in enumerate(encodings):
                out.extend((t, m, ids) for ids in member.cut_windows(encoding.ids, window, stride))
        return out

    def blend(self, texts: int, windows: Sequence[Window], margins: Sequence[float]) -> np.ndarray:
        """Each text's calibrated score from its windows' margins. Every member must have scanned every text: a text
        some member did not read is an error, never a pass."""
        best = np.full((texts, len(self.members)), -np.inf)
        for (t, m, _), margin in zip(windows, margins):
            best[t, m] = np.fmax(best[t, m], margin)
        if not np.isfinite(best).all():
            raise ValueError("a text without a window or a score from every member of the guard")
        return self.calibrated(best)

    def calibrated(self, best: np.ndarray) -> np.ndarray:
        """The calibrated blend of each member's largest margin (the last axis); -inf for a member that has not read
        the text yet counts as its least possible margin, so the score is a lower bound that only grows."""
        scale, bias = self.calibration
        return 1.0 / (1.0 + np.exp(-(scale * (best @ np.asarray(self.weights)) + bias)))

    def score_texts(
        self, texts: list[str], window: int | None = None, stride: int = 32, batch_size: int = 32
    ) -> list[float]:
        """Each text's score without the batcher (CLI, evaluation): the same windows and blend as the gateway."""
        windows = self.windows(texts, window, stride)
        margins = [0.0] * len(windows)
        order = sorted(range(len(windows)), key=lambda k: (windows[k][1], len(windows[k][2])))
        for start in range(0, len(order), batch_size):
            chunk = order[start : start + batch_size]
            by_member: dict[int, list[int]] = {}
            for k in chunk:
                by_member.setdefault(windows[k][1], []).append(k)
            for m, ks in by_member.items():
                for k, margin in zip(ks, self.members[m].margins([windows[k][2] for k in ks])):
                    margins[k] = float(margin)
        return [float(s) for s in self.blend(len(texts), windows, margins)]


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
    except (TypeError, KeyError, ValueError):
        raise GuardModelError(
            f"{config_path}: portcullis.members must be a list of {{model: folder, weight: number}}"
        ) from None
    if not paths or any(not w > 0 for w in weights):
        raise GuardModelError(f"{config_path}: portcullis.members needs at least one member, each of positive weight")
    # the members run at once: unless told otherwise, each takes its share of the cores instead of all of them
    # (on 2 cores, 1 thread each cut the bundled pair's p50 at 128 tokens from 14.3 to 11.9 ms)
    threads = threads or max(1, usable_cores() // len(paths))
    members = [load_model(path, device=device, precision=precision, threads=threads) for path in paths]
    if "calibration" not in extra or "threshold" not in extra:
        log.warning("guard ensemble %s: no calibration or threshold in config.json; scores are uncalibrated", folder)
    if len({member.providers[0] for member in members}) > 1:
        log.warning("guard ensemble %s: members run on %s", folder, [member.providers[0] for member in members])
    threshold = extra.get("threshold")
    return GuardEnsemble(
        folder,
        members,
        weights,
        calibration_of(extra, folder),
        float(threshold) if threshold is not None else None,
        str(extra.get("name") or folder.name),
    )
