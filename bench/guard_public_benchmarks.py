"""The guard on the field's public benchmarks: BIPIA (indirect injection) and NotInject (over-defense).

    PYTHONPATH=/path/to/nltk python -m bench.guard_public_benchmarks \\
        --bipia /path/to/BIPIA --notinject guard_models/data/public/notinject [--limit 1000] [--json out.json]

BIPIA's test samples are built as BIPIA builds them (guard_models/public_data.py): a deterministic sample of
--limit attacked contexts per task (its test contexts × its test attacks × start/middle/end) and the task's clean
test contexts as the benign side. Each context is scored alone, as the gateway scans a retrieved document or a tool
result; the model, windows and threshold are the policy's, scored by the code `portcullis guard score` runs
(--policy, --model, --threshold as there). Printed: per task and per attack family, recall, the FPR on the clean
contexts, F1 and ROC-AUC, recall per insert position, and the recall on the test attacks alone (no carrier: how
PIGuard's evaluation reads BIPIA); for NotInject (every row benign), the share flagged, by number of trigger words
and by category. Tasks whose context files are missing (WebQA and the summaries are built by BIPIA's scripts from
NewsQA and XSum) are skipped with a line saying so. Building the middle position needs nltk (BIPIA's sentence
splitter), which the project does not install: `pip install --target DIR nltk` and put DIR on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

from gateway.guard.cli import add_model_options, score_rows
from gateway.guard.evaluation import metrics
from guard_models.public_data import (
    BIPIA_SEED,
    BIPIA_TASKS,
    NotInjectRow,
    Sample,
    bipia_attacks,
    bipia_contexts,
    bipia_samples,
    notinject_rows,
)


def build_bipia(bipia: Path, limit: int, seed: int) -> list[Sample]:
    samples: list[Sample] = []
    for task in BIPIA_TASKS:
        if not (bipia / "benchmark" / task / "test.jsonl").is_file():
            print(
                f"BIPIA {task}: no benchmark/{task}/test.jsonl (built by BIPIA's own script), skipped", file=sys.stderr
            )
            continue
        samples += bipia_samples(
            task, bipia_contexts(bipia, task, "test"), bipia_attacks(bipia, task, "test"), limit, seed
        )
    return samples


def bipia_attacks_alone(bipia: Path) -> dict[str, list[str]]:
    """Each test attack file's attacks without a carrier, as PIGuard's evaluation reads BIPIA (for comparison)."""
    return {
        kind: list(bipia_attacks(bipia, task, "test").values()) for task, kind in (("email", "text"), ("code", "code"))
    }


def bipia_report(samples: list[Sample], scores: list[float], threshold: float) -> dict:
    """Per task: its attacked contexts against its clean ones. Per family: its attacked contexts against the clean
    contexts of the tasks it was put into. Per position: recall."""
    clean_by_task: dict[str, list[int]] = defaultdict(list)
    attacked: dict[tuple[str, str], list[int]] = defaultdict(list)  # (kind, value) → sample indexes
    for i, s in enumerate(samples):
        if s.label == 0:
            clean_by_task[s.task].append(i)
        else:
            attacked[("task", s.task)].append(i)
            attacked[("family", str(s.family))].append(i)
            attacked[("position", str(s.position))].append(i)

    def figures(positives: list[int]) -> dict:
        tasks = {samples[i].task for i in positives}
        indexes = positives + [i for t in sorted(tasks) for i in clean_by_task[t]]
        m = metrics([samples[i].label for i in indexes], [scores[i] for i in indexes], threshold)
        return {k: m[k] for k in ("positives", "n", "recall", "fpr", "f1", "roc_auc")}

    return {
        kind: {value: figures(idx) for (k, value), idx in sorted(attacked.items()) if k == kind}
        for kind in ("task", "family", "position")
    }


def notinject_report(rows: list[NotInjectRow], scores: list[float], threshold: float) -> dict:
    """Every row is benign: the share flagged, overall, by number of trigger words, then by category."""
    groups: dict[str, list[float]] = defaultdict(list)
    for row, score in sorted(zip(rows, scores), key=lambda pair: (pair[0].trigger_words, pair[0].category)):
        groups["all"].append(score)
        groups[f"{row.trigger_words} trigger word{'s' if row.trigger_words > 1 else ''}"].append(score)
    for row, score in sorted(zip(rows, scores), key=lambda pair: pair[0].category):
        groups[row.category].append(score)
    report = {}
    for group, group_scores in groups.items():
        flagged = sum(score >= threshold for score in group_scores)
        report[group] = {"n": len(group_scores), "flagged": flagged, "share": round(flagged / len(group_scores), 4)}
    return report


def print_table(title: str, rows: dict[str, dict]) -> None:
    columns = list(next(iter(rows.values())))
    print(f"\n{title}\n| | " + " | ".join(columns) + " |\n|---|" + "---:|" * len(columns))
    for name, row in rows.items():
        print(f"| {name} | " + " | ".join("" if row[c] is None else str(row[c]) for c in columns) + " |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bipia", type=Path, help="a checkout of BIPIA's repository (its benchmark/ folder is read)")
    parser.add_argument("--notinject", type=Path, nargs="*", default=[], help="NotInject's files, or their folder")
    parser.add_argument("--limit", type=int, default=1000, help="attacked (and clean) BIPIA contexts per task")
    parser.add_argument("--seed", type=int, default=BIPIA_SEED, help="the sample and BIPIA's middle positions")
    parser.add_argument("--json", type=Path, help="also write the report here")
    add_model_options(parser)
    args = parser.parse_args(argv)
    if not args.bipia and not args.notinject:
        parser.error("give --bipia, --notinject or both")
    samples = build_bipia(args.bipia, args.limit, args.seed) if args.bipia else []
    alone = bipia_attacks_alone(args.bipia) if args.bipia else {}
    notinject = notinject_rows(args.notinject)
    texts = [s.text for s in samples] + [a for attacks in alone.values() for a in attacks] + [r.text for r in notinject]
    args.text_column = "text"
    scores, threshold, model = score_rows(args, [{"text": text} for text in texts])
    report: dict = {"model": str(model.path), "threshold": threshold, "limit": args.limit, "seed": args.seed}
    if samples:
        report["bipia"] = bipia_report(samples, scores[: len(samples)], threshold)
        for kind, rows in report["bipia"].items():
            print_table(f"BIPIA by {kind} (threshold {threshold})", rows)
    done = len(samples)
    if alone:
        report["bipia_attacks_alone"] = {}
        for kind, attacks in alone.items():
            caught = sum(score >= threshold for score in scores[done : done + len(attacks)])
            report["bipia_attacks_alone"][f"{kind} attacks"] = {
                "n": len(attacks),
                "caught": caught,
                "recall": round(caught / len(attacks), 4),
            }
            done += len(attacks)
        print_table(f"BIPIA's test attacks alone, no carrier (threshold {threshold})", report["bipia_attacks_alone"])
    if notinject:
        report["notinject"] = notinject_report(notinject, scores[done:], threshold)
        print_table(f"NotInject, flagged (threshold {threshold})", report["notinject"])
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
