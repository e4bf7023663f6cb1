"""Export a trained checkpoint to ONNX (fp32 + int8 dynamic quantization) with the calibration and threshold that
crossval.py chose, and report the exported int8 model (what the CPU serves) on data it never trained on.

    .bench/guard-train/venv/bin/python guard_models/export.py --checkpoint .bench/guard-train/run/epoch2 \
        --crossval .bench/guard-train/cv/crossval.json --out guard_models/minilm-pi [--fp16]

The int8 file is the committed one; model.onnx (fp32) stays under --work. config.json gets `portcullis.calibration`
and `portcullis.threshold`; crossval.json is copied beside it (the spread the threshold came with, which
`portcullis guard eval` prints); validation.json holds the figures at that threshold on the validation splits and on
the test part of guard_models/data/ (never trained on, never used to choose anything).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def export(checkpoint: Path, out: Path, work: Path, fp16: bool, max_length: int) -> None:
    import torch
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from train import base_model_dir
    from transformers import BertForSequenceClassification

    model = BertForSequenceClassification.from_pretrained(str(checkpoint), attn_implementation="eager").eval()
    work.mkdir(parents=True, exist_ok=True)
    fp32 = work / "model.onnx"
    ids = torch.ones((2, 16), dtype=torch.long)
    with torch.no_grad():
        torch.onnx.export(
            model,
            (ids, torch.ones_like(ids), torch.zeros_like(ids)),
            str(fp32),
            input_names=["input_ids", "attention_mask", "token_type_ids"],
            output_names=["logits"],
            dynamic_axes={n: {0: "batch", 1: "sequence"} for n in ("input_ids", "attention_mask", "token_type_ids")}
            | {"logits": {0: "batch"}},
            opset_version=17,
            dynamo=False,
        )
    out.mkdir(parents=True, exist_ok=True)
    quantize_dynamic(str(fp32), str(out / "model_int8.onnx"), weight_type=QuantType.QInt8, per_channel=True)
    if fp16:
        import onnx
        from onnxruntime.transformers.float16 import convert_float_to_float16

        half = convert_float_to_float16(onnx.load(str(fp32)), keep_io_types=True)
        onnx.save(half, str(work / "model_fp16.onnx"))
    shutil.copy(base_model_dir() / "tokenizer.json", out / "tokenizer.json")
    config = json.loads((checkpoint / "config.json").read_text())
    keep = (
        "architectures",
        "model_type",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "max_position_embeddings",
        "vocab_size",
        "pad_token_id",
        "id2label",
        "label2id",
    )
    config = {k: config[k] for k in keep if k in config}
    config["portcullis"] = {
        "name": "portcullis-guard-minilm-pi",
        "max_length": max_length,
        "malicious_labels": ["INJECTION"],
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def ship(out: Path, crossval: Path) -> None:
    """Write the cross-validated calibration and threshold into config.json, and the whole report beside it."""
    chosen = json.loads(crossval.read_text())
    config = json.loads((out / "config.json").read_text())
    config["portcullis"]["calibration"] = chosen["calibration"]
    config["portcullis"]["threshold"] = chosen["threshold"]
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    shutil.copy(crossval, out / "crossval.json")


def validate(out: Path) -> dict:
    from train import load_split, load_written

    from gateway.guard.evaluation import metrics
    from gateway.guard.model import load_model

    model = load_model(out, device="cpu", precision="int8")
    rows = load_split("validation") + load_written("test")
    started = time.perf_counter()
    scores = model.score_texts([r["text"] for r in rows], window=model.max_length, stride=32)
    elapsed = time.perf_counter() - started
    report: dict = {"model": "model_int8.onnx", "threshold": model.threshold, "seconds": round(elapsed, 1)}
    report["sources"] = {
        source: metrics(
            [r["label"] for r in rows if r["source"] == source],
            [s for r, s in zip(rows, scores) if r["source"] == source],
            model.threshold or 0.5,
        )
        for source in sorted({r["source"] for r in rows})
    }
    (out / "validation.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, required=True)
    ap.add_argument("--crossval", type=Path, required=True, help="crossval.py's crossval.json")
    ap.add_argument("--out", type=Path, default=ROOT / "guard_models" / "minilm-pi")
    ap.add_argument("--work", type=Path, default=ROOT / ".bench" / "guard-train" / "export")
    ap.add_argument("--fp16", action="store_true", help="also write model_fp16.onnx (GPU) under --work")
    ap.add_argument("--max-length", type=int, default=128, help="the window the model was fine-tuned on")
    args = ap.parse_args()
    export(args.checkpoint, args.out, args.work, args.fp16, args.max_length)
    ship(args.out, args.crossval)
    print(json.dumps(validate(args.out), indent=2))


if __name__ == "__main__":
    main()
