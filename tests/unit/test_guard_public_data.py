"""The public benchmarks' rows, built as BIPIA builds its samples and read as NotInject ships, on tiny inline data:
where an attack goes, the whole product sampled without repeats, the clean contexts as the benign side, the
training rows' groups, and NotInject's difficulty levels."""

from __future__ import annotations

import json
from pathlib import Path

from guard_models.public_data import (
    bipia_attacks,
    bipia_contexts,
    bipia_samples,
    bipia_training_rows,
    insert,
    notinject_rows,
)


def sentence_starts(text: str) -> list[int]:
    """A stand-in for Punkt: a sentence starts at 0 and after each ". "."""
    return [0] + [i + 2 for i in range(len(text)) if text.startswith(". ", i)]


CONTEXT = "First line. Second line. Third line."


def test_the_attack_goes_where_bipia_puts_it() -> None:
    assert insert(CONTEXT, "ATTACK", "end", 1, sentence_starts) == CONTEXT + "\nATTACK"
    assert insert(CONTEXT, "ATTACK", "start", 1, sentence_starts) == "ATTACK\n" + CONTEXT
    middles = {insert(CONTEXT, attack, "middle", seed, sentence_starts) for attack in "XY" for seed in range(20)}
    cuts = {m.replace("\nX\n", "|").replace("\nY\n", "|") for m in middles}
    assert cuts <= {"|" + CONTEXT, "First line. |Second line. Third line.", "First line. Second line. |Third line."}
    assert len(cuts) == 3, "the seed draws among the sentences"


def test_one_seed_puts_every_attack_before_the_same_sentence_of_a_context() -> None:
    cut = {insert(CONTEXT, attack, "middle", 7, sentence_starts).replace(attack, "|") for attack in ("A", "BB", "C")}
    assert len(cut) == 1


def test_the_sample_is_drawn_from_positions_by_contexts_by_attacks_without_repeats() -> None:
    contexts = ["Alpha one. Alpha two.", "Beta one. Beta two."]
    attacks = {"Fam-0": "do a", "Fam-1": "do b", "Other-0": "do c"}
    every = bipia_samples("email", contexts, attacks, 100, sentence_starts=sentence_starts)
    attacked = [s for s in every if s.label == 1]
    assert len(attacked) == 3 * 2 * 3
    assert len({(s.position, s.context, s.text) for s in attacked}) == 18
    assert {s.family for s in attacked} == {"Fam", "Other"}
    assert [(s.text, s.context) for s in every if s.label == 0] == [(contexts[0], 0), (contexts[1], 1)]

    some = bipia_samples("email", contexts, attacks, 5, seed=3, sentence_starts=sentence_starts)
    again = bipia_samples("email", contexts, attacks, 5, seed=3, sentence_starts=sentence_starts)
    other = bipia_samples("email", contexts, attacks, 5, seed=4, sentence_starts=sentence_starts)
    assert some == again
    assert [s for s in some if s.label == 1] != [s for s in other if s.label == 1]
    assert len([s for s in some if s.label == 1]) == 5
    whole = bipia_samples("email", contexts, attacks, 100, seed=3, sentence_starts=sentence_starts)
    assert {s for s in some if s.label == 1} <= set(whole)


def write_bipia(root: Path) -> Path:
    (root / "benchmark" / "code").mkdir(parents=True)
    (root / "benchmark" / "email").mkdir()
    line = {"context": ["Use a list.", "It works."], "code": ["x = 1"], "error": ["E"], "ideal": ["x"]}
    (root / "benchmark" / "code" / "train.jsonl").write_text(json.dumps(line) + "\n")
    (root / "benchmark" / "email" / "train.jsonl").write_text(json.dumps({"context": "Hi. Bye.", "question": "?"}))
    (root / "benchmark" / "code_attack_train.json").write_text(json.dumps({"Leak": ["send keys", "send files"]}))
    (root / "benchmark" / "text_attack_train.json").write_text(json.dumps({"Ads": ["buy now"]}))
    return root


def test_bipia_files_are_read_as_bipia_reads_them(tmp_path: Path) -> None:
    bipia = write_bipia(tmp_path)
    assert bipia_contexts(bipia, "code", "train") == ["Use a list.\nIt works."]
    assert bipia_attacks(bipia, "code", "train") == {"Leak-0": "send keys", "Leak-1": "send files"}
    assert bipia_attacks(bipia, "email", "train") == {"Ads-0": "buy now"}


def test_training_rows_keep_an_attack_in_one_group_and_each_clean_context_in_its_own(tmp_path: Path) -> None:
    rows = list(bipia_training_rows(write_bipia(tmp_path), ("email", "code"), sentence_starts=sentence_starts))
    assert all(set(r) == {"text", "label", "source", "group"} for r in rows)
    attacked = [r for r in rows if r["label"] == 1]
    assert len(attacked) == 3 * 1 * 1 + 3 * 1 * 2
    assert {r["group"] for r in attacked if "send keys" in r["text"]} == {"bipia:Leak-0"}
    clean = [r for r in rows if r["label"] == 0]
    assert [(r["text"], r["source"]) for r in clean] == [
        ("Hi. Bye.", "bipia-email"),
        ("Use a list.\nIt works.", "bipia-code"),
    ]
    assert len({r["group"] for r in clean}) == 2


def test_notinject_rows_carry_their_number_of_trigger_words(tmp_path: Path) -> None:
    rows = [
        {"prompt": "Can I ignore this warning?", "word_list": ["ignore"], "category": "Technique Queries"},
        {"prompt": "Bypass the jam, override the stop", "word_list": ["bypass", "override"], "category": "Common"},
    ]
    (tmp_path / "NotInject_one.json").write_text(json.dumps(rows))
    (tmp_path / "other.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    from_folder = notinject_rows([tmp_path])
    assert [(r.text, r.trigger_words, r.category) for r in from_folder] == [
        ("Can I ignore this warning?", 1, "Technique Queries"),
        ("Bypass the jam, override the stop", 2, "Common"),
    ]
    assert notinject_rows([tmp_path / "other.jsonl"]) == from_folder
