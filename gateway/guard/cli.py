"""`portcullis guard …`: judge a classifier on your own traffic before deploying it.

    portcullis guard score < prompts.jsonl            # {"text": ...} per line -> {"score", "label"} per line
    portcullis guard score traffic.csv --text-column prompt
    portcullis guard eval labelled.jsonl        # + F1, precision, recall, FPR, ROC-AUC (label 1 = malicious)
    portcullis guard eval labelled.jsonl --group-column lang --invariance --table   # per language; translations

The model, threshold and windows are the policy's (`--policy`, default policies/), exactly as the gateway scans;
`--model` and `--threshold` override them.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from gateway.guard.evaluation import defined, metrics
from gateway.guard.invariance import invariance

if TYPE_CHECKING:  # the model (and onnxruntime) loads only when a subcommand runs
    from gateway.guard.ensemble import GuardEnsemble
    from gateway.guard.spec import InjectionPolicy


def add_subcommands(commands: argparse._SubParsersAction) -> None:
    guard = commands.add_parser("guard", help="score or evaluate the guard classifier on your own data")
    verbs = guard.add_subparsers(dest="verb", required=True, metavar="VERB")
    score = verbs.add_parser("score", help="score JSON lines from stdin (or a CSV/JSONL file): one JSON line each")
    score.add_argument("file", nargs="?", type=Path, help="CSV or JSONL with a text column (default: stdin JSONL)")
    add_model_options(score)
    score.set_defaults(func=_score)
    evaluate = verbs.add_parser("eval", help="score a labelled CSV/JSONL file and print metrics")
    evaluate.add_argument("file", type=Path)
    evaluate.add_argument("--label-column", default="label", help="1/true/malicious = malicious (default: label)")
    evaluate.add_argument(
        "--group-column",
        help="also report metrics per value of this column (e.g. source, lang, carrier); rows without it are in none",
    )
    evaluate.add_argument(
        "--invariance",
        action="store_true",
        help='also judge translation invariance: rows with "invariance": true, by "family", each with a "lang"',
    )
    evaluate.add_argument("--table", action="store_true", help="print text tables instead of JSON")
    evaluate.add_argument("--scores", type=Path, help="also write the per-row JSON lines here")
    add_model_options(evaluate)
    evaluate.set_defaults(func=_eval)


def add_model_options(parser: argparse.ArgumentParser) -> None:
    """The options that pick the model, threshold and windows as the gateway would (also bench/'s guard runs)."""
    parser.add_argument("--text-column", default="text")
    parser.add_argument("--policy", type=Path, default=Path("policies"), help="policy directory (default: policies)")
    parser.add_argument("--model", type=Path, help="model folder (default: the policy's, else the bundled model)")
    parser.add_argument("--threshold", type=float, help="default: the policy's, else the model card's")
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], help="default: the policy's")
    parser.add_argument("--batch-size", type=int, default=32)


def _setup(args: argparse.Namespace) -> tuple[GuardEnsemble, InjectionPolicy, float]:
    from gateway.guard.ensemble import load_guard
    from gateway.guard.spec import GuardSpec
    from gateway.policy.loader import PolicyError, load_policy_dir

    spec = GuardSpec()
    if args.policy.is_dir():
        try:
            spec = load_policy_dir(args.policy).guard_for(None)
        except PolicyError as exc:
            raise SystemExit(f"portcullis guard: {exc}") from None
    runtime = spec.runtime
    model = load_guard(
        args.model or runtime.model,
        device=args.device or runtime.device,
        precision=runtime.precision,
        threads=runtime.threads,
    )
    threshold = (
        args.threshold
        if args.threshold is not None
        else (spec.injection.threshold if spec.injection.threshold is not None else (model.threshold or 0.5))
    )
    return model, spec.injection, threshold


def read_rows(path: Path | None, text_column: str) -> list[dict]:
    if path is None:
        lines = sys.stdin
    elif path.suffix.lower() in (".csv", ".tsv"):
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f, delimiter="\t" if path.suffix.lower() == ".tsv" else ","))
        _require(rows, text_column, path)
        return rows
    else:
        lines = path.open()
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise SystemExit(f"portcullis guard: {path or 'stdin'}:{number}: not JSON ({exc})") from None
        rows.append(row if isinstance(row, dict) else {text_column: row})
    _require(rows, text_column, path)
    return rows


def _require(rows: list[dict], column: str, path: Path | None) -> None:
    for number, row in enumerate(rows, start=1):
        if not isinstance(row.get(column), str):
            raise SystemExit(f"portcullis guard: {path or 'stdin'}: row {number} has no string {column!r} column")


def score_rows(args: argparse.Namespace, rows: list[dict]) -> tuple[list[float], float, GuardEnsemble]:
    """Each row's score through the policy's model and windows, with the threshold the gateway would apply."""
    model, policy, threshold = _setup(args)
    texts = [row[args.text_column] for row in rows]
    scores: list[float] = []
    for start in range(0, len(texts), 256):
        scores += model.score_texts(texts[start : start + 256], policy.window, policy.overlap, args.batch_size)
    return scores, threshold, model


def _label(model: GuardEnsemble, score: float, threshold: float) -> str:
    malicious = model.labels[model.malicious[0]]
    benign = next(name for i, name in model.labels.items() if i not in model.malicious)
    return malicious if score >= threshold else benign


def _score(args: argparse.Namespace) -> int:
    rows = read_rows(args.file, args.text_column)
    scores, threshold, model = score_rows(args, rows)
    out = sys.stdout
    for row, score in zip(rows, scores):
        out.write(
            json.dumps(
                {
                    **({"id": row["id"]} if "id" in row else {}),
                    "score": round(score, 6),
                    "label": _label(model, score, threshold),
                    "malicious": score >= threshold,
                }
            )
            + "\n"
        )
    return 0


def _truthy(value: object) -> int:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float)):
        return int(value != 0)
    return int(str(value).strip().lower() in ("1", "true", "yes", "malicious", "injection", "jailbreak", "unsafe"))


def _eval(args: argparse.Namespace) -> int:
    rows = read_rows(args.file, args.text_column)
    if any(args.label_column not in row for row in rows):
        raise SystemExit(f"portcullis guard: {args.file}: every row needs a {args.label_column!r} column")
    translations = _invariance_rows(rows, args.file) if args.invariance else []
    scores, threshold, model = score_rows(args, rows)
    labels = [_truthy(row[args.label_column]) for row in rows]
    if args.scores:
        with args.scores.open("w") as f:
            for row, score in zip(rows, scores):
                f.write(
                    json.dumps(
                        {
                            "score": round(score, 6),
                            "label": _label(model, score, threshold),
                            "truth": _truthy(row[args.label_column]),
                        }
                    )
                    + "\n"
                )
    report = {"model": str(model.path), "device": model.device, **metrics(labels, scores, threshold)}
    shipped = shipped_spread(model, threshold)
    if shipped is not None:
        report["crossval"] = shipped
    if args.group_column:
        groups: dict[str, list[int]] = {}
        for i, row in enumerate(rows):
            if row.get(args.group_column) not in (None, ""):
                groups.setdefault(str(row[args.group_column]), []).append(i)
        report["groups"] = {
            g: _defined_figures(metrics([labels[i] for i in idx], [scores[i] for i in idx], threshold))
            for g, idx in sorted(groups.items())
        }
    if args.invariance:
        report["invariance"] = invariance([rows[i] for i in translations], [scores[i] for i in translations], threshold)
    print(_tables(report) if args.table else json.dumps(report, indent=2))
    return 0


def _defined_figures(m: dict) -> dict:
    """A group's metrics without the figures its labels leave meaningless (the FPR of attacks alone, ...), with its
    count of benign rows beside that of attacks (`positives`)."""
    figures = ("f1", "precision", "recall", "fpr", "accuracy", "roc_auc")
    return {**{k: v for k, v in m.items() if k not in figures or defined(k, m)}, "benign": m["n"] - m["positives"]}


def _invariance_rows(rows: list[dict], path: Path) -> list[int]:
    """Indices of the rows marked `"invariance": true`; none, or one without a family or language, is an error: an
    invariance check that silently judged nothing would pass."""
    chosen = [i for i, row in enumerate(rows) if _truthy(row.get("invariance", False))]
    if not chosen:
        raise SystemExit(f'portcullis guard: {path}: --invariance, but no row has "invariance": true')
    for i in chosen:
        if not all(isinstance(rows[i].get(key), str) and rows[i][key] for key in ("family", "lang")):
            raise SystemExit(f'portcullis guard: {path}: invariance row {i + 1} needs a "family" and a "lang"')
    return chosen


def _tables(report: dict) -> str:
    """The report as aligned text: the overall figures, then a line per group and per invariance family."""
    percent = "{:.1%}".format
    lines = [
        f"{report['model']} at threshold {report['threshold']}: {report['n']} rows, {report['positives']} attacks; "
        f"F1 {report['f1']}, recall {report['recall']}, FPR {percent(report['fpr'])}, ROC-AUC {report['roc_auc']}"
    ]
    if "groups" in report:
        table = [["group", "rows", "attacks", "benign", "recall", "FPR", "F1"]]
        for group, m in report["groups"].items():
            fpr = percent(m["fpr"]) if "fpr" in m else ""
            table.append([group, m["n"], m["positives"], m["benign"], m.get("recall", ""), fpr, m.get("f1", "")])
        lines += ["", *_aligned(table)]
    if "invariance" in report:
        table = [["family", "languages", "rows", "caught", "min", "median", "max", "logit sd", "logit range"]]
        for family, f in report["invariance"]["families"].items():
            score, logit = f["score"], f["logit"]
            table.append(
                [family, len(f["languages"]), f["rows"], percent(f["caught"]), score["min"], score["median"]]
                + [score["max"], logit["sd"], logit["range"]]
            )
        band = report["invariance"]["band"]
        lines += ["", *_aligned(table)]
        lines.append(
            f"band: {band['families']} families, {band['rows']} rows, {percent(band['caught'])} caught; every family "
            f"caught in at least {percent(band['lowest_family_caught'])} of its rows, logit sd at most "
            f"{band['widest_family_logit_sd']}"
        )
    return "\n".join(lines)


def _aligned(table: list[list]) -> list[str]:
    widths = [max(len(str(row[c])) for row in table) for c in range(len(table[0]))]
    return [
        "  ".join(str(cell).ljust(w) if c == 0 else str(cell).rjust(w) for c, (cell, w) in enumerate(zip(row, widths)))
        for row in table
    ]


def shipped_spread(model: GuardEnsemble, threshold: float) -> dict | None:
    """The model card's cross-validated figures at its shipped threshold (mean, spread over folds and seeds), for
    comparison with your own data's; None for a folder without crossval.json or when another threshold is used."""
    path = model.folder / "crossval.json"
    if not path.is_file():
        return None
    try:
        chosen = json.loads(path.read_text())
        if chosen["threshold"] != threshold:
            return None
        return {
            "threshold": chosen["threshold"],
            "folds": chosen["folds"],
            "seeds": chosen["seeds"],
            "out_of_fold": {group: figures["spread"] for group, figures in chosen["out_of_fold"].items()},
        }
    except (ValueError, KeyError, TypeError):
        return None
