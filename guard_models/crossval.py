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
- the figures at that threshold for every fold, with their mean, standard deviation, minimum and maximum.

Everything goes to <out>/crossval.json, which export.py ships into the model's config.json.

`--blend DIR=WEIGHT ...` trains nothing: it sums the fold margins of finished cross-validations (same folds, other
recipes or base encoders) with those weights, then calibrates and chooses the threshold of that blend the same way,
for an ensemble folder (gateway/guard/ensemble.py):

    crossval.py --out .bench/guard-train/cv-blend --blend .bench/guard-train/cv=0.5 .bench/guard-train/cv-e5=0.5
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path

from train import SOURCES, fine_tune, load_split, load_written, logger, parser, sigmoid, tokenizer, window_margins

from gateway.guard.evaluation import choose_threshold, metrics

CAPS = {"neuralchemy": 0.025, "s-labs": 0.008}  # the targets on unseen data: 3 % and 1 %
FIGURES = ("f1", "precision", "recall", "fpr", "roc_auc")


def pooled() -> list[dict]:
    return load_split("train") + load_written("train")


def assign_folds(rows: list[dict], k: int, seed: int = 0) -> list[int]:
    """Fold of each row: every group goes whole to one fold, groups shuffled within each source."""
    fold_of_group: dict[str, int] = {}
    rng = random.Random(seed)
    for source in sorted({r["source"] for r in rows}):
        groups = list(dict.fromkeys(r["group"] for r in rows if r["source"] == source))
        rng.shuffle(groups)
        fold_of_group.update((g, i % k) for i, g in enumerate(groups))
    return [fold_of_group[r["group"]] for r in rows]


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


def spread(per_fold: list[dict]) -> dict:
    """Mean, standard deviation, minimum and maximum over folds of each figure that a group's labels define: all of
    them for a group of both labels; the false-positive rate of benign rows alone, the recall of attacks alone."""
    positives, n = per_fold[0]["positives"], per_fold[0]["n"]
    names = FIGURES if 0 < positives < n else ("recall",) if positives else ("fpr",)
    out = {}
    for name in names:
        values = [m[name] for m in per_fold]
        out[name] = {
            "mean": round(statistics.fmean(values), 4),
            "std": round(statistics.stdev(values), 4) if len(values) > 1 else 0.0,
            "min": round(min(values), 4),
            "max": round(max(values), 4),
        }
    return out


def summarize(rows: list[dict], folds: list[int], results: list[dict], out: Path) -> dict:
    held = {int(i): m for r in results for i, m in r["held_out"].items()}
    order = sorted(held)
    scale, bias = platt([held[i] for i in order], [rows[i]["label"] for i in order])

    def score(margin: float) -> float:
        return sigmoid(scale * margin + bias)

    groups: dict[str, tuple[list[int], list[float]]] = {}
    for i in order:
        labels, scores = groups.setdefault(rows[i]["source"], ([], []))
        labels.append(rows[i]["label"])
        scores.append(score(held[i]))
    threshold = choose_threshold({source: groups[source] for source in SOURCES}, CAPS)

    def figures(indices: list[int], margins: dict[int, float] | list[float], table: list[dict]) -> dict:
        return metrics([table[i]["label"] for i in indices], [score(margins[i]) for i in indices], threshold)

    validation = load_split("validation")
    report: dict = {
        "calibration": {"scale": round(scale, 5), "bias": round(bias, 5)},
        "threshold": threshold,
        "caps": CAPS,
        "folds": len(results),
        "seeds": [r["seed"] for r in results],
        "rows": len(rows),
        "out_of_fold": {},
        "validation": {},
    }
    for group in sorted(groups):
        per_fold = [
            figures([i for i in order if folds[i] == r["fold"] and rows[i]["source"] == group], held, rows)
            for r in results
        ]
        members = [i for i in order if rows[i]["source"] == group]
        report["out_of_fold"][group] = {"pooled": figures(members, held, rows), "spread": spread(per_fold)}
    for source in SOURCES:
        members = [i for i, r in enumerate(validation) if r["source"] == source]
        per_model = [figures(members, r["validation"], validation) for r in results]
        report["validation"][source] = {"spread": spread(per_model)}
    (out / "crossval.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def weighted(runs: list[str]) -> list[tuple[str, float]]:
    """(folder, weight) of each `DIR=WEIGHT`."""
    return [(folder, float(weight)) for folder, _, weight in (run.partition("=") for run in runs)]


def blended(runs: list[str], k: int) -> list[dict]:
    """Fold results whose margins are the weighted sums of those of the cross-validations named `DIR=WEIGHT`."""
    parts = [
        ([json.loads((Path(folder) / f"fold{f}.json").read_text()) for f in range(k)], weight)
        for folder, weight in weighted(runs)
    ]
    out = []
    for f in range(k):
        first = parts[0][0][f]
        if any(
            r[f]["held_out"].keys() != first["held_out"].keys() or len(r[f]["validation"]) != len(first["validation"])
            for r, _ in parts
        ):
            raise SystemExit(f"--blend: fold {f} scored other rows in some of {runs}")
        out.append(
            {
                "fold": f,
                "seed": first["seed"],
                "held_out": {i: sum(w * r[f]["held_out"][i] for r, w in parts) for i in first["held_out"]},
                "validation": [
                    sum(w * r[f]["validation"][j] for r, w in parts) for j in range(len(first["validation"]))
                ],
            }
        )
    return out


def main() -> None:
    ap = parser()
    ap.description = __doc__
    ap.add_argument("--folds", type=int, default=5)
    ap.add_argument("--fold", type=int, action="append", help="train only this fold (repeatable); default: all")
    ap.add_argument("--blend", nargs="+", metavar="DIR=WEIGHT", help="blend finished cross-validations instead")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = pooled()
    folds = assign_folds(rows, args.folds)
    if args.blend:
        report = summarize(rows, folds, blended(args.blend, args.folds), args.out)
        report["blend"] = [{"crossval": folder, "weight": weight} for folder, weight in weighted(args.blend)]
        (args.out / "crossval.json").write_text(json.dumps(report, indent=2) + "\n")
        print(json.dumps(report, indent=2))
        return
    for fold in args.fold if args.fold is not None else range(args.folds):
        if not (args.out / f"fold{fold}.json").is_file():
            run_fold(fold, rows, folds, args)
    done = [args.out / f"fold{f}.json" for f in range(args.folds)]
    if all(p.is_file() for p in done):
        report = summarize(rows, folds, [json.loads(p.read_text()) for p in done], args.out)
        print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
