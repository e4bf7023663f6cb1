"""Indirect-injection rows from guard_models/data/carriers/<kind>.json: documents an assistant reads (e-mails, web
pages, tool output) with and without an instruction aimed at it.

    python -m guard_models.carriers --out /tmp/carriers.jsonl [--split test]   # then `portcullis guard eval` on it

A document with one `{{SLOT}}` becomes two rows of its family that differ only in that slot: benign (the slot holds
the document's `benign_fill`, label 0) and attack (the slot holds an injection of the same kind and language, label
1), so the packaging is never the cue. A document without a slot is one benign row. With `"slot_format":
"json_string"` the fill and the injection are escaped as the inside of a JSON string first (non-ASCII kept as is, so
the text stays in the document's script). train.py's `load_written` adds these rows (source `carriers`), so training
and crossval.py use them like the other written rows.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

CARRIERS = Path(__file__).resolve().parent / "data" / "carriers"
SLOT = "{{SLOT}}"


class CarrierDataError(ValueError):
    """A carrier file that does not follow the format; the message names the file and the entry."""


def split_of(family: str) -> str:
    """data/README.md's rule: a family's split is a pure function of its name, about 40 % test."""
    return "test" if family_hash(family) % 5 < 2 else "train"


def family_hash(family: str) -> int:
    return int(hashlib.sha256(family.encode()).hexdigest(), 16)


def load_carriers(folder: Path = CARRIERS) -> list[dict]:
    """Rows {text, label, category, lang, family, split, carrier, span?} of every carrier file in `folder`, documents in
    file order; none when the folder does not exist.

    A document's injection is chosen by the sha256 of its family modulo the injections of its kind and language on
    its own side of the split (an injection's split is its family's), the same on every run and machine, so no
    injection text is trained on and then tested inside another document. Where its kind has none there, it
    borrows from that language and side in every kind (kinds in file-name order), then from that language on either
    side; a language with none at all is an error."""
    files = {path: _read(path) for path in sorted(folder.glob("*.json"))}
    everywhere: dict[tuple[str, str], list[str]] = {}
    for data in files.values():
        for injection in data["injections"]:
            for side in (split_of(injection["family"]), "any"):
                everywhere.setdefault((injection["lang"], side), []).append(injection["text"])
    rows = []
    for path, data in files.items():
        kind = data["kind"]
        own: dict[tuple[str, str], list[str]] = {}
        for injection in data["injections"]:
            own.setdefault((injection["lang"], split_of(injection["family"])), []).append(injection["text"])
        for index, document in enumerate(data["documents"]):
            if SLOT not in document["text"]:
                rows.append(_row(kind, document, document["text"], 0))
                continue
            side = (document["lang"], split_of(document["family"]))
            pool = own.get(side) or everywhere.get(side) or everywhere.get((document["lang"], "any"))
            if not pool:
                raise CarrierDataError(
                    f"{path}: documents[{index}]: no injection in language {document['lang']!r} in any kind"
                )
            injection = pool[family_hash(document["family"]) % len(pool)]
            escape = _json_string if document.get("slot_format") == "json_string" else str
            head, tail = document["text"].split(SLOT)
            for label, fill in ((0, escape(document["benign_fill"])), (1, escape(injection))):
                span = (len(head), len(head) + len(fill))
                rows.append(_row(kind, document, head + fill + tail, label, span))
    return rows


def _row(kind: str, document: dict, text: str, label: int, span: tuple[int, int] | None = None) -> dict:
    """A row; `span`, the character offsets of what fills the slot, lets the trainer keep that sentence in the
    window it trains a long document on."""
    return {
        "text": text,
        "label": label,
        "category": "carrier_" + kind,
        "lang": document["lang"],
        "family": document["family"],
        "split": split_of(document["family"]),
        "carrier": kind,
        **({"span": span} if span else {}),
    }


def _json_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)[1:-1]


def _read(path: Path) -> dict:
    """The parsed file, every entry checked; CarrierDataError names the file and the entry's index."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise CarrierDataError(f"{path}: not JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("kind") != path.stem:
        raise CarrierDataError(f'{path}: needs an object whose "kind" is the file\'s name, {path.stem!r}')
    for key in ("documents", "injections"):
        if not isinstance(data.get(key), list):
            raise CarrierDataError(f"{path}: needs a {key!r} list")
        for index, entry in enumerate(data[key]):
            where = f"{path}: {key}[{index}]"
            if not isinstance(entry, dict):
                raise CarrierDataError(f"{where}: not an object")
            for field in ("family", "lang", "text"):
                if not isinstance(entry.get(field), str) or not entry[field].strip():
                    raise CarrierDataError(f"{where}: needs a non-empty string {field!r}")
            slots = entry["text"].count(SLOT)
            if key == "injections" and slots:
                raise CarrierDataError(f"{where}: an injection holds no {SLOT}")
            if key == "documents":
                _check_document(entry, slots, where)
    return data


def _check_document(document: dict, slots: int, where: str) -> None:
    if slots > 1:
        raise CarrierDataError(f"{where}: {slots} {SLOT} in the text; a document holds exactly one, or none")
    fill = document.get("benign_fill")
    if slots and (not isinstance(fill, str) or not fill.strip()):
        raise CarrierDataError(f"{where}: a document with {SLOT} needs a non-empty string 'benign_fill'")
    if not slots and ("benign_fill" in document or "slot_format" in document):
        raise CarrierDataError(f"{where}: 'benign_fill' or 'slot_format' without a {SLOT} in the text")
    if document.get("slot_format", "json_string") != "json_string":
        raise CarrierDataError(f"{where}: 'slot_format' can only be \"json_string\"")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="JSON lines, one row each")
    ap.add_argument("--folder", type=Path, default=CARRIERS)
    ap.add_argument("--split", choices=["train", "test"], help="only this split's rows (default: both)")
    args = ap.parse_args()
    try:
        rows = load_carriers(args.folder)
    except CarrierDataError as exc:
        raise SystemExit(f"guard_models.carriers: {exc}") from None
    rows = [r for r in rows if args.split in (None, r["split"])]
    with args.out.open("w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    print(f"{len(rows)} rows ({sum(r['label'] for r in rows)} attacks) -> {args.out}")


if __name__ == "__main__":
    main()
