"""Choose the shipped calibration and threshold by k-fold cross-validation, not on one split of one seed.

    .bench/guard-train/venv/bin/python guard_models/crossval.py --out .bench/guard-train/cv --folds 5 --threads 2

The pooled training data (both sources' train splits and the train part of guard_models/data/) is cut into k folds
by group, so variants of one prompt never sit on both sides. Fold f trains train.py's recipe with seed `--seed + f`
on the other folds, and scores its own fold and the validation splits with the gateway's scanning windows; the
spread over folds is thus the spread over data and seeds together. A fold already scored is not trained again, so
folds can run as separate processes (`--fold 0 --fold 1 ...`). When every fold is scored:

- calibration: Platt scaling (a scale and a bias on the logit margin) fitted on all out-of-fold margins;
- threshold: on the calibrated out-of-fold scores of the two public sources, the best worse-source F1 with each
  source's false-positive rate held under its cap (`gateway.guard.evaluation.choose_threshold`); the caps sit below
  the targets so that the spread over folds fits under them. This project's written rows (hard negatives and
  multilingual attacks) are reported at that threshold, not used to choose it: capping their false-positive rate
  too pushed the threshold to where every source lost a tenth of its recall;
- the figures at that threshold for every fold, with their mean, standard deviation, minimum and maximum;
- the same figures for each language and each carrier kind of the written rows (recall, false-positive rate, F1
  where a group has both labels; `out_of_fold_by_lang`, `out_of_fold_by_carrier`), to see where the model is weak.

`--hold-out lang` (or `carrier`) cuts the folds so that each language (or carrier kind) of the written rows is held
out whole, every file's rows of it together: the per-language figures then say how the recipe does on a language it
never trained on, not on a new family of a language it knows. The default (`random`, the same as `family`) holds out
whole families. The public sources keep their groups either way.

Everything goes to <out>/crossval.json, which export.py ships into the model's config.json.

`--blend DIR=WEIGHT ...` trains nothing: it sums the fold margins of finished cross-validations (same folds, other
recipes or base encoders) with those weights, then calibrates and chooses the threshold of that blend the same way,
for an ensemble folder (gateway/guard/ensemble.py):

    crossval.py --out .bench/guard-train/cv-blend --blend .bench/guard-train/cv=0.5 .bench/guard-train/cv-e5=0.5

`DIR=WEIGHT@MODEL` weighs that member on each row by the share of the row its vocabulary reads as words (MODEL: a
folder with the member's tokenizer.json), as an ensemble member listed with `weighed_by_reading` is weighed
(gateway/guard/reading.py).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from train import SOURCES, fine_tune, load_split, load_written, logger, parser, sigmoid, tokenizer, window_margins

from gateway.guard.evaluation import choose_threshold, defined, metrics
from gateway.guard.model import read_tokenizer
from gateway.guard.reading import VocabularyReading, blend_weights

if TYPE_CHECKING:
    from tokenizers import Tokenizer

CAPS = {"neuralchemy": 0.025, "s-labs": 0.008}  # the targets on unseen data: 3 % and 1 %
FIGURES = ("f1", "precision", "recall", "fpr", "roc_auc")
HOLD_OUTS = ("random", "family", "lang", "carrier")
GROUP_FIGURES = ("recall", "fpr", "f1")  # per language and per carrier kind: what a group of one label still has


def pooled() -> list[dict]:
    return load_split("train") + load_written("train")


def fold_unit(row: dict, hold_out: str) -> tuple[str, str]:
    """(pool, unit) of a row: a unit goes whole to one fold, units are shuffled within their pool. The public sources
    always keep their groups (neuralchemy's variants of a prompt, S-Labs' repeats of a text). This project's written
    rows keep their families with `random` and `family` (the same assignment); with `lang` every written row of one
    language, whichever file it comes from, is one unit; with `carrier` every carrier row of one kind is."""
    if row["source"] not in SOURCES:
        if hold_out == "lang":
            return "written", "lang:" + row["lang"]
        if hold_out == "carrier" and row["carrier"]:
            return row["source"], "carrier:" + row["carrier"]
    return row["source"], row["group"]


def assign_folds(rows: list[dict], k: int, seed: int = 0, hold_out: str = "random") -> list[int]:
    """Fold of each row: every unit (fold_unit) goes whole to one fold, units shuffled within each pool."""
    units = [fold_unit(r, hold_out) for r in rows]
    fold_of_unit: dict[str, int] = {}
    rng = random.Random(seed)
    for pool in sorted({pool for pool, _ in units}):
        members = list(dict.fromkeys(unit for p, unit in units if p == pool))
        rng.shuffle(members)
        fold_of_unit.update((unit, i % k) for i, unit in enumerate(members))
    return [fold_of_unit[unit] for _, unit in units]


def run_fold(fold: int, rows: list[dict], folds: list[int], args: argparse.Namespace) -> None:
    say = logger(args.out / f"fold{fold}")
    fold_args = argparse.Namespace(**{**vars(args), "seed": args.seed + fold})
    model = fine_tune([r for r, f in zip(rows, folds) if f != fold], fold_args, say)
    windows = tokenizer(args.max_len, stride=32)
    held = [i for i, f in enumerate(folds) if f == fold]
    validation = load_split("validation")
    result = {
        "fold": fold,
        "seed": fold_args.seed,
        "held_out": dict(zip(held, window_margins(model, [rows[i]["text"] for i in held], windows))),
        "validation": window_margins(model, [r["text"] for r in validation], windows),
    }
    (args.out / f"fold{fold}.json").write_text(json.dumps(result))
    say(f"fold {fold} scored: {len(held)} held-out rows, {len(validation)} validation rows")


def platt(margins: list[float], labels: list[int]) -> tuple[float, float]:
    """Scale and bias of sigmoid(scale * margin + bias), fitted by maximum likelihood (Platt's smoothed targets)."""
    from sklearn.linear_model import LogisticRegression

    positives = sum(labels)
    negatives = len(labels) - positives
    high, low = (positives + 1) / (positives + 2), 1 / (negatives + 2)
    # Platt's targets are soft; sample weights on duplicated rows express them with a plain logistic regression
    x = [[m] for m in margins] * 2
    y = [1] * len(margins) + [0] * len(margins)
    w = [high if label else low for label in labels] + [1 - high if label else 1 - low for label in labels]
    fit = LogisticRegression(C=1e6, max_iter=1000).fit(x, y, sample_weight=w)
    return float(fit.coef_[0][0]), float(fit.intercept_[0])


def spread(per_fold: list[dict], names: tuple[str, ...] = FIGURES) -> dict:
    """Mean, standard deviation, minimum and maximum over folds of each of `names` that a fold's labels define
    (`gateway.guard.evaluation.defined`): the recall over the folds that hold attacks, the false-positive rate over
    those that hold benign rows, the rest over those that hold both. A figure no fold defines is left out."""
    out = {}
    for name in names:
        values = [m[name] for m in per_fold if defined(name, m)]
        if values:
            out[name] = {
                "mean": round(statistics.fmean(values), 4),
                "std": round(statistics.stdev(values), 4) if len(values) > 1 else 0.0,
                "min": round(min(values), 4),
                "max": round(max(values), 4),
            }
    return out


def out_of_fold(
    rows: list[dict],
    folds: list[int],
    scores: dict[int, float],
    threshold: float,
    key: Callable[[dict], str | None],
    names: tuple[str, ...] = FIGURES,
) -> dict:
    """For each value of key(row) among the scored rows (None: left out), the figures at `threshold` of all its rows
    pooled, and their spread over the folds that hold such rows: with `--hold-out lang` a language's rows are all in
    one fold, so its spread is that one fold's figures."""

    def figures(indices: list[int]) -> dict:
        return metrics([rows[i]["label"] for i in indices], [scores[i] for i in indices], threshold)

    table = {}
    for value in sorted({key(rows[i]) for i in scores} - {None}):
        members = [i for i in sorted(scores) if key(rows[i]) == value]
        per_fold = [figures([i for i in members if folds[i] == f]) for f in sorted({folds[i] for i in members})]
        table[value] = {"pooled": figures(members), "spread": spread(per_fold, names)}
    return table


def summarize(rows: list[dict], folds: list[int], results: list[dict], out: Path, hold_out: str = "random") -> dict:
    held = {int(i): m for r in results for i, m in r["held_out"].items()}
    order = sorted(held)
    scale, bias = platt([held[i] for i in order], [rows[i]["label"] for i in order])

    def score(margin: float) -> float:
        return sigmoid(scale * margin + bias)

    scores = {i: score(held[i]) for i in order}
    public = {}
    for source in SOURCES:
        members = [i for i in order if rows[i]["source"] == source]
        public[source] = ([rows[i]["label"] for i in members], [scores[i] for i in members])
    threshold = choose_threshold(public, CAPS)
    validation = load_split("validation")
    report: dict = {
        "calibration": {"scale": round(scale, 5), "bias": round(bias, 5)},
        "threshold": threshold,
        "caps": CAPS,
        "folds": len(results),
        "seeds": [r["seed"] for r in results],
        "hold_out": hold_out,
        "rows": len(rows),
        "out_of_fold": {},
        "out_of_fold_by_lang": {},
        "out_of_fold_by_carrier": {},
        "validation": {},
    }
    report["out_of_fold"] = out_of_fold(rows, folds, scores, threshold, lambda r: r["source"])
    for table, key in (("out_of_fold_by_lang", "lang"), ("out_of_fold_by_carrier", "carrier")):
        report[table] = out_of_fold(rows, folds, scores, threshold, lambda r, key=key: r.get(key), GROUP_FIGURES)
    for source in SOURCES:
        members = [i for i, r in enumerate(validation) if r["source"] == source]
        labels = [validation[i]["label"] for i in members]
        per_model = [metrics(labels, [score(r["validation"][i]) for i in members], threshold) for r in results]
        report["validation"][source] = {"spread": spread(per_model)}
    (out / "crossval.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def weighted(runs: list[str]) -> list[tuple[str, float, str | None]]:
    """(folder, weight, the model folder whose vocabulary's reading weighs it, or None) of each `DIR=WEIGHT[@MODEL]`."""
    out = []
    for run in runs:
        folder, _, rest = run.partition("=")
        weight, _, model = rest.partition("@")
        out.append((folder, float(weight), model or None))
    return out


def readers(runs: list[tuple[str, float, str | None]]) -> list[tuple[Tokenizer, VocabularyReading] | None]:
    """For each run weighed by its reading, its member's tokenizer and how that vocabulary reads; None for the rest."""
    out: list[tuple[Tokenizer, VocabularyReading] | None] = []
    for _, _, model in runs:
        tokenizer = read_tokenizer(Path(model) / "tokenizer.json") if model else None
        out.append((tokenizer, VocabularyReading(tokenizer)) if tokenizer else None)
    return out


def reading_shares(members: list[tuple[Tokenizer, VocabularyReading] | None], texts: list[str]) -> np.ndarray:
    """Each text's share read by each member (texts × members): 1 for a member not weighed by its reading."""
    shares = np.ones((len(texts), len(members)))
    for m, member in enumerate(members):
        if member is not None:
            tokenizer, reading = member
            shares[:, m] = [reading.share(e.ids) for e in tokenizer.encode_batch(texts, add_special_tokens=False)]
    return shares


def blended(runs: list[str], fold_numbers: list[int], texts: list[str], validation: list[str]) -> list[dict]:
    """Fold results whose margins are the weighted sums of those of the cross-validations named `DIR=WEIGHT[@MODEL]`,
    each text with its own weights where a member is weighed by its reading (`texts`: the pooled rows' texts, which
    the held-out indices point into; `validation`: the validation rows' texts, in the folds' order)."""
    listed = weighted(runs)
    parts = [
        {f: json.loads((Path(folder) / f"fold{f}.json").read_text()) for f in fold_numbers} for folder, *_ in listed
    ]
    weights = [weight for _, weight, _ in listed]
    members = readers(listed)
    text_weights = blend_weights(weights, reading_shares(members, texts))
    validation_weights = blend_weights(weights, reading_shares(members, validation))
    out = []
    for f in fold_numbers:
        first = parts[0][f]
        if any(
            r[f]["held_out"].keys() != first["held_out"].keys() or len(r[f]["validation"]) != len(validation)
            for r in parts
        ):
            raise SystemExit(f"--blend: fold {f} scored other rows in some of {runs}")
        out.append(
            {
                "fold": f,
                "seed": first["seed"],
                "held_out": {
                    i: float(sum(text_weights[int(i), m] * r[f]["held_out"][i] for m, r in enumerate(parts)))
                    for i in first["held_out"]
                },
                "validation": [
                    float(sum(validation_weights[j, m] * r[f]["validation"][j] for m, r in enumerate(parts)))
                    for j in range(len(validation))
                ],
            }
        )
    return out


def checked(results: list[dict], folds: list[int], hold_out: str) -> list[dict]:
    """`results`, once each fold is known to have scored the rows this assignment puts in it: a fold scored with
    another --hold-out, or before the data changed, would mix up every figure."""
    for r in results:
        if {int(i) for i in r["held_out"]} != {i for i, f in enumerate(folds) if f == r["fold"]}:
            raise SystemExit(
                f"fold {r['fold']} scored other rows than --hold-out {hold_out} puts in it: use another --out"
            )
    return results


def main() -> None:
    ap = parser()
    ap.description = __doc__
    ap.add_argument("--folds", type=int, default=5)
    ap.add_argument("--fold", type=int, action="append", help="train only this fold (repeatable); default: all")
    ap.add_argument("--blend", nargs="+", metavar="DIR=WEIGHT", help="blend finished cross-validations instead")
    ap.add_argument(
        "--hold-out",
        choices=HOLD_OUTS,
        default="random",
        help="what a fold holds out of this project's written rows: whole families (random, family: the same), "
        "whole languages (lang) or whole carrier kinds (carrier); the public sources keep their groups",
    )
    ap.add_argument(
        "--scored-only",
        action="store_true",
        help="summarise (or blend) the folds scored so far instead of all k, training none but those --fold names: a "
        "quicker operating point from fewer out-of-fold rows, no spread when one is scored; `folds` says how many",
    )
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = pooled()
    folds = assign_folds(rows, args.folds, hold_out=args.hold_out)
    sources = [Path(folder) for folder, *_ in weighted(args.blend)] if args.blend else [args.out]
    fold_numbers = [
        f
        for f in range(args.folds)
        if not args.scored_only or all((source / f"fold{f}.json").is_file() for source in sources)
    ]
    if args.blend:
        texts, validation = [r["text"] for r in rows], [r["text"] for r in load_split("validation")]
        results = checked(blended(args.blend, fold_numbers, texts, validation), folds, args.hold_out)
        report = summarize(rows, folds, results, args.out, args.hold_out)
        report["blend"] = [
            {"crossval": folder, "weight": weight, **({"weighed_by_reading": model} if model else {})}
            for folder, weight, model in weighted(args.blend)
        ]
        (args.out / "crossval.json").write_text(json.dumps(report, indent=2) + "\n")
        print(json.dumps(report, indent=2))
        return
    for fold in args.fold or ([] if args.scored_only else range(args.folds)):
        if not (args.out / f"fold{fold}.json").is_file():
            run_fold(fold, rows, folds, args)
    done = [args.out / f"fold{f}.json" for f in fold_numbers]
    if done and all(p.is_file() for p in done):
        results = checked([json.loads(p.read_text()) for p in done], folds, args.hold_out)
        report = summarize(rows, folds, results, args.out, args.hold_out)
        print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
