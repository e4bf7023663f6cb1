"""The field's public prompt-injection benchmarks, read from files on disk into the rows this project scores and
trains on: BIPIA (indirect injection in e-mail, web, table, code and news carriers) and NotInject (benign prompts
full of trigger words). Licences and where the files are: README.md, "Public benchmarks".

BIPIA's samples are built as its own builders (bipia/data/*.py) build them: every context of a split × every attack
of the split's attack file ("{family}-{i}", five per family), the attack inserted at the end, the start, or before a
sentence that a seeded random draw picks (nltk's untrained Punkt finds the sentences, as in BIPIA), each joined by a
newline. The clean contexts are the benign side. The product is large (table's train split alone is 202,500 rows),
so the test builder samples it deterministically.
"""

from __future__ import annotations

import functools
import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

# BIPIA's task names (its "qa" is WebQA over news pages, "abstract" the news summaries) and which attack file each
# task draws from: the code task has its own attacks, the four text tasks share one file.
BIPIA_TASKS = {"email": "text", "qa": "text", "table": "text", "abstract": "text", "code": "code"}
POSITIONS = ("end", "start", "middle")  # BIPIA's order (bipia/data/base.py)
BIPIA_SEED = 2023  # the seed of BIPIA's published runs, which also fixes each context's middle position

SentenceStarts = Callable[[str], list[int]]


def punkt_sentence_starts(text: str) -> list[int]:
    """Where each sentence of `text` starts, by BIPIA's splitter: nltk's Punkt with no trained parameters (needs
    `pip install nltk`, no data download)."""
    from nltk.tokenize.punkt import PunktSentenceTokenizer

    return [start for start, _ in PunktSentenceTokenizer().span_tokenize(text)]


@dataclass(frozen=True)
class Sample:
    """One text to score: an attacked context (label 1) or a clean one (label 0, no family or position)."""

    text: str
    label: int
    task: str
    family: str | None = None
    position: str | None = None
    context: int = 0  # the context's line in its file, from 0


def insert(context: str, attack: str, position: str, seed: int, sentence_starts: SentenceStarts) -> str:
    """`attack` put into `context` where BIPIA puts it. The middle is drawn by a generator seeded afresh for each
    text, as BIPIA does, so a context's middle position is the same for every attack."""
    if position == "end":
        return "\n".join([context, attack])
    if position == "start":
        return "\n".join([attack, context])
    start = random.Random(seed).sample(sentence_starts(context), k=1)[0]
    return "\n".join([context[:start], attack, context[start:]])


def bipia_contexts(bipia: Path, task: str, split: str) -> list[str]:
    """The contexts of `benchmark/{task}/{split}.jsonl` (code's are lists of lines, joined as BIPIA joins them).
    WebQA's and the summaries' files are not in BIPIA's repository: its scripts build them from NewsQA and XSum."""
    path = bipia / "benchmark" / task / f"{split}.jsonl"
    with path.open() as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [("\n".join(r["context"]) if isinstance(r["context"], list) else r["context"]) for r in rows]


def bipia_attacks(bipia: Path, task: str, split: str) -> dict[str, str]:
    """`benchmark/{text|code}_attack_{split}.json` flattened as BIPIA flattens it: "{family}-{i}" → the attack."""
    path = bipia / "benchmark" / f"{BIPIA_TASKS[task]}_attack_{split}.json"
    families = json.loads(path.read_text())
    return {f"{family}-{i}": text for family, texts in families.items() for i, text in enumerate(texts)}


def family_of(attack_name: str) -> str:
    return attack_name.rsplit("-", 1)[0]


def bipia_samples(
    task: str,
    contexts: list[str],
    attacks: dict[str, str],
    limit: int,
    seed: int = BIPIA_SEED,
    sentence_starts: SentenceStarts = punkt_sentence_starts,
) -> list[Sample]:
    """Up to `limit` attacked contexts, a uniform sample (fixed by `seed`) of BIPIA's positions × contexts × attacks
    in BIPIA's order, then up to `limit` clean contexts, the first ones."""
    names = list(attacks)
    starts = functools.lru_cache(maxsize=1024)(sentence_starts)  # a context is split once, not once per attack
    total = len(POSITIONS) * len(contexts) * len(names)
    picked = sorted(random.Random(seed).sample(range(total), k=min(limit, total)))
    samples = []
    for index in picked:
        position, rest = divmod(index, len(contexts) * len(names))
        c, a = divmod(rest, len(names))
        text = insert(contexts[c], attacks[names[a]], POSITIONS[position], seed, starts)
        samples.append(Sample(text, 1, task, family_of(names[a]), POSITIONS[position], c))
    samples += [Sample(text, 0, task, context=c) for c, text in enumerate(contexts[:limit])]
    return samples


def bipia_training_rows(
    bipia: Path,
    tasks: tuple[str, ...] = ("email", "table", "code"),
    seed: int = BIPIA_SEED,
    sentence_starts: SentenceStarts = punkt_sentence_starts,
) -> Iterator[dict]:
    """Every row of BIPIA's train splits in train.py's row format: each attacked context (label 1) and each clean
    one (label 0). An attack's rows share a group (one attack across many carriers stays in one fold), and a
    clean context is its own group. The train attacks (families) differ from the test ones."""
    starts = functools.lru_cache(maxsize=1024)(sentence_starts)
    for task in tasks:
        contexts = bipia_contexts(bipia, task, "train")
        attacks = bipia_attacks(bipia, task, "train")
        for position in POSITIONS:
            for context in contexts:
                for name, attack in attacks.items():
                    text = insert(context, attack, position, seed, starts)
                    yield {"text": text, "label": 1, "source": f"bipia-{task}", "group": f"bipia:{name}"}
        for c, context in enumerate(contexts):
            yield {"text": context, "label": 0, "source": f"bipia-{task}", "group": f"bipia:{task}:{c}"}


@dataclass(frozen=True)
class NotInjectRow:
    text: str
    trigger_words: int  # NotInject's difficulty: 1, 2 or 3 trigger words in a benign prompt
    category: str


def notinject_rows(paths: list[Path]) -> list[NotInjectRow]:
    """NotInject's rows from its JSON files (a list of {"prompt", "word_list", "category"} each, as in the PIGuard
    repository) or JSON-lines files of the same objects; a folder stands for the NotInject_*.json in it."""
    files = [f for p in paths for f in (sorted(p.glob("NotInject_*.json*")) if p.is_dir() else [p])]
    rows = []
    for path in files:
        text = path.read_text()
        objects = json.loads(text) if path.suffix == ".json" else [json.loads(x) for x in text.splitlines() if x]
        rows += [NotInjectRow(o["prompt"], len(o["word_list"]), o["category"]) for o in objects]
    return rows
