"""guard_models/crossval.py without training: which rows a fold holds out, and the per-group figures over folds."""

from __future__ import annotations

import importlib
import json
import random
import sys
from pathlib import Path

import pytest

from gateway.guard.model import MODELS_DIR

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "guard_models"))  # the scripts import each other so
crossval = importlib.import_module("crossval")

LANGS = ["en", "de", "fr", "ja", "ru", "th", "ar", "pt", "zh", "tr", "de-en", "ru-Latn"]
KINDS = ["email", "web_page", "ticket", "tool_json", "calendar_invite", "chat_log", "code"]


def pooled_rows() -> list[dict]:
    """Rows shaped like train.load_split's and load_written's: public groups, written families in many languages
    and files (one family translated into several languages), carrier documents of several kinds."""
    rng = random.Random(3)
    rows = [
        {"text": f"s{n}", "label": n % 2, "source": source, "group": f"{source[0]}:{n // 2}"}
        for source in ("s-labs", "neuralchemy")
        for n in range(200)
    ]
    for source in ("hard_negatives", "multilingual_attacks", "languages_a"):
        for n in range(120):
            lang = rng.choice(LANGS)
            family = f"inv-{n % 6}" if source == "languages_a" else f"{source}-{n // 3}"
            row = {"text": "t", "label": int(source != "hard_negatives"), "source": source, "group": family}
            rows.append({**row, "lang": lang, "carrier": None})
    for n in range(140):
        kind, lang = KINDS[n % len(KINDS)], rng.choice(LANGS)
        document = {
            "text": "d",
            "source": "carriers",
            "group": f"{kind}-{lang}-{n // 2}",
            "lang": lang,
            "carrier": kind,
        }
        rows.append({**document, "label": n % 2})
    return rows


def folds_of(rows: list[dict], folds: list[int], key: str) -> dict[str, set[int]]:
    out: dict[str, set[int]] = {}
    for row, fold in zip(rows, folds):
        if row.get(key) is not None:
            out.setdefault(row[key], set()).add(fold)
    return out


def test_lang_holds_out_each_language_whole_across_every_written_file() -> None:
    rows = pooled_rows()
    folds = crossval.assign_folds(rows, 5, hold_out="lang")
    written = [(r, f) for r, f in zip(rows, folds) if r["source"] not in crossval.SOURCES]
    by_lang = folds_of([r for r, _ in written], [f for _, f in written], "lang")
    assert set(by_lang) == set(LANGS) and all(len(held) == 1 for held in by_lang.values())
    assert len(set().union(*by_lang.values())) == 5  # twelve languages spread over the five folds
    public = [(r, f) for r, f in zip(rows, folds) if r["source"] in crossval.SOURCES]
    assert all(len(held) == 1 for held in folds_of([r for r, _ in public], [f for _, f in public], "group").values())
    assert {f for _, f in public} == set(range(5))
    # the default cuts by family, so a language (and a translated family's languages) sits on several sides
    default = crossval.assign_folds(rows, 5)
    assert all(len(held) > 1 for held in folds_of(rows, default, "lang").values())
    assert all(len(held) == 1 for held in folds_of(rows, default, "group").values())
    assert crossval.assign_folds(rows, 5, hold_out="family") == default


def test_carrier_holds_out_each_kind_whole_and_the_other_written_rows_by_family() -> None:
    rows = pooled_rows()
    folds = crossval.assign_folds(rows, 5, hold_out="carrier")
    by_kind = folds_of(rows, folds, "carrier")
    assert set(by_kind) == set(KINDS) and all(len(held) == 1 for held in by_kind.values())
    other = [(r, f) for r, f in zip(rows, folds) if not r.get("carrier")]
    assert all(len(held) == 1 for held in folds_of([r for r, _ in other], [f for _, f in other], "group").values())
    assert any(len(held) > 1 for held in folds_of(rows, crossval.assign_folds(rows, 5), "carrier").values())


def test_group_tables_give_each_figure_over_the_folds_whose_labels_define_it() -> None:
    rows = [
        {"label": 1, "lang": "de", "carrier": "email"},  # fold 0: German attacks only, one caught
        {"label": 1, "lang": "de", "carrier": "email"},
        {"label": 0, "lang": "de", "carrier": None},  # fold 1: German benign only, one flagged
        {"label": 0, "lang": "de", "carrier": None},
        {"label": 1, "lang": "fr", "carrier": "email"},  # fold 2: French, both labels
        {"label": 0, "lang": "fr", "carrier": "email"},
        {"label": 0, "lang": None, "carrier": None},  # a public row: in no language's table
    ]
    folds = [0, 0, 1, 1, 2, 2, 2]
    scores = dict(enumerate([0.9, 0.2, 0.7, 0.1, 0.8, 0.3, 0.99]))
    by_lang = crossval.out_of_fold(rows, folds, scores, 0.5, lambda r: r["lang"], crossval.GROUP_FIGURES)
    assert set(by_lang) == {"de", "fr"}
    german = by_lang["de"]
    assert (german["pooled"]["n"], german["pooled"]["positives"]) == (4, 2)
    assert german["spread"] == {
        "recall": {"mean": 0.5, "std": 0.0, "min": 0.5, "max": 0.5},
        "fpr": {"mean": 0.5, "std": 0.0, "min": 0.5, "max": 0.5},
    }  # no fold holds both labels: no F1 over folds
    assert by_lang["fr"]["spread"]["f1"]["mean"] == 1.0 and by_lang["fr"]["spread"]["fpr"]["mean"] == 0.0
    by_kind = crossval.out_of_fold(rows, folds, scores, 0.5, lambda r: r["carrier"], crossval.GROUP_FIGURES)
    assert list(by_kind) == ["email"] and by_kind["email"]["spread"]["recall"]["min"] == 0.5
    assert by_kind["email"]["spread"]["recall"]["max"] == 1.0


def test_folds_scored_under_another_assignment_are_refused() -> None:
    rows = pooled_rows()
    folds = crossval.assign_folds(rows, 5)
    results = [{"fold": f, "held_out": {str(i): 0.0 for i, g in enumerate(folds) if g == f}} for f in range(5)]
    assert crossval.checked(results, folds, "random") == results
    with pytest.raises(SystemExit, match="--hold-out lang"):
        crossval.checked(results, crossval.assign_folds(rows, 5, hold_out="lang"), "lang")


def test_a_blend_of_the_folds_scored_so_far_weighs_each_members_margins(tmp_path: Path) -> None:
    for name, margins in (("minilm", [2.0, -1.0]), ("e5", [4.0, -3.0])):
        (tmp_path / name).mkdir()
        fold = {"fold": 0, "seed": 13, "held_out": {"7": margins[0], "9": margins[1]}, "validation": margins}
        (tmp_path / name / "fold0.json").write_text(json.dumps(fold))
    runs = [f"{tmp_path / 'minilm'}=0.25", f"{tmp_path / 'e5'}=0.75"]
    texts = [f"text {n}" for n in range(10)]
    (blend,) = crossval.blended(runs, [0], texts, texts[:2])  # folds 1-4 not scored: only fold 0 is read
    assert blend["held_out"] == {"7": 3.5, "9": -2.5} and blend["validation"] == [3.5, -2.5]


def test_a_member_weighed_by_its_reading_has_no_say_on_a_script_it_reads_letter_by_letter(tmp_path: Path) -> None:
    """`DIR=WEIGHT@MODEL`: as the gateway's ensemble weighs a member listed with weighed_by_reading."""
    for name, margins in (("minilm", [2.0, -1.0]), ("e5", [4.0, -3.0])):
        (tmp_path / name).mkdir()
        fold = {"fold": 0, "seed": 13, "held_out": {"0": margins[0], "1": margins[1]}, "validation": margins}
        (tmp_path / name / "fold0.json").write_text(json.dumps(fold))
    english = "Please summarise the attached quarterly report for the board."
    russian = "Пожалуйста, кратко изложи приложенный квартальный отчёт для совета."
    runs = [f"{tmp_path / 'minilm'}=0.5@{MODELS_DIR / 'minilm-pi'}", f"{tmp_path / 'e5'}=0.5"]
    (blend,) = crossval.blended(runs, [0], [russian, english], [english, russian])
    assert blend["held_out"]["0"] == pytest.approx(4.0, abs=0.1)  # Russian: about the multilingual member's alone
    assert blend["held_out"]["1"] == pytest.approx(-2.0, abs=0.1)  # English: both, about as configured
    assert blend["validation"] == pytest.approx([3.0, -3.0], abs=0.1)
