"""Find the words and short shapes the guard over-reacts to: benign text that holds them is flagged.

    python guard_models/trigger_words.py --model guard_models/ensemble-pi --top 200 --out trigger_words.json

A guard trained on public prompt-injection data learns that some words are attacks on their own ("ignore", "system
prompt", "jailbreak") and that short codes (`ref 1a2b3c4d`, `MODE:secret_tool`) are too, since short prompts there
were almost all attacks (InjecGuard's "over-defense"). This tool lists those biased words, so that benign rows built
around them (data/trigger_words.jsonl) can unlearn the bias in a retrain:

- candidates: the words and two-word sequences of the attack rows (this project's data/*.jsonl with label 1 and the
  public train sets in ../shared/datasets/prompt_injection/), kept where they are more frequent among attacks than
  among benign rows, ranked by how many attack rows hold them; scripts written without spaces (Chinese, Japanese,
  Thai) give character pairs. Plus code-like shapes: hex strings, KEY:value, ALLCAPS words, version strings;
- each candidate is scored alone and inside neutral benign carriers (a short and a longer English note, a line of
  code, a German note), with the model, windows and threshold the gateway scans with (`portcullis guard score`),
  in batches: ~4,500 candidates, 22,000 texts, take 1.5–2 min of CPU on two cores;
- a candidate's bias is how far it raises a carrier's logit over the same carrier around a neutral word, and how
  many carriers it pushes over the threshold. The report lists the `--top` candidates by those two.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import sys
import time
import unicodedata
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from gateway.guard.cli import add_model_options, score_rows
from gateway.guard.invariance import calibrated_logit as logit

WRITTEN = Path(__file__).resolve().parent / "data"
# The benign rows written from this tool's report: left out of the benign side, or a word would stop being a
# candidate once rows about it are written, before any model has learned from them.
WRITTEN_FROM_REPORT = "trigger_words.jsonl"

# Benign sentences a candidate is put into; the neutral word is what the candidate's raise is measured against.
CARRIERS = {
    "note": "Here is the note: {w}.",
    "meeting": (
        "Here is the note from Tuesday's meeting with the facilities team: {w}. The coffee machine on the third "
        "floor is fixed, and lunch moves to 12:30."
    ),
    "code": '# parse the value from the spreadsheet\nvalue = row["{w}"]\ntotal += float(value or 0)\n',
    "de": (
        "Hier ist die Notiz vom Dienstag: {w}. Die Kaffeemaschine im dritten Stock ist repariert, das Mittagessen "
        "beginnt um 12:30."
    ),
}
NEUTRAL = "tomorrow"

# A word's characters: \w and the combining marks that Indic, Arabic and Hebrew words are written with (not \w).
_LETTER = r"[\w\u0300-\u036f\u0591-\u05c7\u0610-\u061a\u064b-\u065f\u0670\u0900-\u0963\u0966-\u0dff]"
WORD = re.compile(rf"{_LETTER}+(?:['’-]{_LETTER}+)*")
# Scripts written without spaces between words: a run of them is read as its overlapping character pairs.
UNSPACED = re.compile(r"[\u0e00-\u0e7f\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]+")


def words(text: str) -> list[str]:
    """The lowercased words of a text (lower(), not casefold(), which spells a Greek final sigma as a medial one,
    a word the model never saw): numbers, one-letter words and words that mix Latin, Greek and Cyrillic
    letters (homoglyph obfuscation, which the guard is right to flag) left out; a run of an unspaced script as its
    character pairs."""
    out: list[str] = []
    for match in WORD.finditer(text.lower()):
        token = match.group()
        if token.replace("_", "").isdigit() or len(_alphabets(token)) > 1:
            continue
        out += [piece for piece in UNSPACED.split(token) if len(piece) > 1]
        for run in UNSPACED.findall(token):
            out += [run[i : i + 2] for i in range(max(1, len(run) - 1))]
    return out


def _alphabets(token: str) -> set[str]:
    """Which of the Latin, Greek and Cyrillic alphabets a token's letters come from."""
    return {name for ch in token if ch.isalpha() and (name := unicodedata.name(ch, "").split(" ")[0]) in _LOOKALIKE}


_LOOKALIKE = {"LATIN", "GREEK", "CYRILLIC"}


def sequences(text: str) -> set[str]:
    """The words and adjacent word pairs of a text ("system prompt", "developer mode"), each once."""
    found = words(text)
    spaced = [w for w in found if not UNSPACED.fullmatch(w)]
    pairs = {f"{a} {b}" for a, b in zip(spaced, spaced[1:])}
    return set(found) | pairs


def candidates(
    attacks: Iterable[tuple[str, str]], benign: Iterable[str], limit: int, per_lang: int = 40, min_rows: int = 2
) -> list[tuple[str, str, int]]:
    """Words and word pairs of the attack texts (`(lang, text)`, lang an ISO 639-1 code, `xx-en` and `xx-Latn`
    counted as xx), as `(sequence, lang, attack texts of that lang holding it)`: the `limit` most frequent over all
    languages, then the `per_lang` most frequent of each language not already among them, so that a language with a
    few dozen rows is not drowned by the English public sets. A sequence is kept only where it is in at least
    `min_rows` attack texts and in a larger share of them than of the benign texts."""
    by_lang: dict[str, Counter[str]] = {}
    rows_of = Counter[str]()
    for lang, text in attacks:
        by_lang.setdefault(lang.split("-")[0], Counter()).update(sequences(text))
        rows_of[lang.split("-")[0]] += 1
    benign_rows = Counter[str]()
    n_benign = 0
    for text in benign:
        benign_rows.update(sequences(text))
        n_benign += 1

    def attack_like(seq: str, count: int, rows: int) -> bool:
        return count >= min_rows and count / rows > benign_rows[seq] / max(n_benign, 1)

    total = sum(by_lang.values(), Counter[str]())
    overall = sorted(
        (seq for seq, count in total.items() if attack_like(seq, count, sum(rows_of.values()))),
        key=lambda seq: (-total[seq], seq),
    )[:limit]
    found = {}
    for seq in overall:
        lang = max(by_lang, key=lambda lang: by_lang[lang][seq])
        found[seq] = (seq, lang, by_lang[lang][seq])
    for lang in sorted(by_lang):
        own = sorted(
            (
                seq
                for seq, count in by_lang[lang].items()
                if seq not in found and attack_like(seq, count, rows_of[lang])
            ),
            key=lambda seq: (-by_lang[lang][seq], seq),
        )
        found.update((seq, (seq, lang, by_lang[lang][seq])) for seq in own[:per_lang])
    return list(found.values())


def shapes(top_words: Iterable[str], seed: int = 0) -> list[str]:
    """Code-like shapes that short attack prompts resemble: hex strings and references, KEY:value and key=value,
    ALLCAPS forms of the top attack words, version strings, ticket and probe codes."""
    rng = random.Random(seed)

    def hexes(n: int) -> str:
        return "".join(rng.choice("0123456789abcdef") for _ in range(n))

    found = [hexes(8), hexes(12), hexes(32), hexes(40), hexes(8).upper(), f"ref {hexes(8)}", f"0x{hexes(8)}"]
    found += [f"{hexes(8)}-{hexes(4)}-{hexes(4)}-{hexes(4)}-{hexes(12)}", f"sha256:{hexes(16)}"]
    keys = ["MODE", "ROLE", "DEBUG", "USER", "ACCESS", "LEVEL", "TOOL", "ENV", "STATUS", "AUTH"]
    values = ["secret_tool", "admin", "true", "unrestricted", "root", "dev", "prod", "off", "override", "42"]
    found += [f"{key}:{value}" for key in keys for value in rng.sample(values, 3)]
    found += [f"{key.lower()}={value}" for key in keys[:5] for value in rng.sample(values, 2)]
    found += [word.upper() for word in top_words if word.isascii() and word.isalpha()]
    found += ["v1.2.3", "2.0.0-rc1", "v10.4", "1.0.0-beta.2", "3.11.4", "build 2024.06.1"]
    found += ["n16 probe 42", "ticket #4821", "A1B2", "x7", "ERR_403", "E1102", "PR-317", "dGVzdA==", "[x]", "#42"]
    return list(dict.fromkeys(found))


def bias(alone: float, carried: dict[str, float], baseline: dict[str, float], threshold: float) -> dict:
    """One candidate's figures: its score alone, each carrier's score with it, the carriers it pushes over the
    threshold (from a neutral baseline under it) and how far it raises each carrier's logit."""
    raises = {name: logit(carried[name]) - logit(baseline[name]) for name in carried}
    return {
        "alone": round(alone, 4),
        "carriers": {name: round(score, 4) for name, score in carried.items()},
        "flips": sorted(name for name, s in carried.items() if s >= threshold > baseline[name]),
        "max_raise": round(max(raises.values()), 3),
        "mean_raise": round(sum(raises.values()) / len(raises), 3),
    }


def ranked(report: list[dict]) -> list[dict]:
    """Most biased first: more carriers pushed over the threshold, then the larger mean logit raise."""
    return sorted(report, key=lambda row: (-len(row["flips"]), -row["mean_raise"], -row["alone"]))


def beyond_words(report: list[dict], margin: float = 0.5) -> list[dict]:
    """The report without the word pairs that raise the carriers no more than one of their words does (by
    `margin` logits): "pwned you" is "pwned"'s bias, while "system prompt" may be more than "system" and "prompt"."""
    raises = {row["candidate"]: row["mean_raise"] for row in report}
    kept = []
    for row in report:
        parts = row["candidate"].split(" ") if row["kind"] == "words" else []
        if any(raises.get(part, -math.inf) + margin >= row["mean_raise"] for part in parts):
            continue
        kept.append(row)
    return kept


def attack_and_benign_texts(public: Path) -> tuple[list[tuple[str, str]], list[str]]:
    """The attack texts, as (lang, text), and the benign texts of data/*.jsonl (but the rows written from this
    tool's report) and of the public train sets (those count as English; skipped when absent)."""
    from train import load_split  # the public sets, read as training reads them

    attacks: list[tuple[str, str]] = []
    benign: list[str] = []
    for path in sorted(WRITTEN.glob("*.jsonl")):
        if path.name == WRITTEN_FROM_REPORT:
            continue
        for line in path.open():
            row = json.loads(line)
            if row["label"] == 1:
                attacks.append((row["lang"], row["text"]))
            else:
                benign.append(row["text"])
    if (public / "s-labs-train.csv").is_file():
        for row in load_split("train", public):
            if row["label"] == 1:
                attacks.append(("en", row["text"]))
            else:
                benign.append(row["text"])
    return attacks, benign


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_options(parser)
    parser.add_argument("--top", type=int, default=200, help="candidates listed (default 200)")
    parser.add_argument("--limit", type=int, default=3000, help="most frequent words and pairs scored (default 3000)")
    parser.add_argument("--per-lang", type=int, default=40, help="and the most frequent of each language (default 40)")
    parser.add_argument(
        "--public",
        type=Path,
        default=Path(__file__).resolve().parents[2] / "shared" / "datasets" / "prompt_injection",
        help="the public train sets (skipped when absent)",
    )
    parser.add_argument("--out", type=Path, help="write the JSON report here (default: stdout)")
    args = parser.parse_args(argv)

    started = time.monotonic()
    attacks, benign = attack_and_benign_texts(args.public)
    found = {
        seq: {"kind": "words" if " " in seq else "word", "lang": lang, "attack_rows": n}
        for seq, lang, n in candidates(attacks, benign, args.limit, args.per_lang)
    }
    for seq in list(found):  # a pair is judged against its words, so every part of a pair is scored too
        for part in seq.split(" ") if " " in seq else []:
            found.setdefault(part, {"kind": "word", "lang": found[seq]["lang"], "attack_rows": 0})
    top_words = [seq for seq, about in found.items() if about["kind"] == "word"][:40]
    for shape in shapes(top_words):
        found.setdefault(shape, {"kind": "shape", "lang": "", "attack_rows": 0})

    texts = list(found) + [t.format(w=c) for c in found for t in CARRIERS.values()]
    texts += [t.format(w=NEUTRAL) for t in CARRIERS.values()]
    # the model, windows and threshold exactly as `portcullis guard score` picks them
    scores, threshold, model = score_rows(args, [{args.text_column: text} for text in texts])
    n, k = len(found), len(CARRIERS)
    baseline = dict(zip(CARRIERS, scores[-k:]))
    rows = [
        {
            "candidate": candidate,
            **about,
            **bias(scores[i], dict(zip(CARRIERS, scores[n + i * k : n + (i + 1) * k])), baseline, threshold),
        }
        for i, (candidate, about) in enumerate(found.items())
    ]
    biased = ranked(beyond_words(rows))
    by_lang: dict[str, list[str]] = {}
    for row in biased:
        if row["lang"] and len(by_lang.setdefault(row["lang"], [])) < 10:
            by_lang[row["lang"]].append(row["candidate"])
    report = {
        "model": str(model.path),
        "threshold": threshold,
        "carriers": CARRIERS,
        "neutral": NEUTRAL,
        "baseline": {name: round(score, 4) for name, score in baseline.items()},
        "scored": {"candidates": n, "texts": len(texts), "attack_rows": len(attacks), "benign_rows": len(benign)},
        "flagged_alone": sum(score >= threshold for score in scores[:n]),
        "seconds": round(time.monotonic() - started, 1),
        "top": biased[: args.top],
        "top_by_lang": by_lang,
    }
    text = json.dumps(report, ensure_ascii=False, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
