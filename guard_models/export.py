"""Export a trained checkpoint to ONNX (fp32 + int8 dynamic quantization) with the calibration and threshold that
crossval.py chose, and report the exported int8 model (what the CPU serves) on data it never trained on.

    .bench/guard-train/venv/bin/python guard_models/export.py --checkpoint .bench/guard-train/run/epoch2 \
        --crossval .bench/guard-train/cv/crossval.json --out guard_models/minilm-pi [--fp16]

The int8 file is the committed one; model.onnx (fp32) stays under --work. config.json gets `portcullis.calibration`
and `portcullis.threshold`; crossval.json is copied beside it (the spread the threshold came with, which
`portcullis guard eval` prints); validation.json holds the figures at that threshold on the validation splits and on
the test part of guard_models/data/ (never trained on, never used to choose anything).

`--q4-word-embeddings` stores the token-embedding table as 4-bit blocks of 32 with an fp16 scale (onnxruntime's
GatherBlockQuantized) instead of int8: for multilingual-e5's 250k-piece table, 54 MB instead of 96 MB, and exact
when the table was frozen in training, since it came from such blocks (import_multilingual_e5.py).

An ensemble folder (gateway/guard/ensemble.py) is written with `--members minilm-pi=0.5 e5-pi=0.5` instead of
`--checkpoint`: its config.json lists the member folders (beside --out) and carries the calibration and threshold
of `crossval.py --blend`'s report, and lists with `weighed_by_reading` each member that blend weighed by its
vocabulary's reading of each text (`DIR=WEIGHT@MODEL`). `--screen e5-screen-pi=0 --screen-top 8` adds the screening
model that reads long texts first, the margin above which its windows go to the members and how many of its
highest-scoring ones always do (`bench/long_scan_bench.py recall` measures a choice).
A screen is exported like a member (`--checkpoint`) without `--crossval`: nothing reads its calibration or
threshold, and its validation.json reports it at 0.5 uncalibrated.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def q4_blocks(table: np.ndarray, block: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric 4-bit codes (-8..7) and an fp16 scale per block of `block` values along each row. The scale is the
    block's largest-magnitude value over -8, as in GGML's Q4_0, so a table that came from Q4_0 round-trips exactly."""
    rows, cols = table.shape
    blocks = table.reshape(rows, cols // block, block)
    extreme = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=-1)[..., None], -1)[..., 0]
    scale = (extreme / -8.0).astype(np.float16)
    divisor = np.where(scale == 0, 1, scale).astype(np.float32)[..., None]
    codes = np.clip(np.rint(blocks / divisor), -8, 7).astype(np.int8)
    return codes.reshape(rows, cols), scale


def quantize_word_embeddings(path: Path) -> None:
    """Replace the ONNX graph's token-embedding Gather by a GatherBlockQuantized over 4-bit blocks (in place)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    model = onnx.load(str(path))
    graph = model.graph
    initializers = {i.name: i for i in graph.initializer}
    node = next(n for n in graph.node if n.op_type == "Gather" and "word_embeddings" in n.input[0])
    table = numpy_helper.to_array(initializers[node.input[0]]).astype(np.float32)
    codes, scale = q4_blocks(table)
    nibbles = (codes.astype(np.uint8) & 0x0F).reshape(codes.shape[0], -1, 2)
    packed = nibbles[..., 0] | (nibbles[..., 1] << 4)  # element 2i in the low nibble, as ONNX packs int4
    data = helper.make_tensor(node.input[0] + "_q4", TensorProto.INT4, table.shape, packed.tobytes(), raw=True)
    scales = numpy_helper.from_array(scale, node.input[0] + "_scales")
    graph.initializer.remove(initializers[node.input[0]])
    graph.initializer.extend([data, scales])
    half = node.output[0] + "_fp16"
    at = list(graph.node).index(node)
    graph.node.remove(node)
    graph.node.insert(at, helper.make_node("Cast", [half], [node.output[0]], to=TensorProto.FLOAT))
    graph.node.insert(
        at,
        helper.make_node(
            "GatherBlockQuantized",
            [data.name, node.input[1], scales.name],
            [half],
            domain="com.microsoft",
            gather_axis=0,
            quantize_axis=1,
            block_size=32,
        ),
    )
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    onnx.save(model, str(path))


def export(
    checkpoint: Path, out: Path, work: Path, fp16: bool, max_length: int, q4_embeddings: bool, name: str
) -> None:
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
    source = fp32
    if q4_embeddings:
        source = work / "model_q4_embeddings.onnx"
        shutil.copy(fp32, source)
        quantize_word_embeddings(source)
    quantize_dynamic(str(source), str(out / "model_int8.onnx"), weight_type=QuantType.QInt8, per_channel=True)
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
        "name": name,
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


def sibling(out: Path, option: str, pair: str) -> tuple[str, float]:
    """FOLDER=NUMBER of a command-line option, FOLDER a model folder beside `out`."""
    folder, _, number = pair.partition("=")
    if not (out.parent / folder / "config.json").is_file():
        raise SystemExit(f"{option}: {out.parent / folder} is not a model folder")
    try:
        return f"../{folder}", float(number)
    except ValueError:
        raise SystemExit(f"{option}: {pair!r} is not FOLDER=NUMBER") from None


def write_ensemble(
    out: Path, members: list[str], name: str, crossval: Path, screen: str | None, screen_top: int
) -> None:
    """An ensemble folder's config.json: member folders (siblings of `out`) and their weights, which must be the
    weights of the blend that crossval.json was made for, each member weighed by its reading where that blend's was,
    and the screening model with its margin."""
    listed = []
    for member in members:
        folder, weight = sibling(out, "--members", member)
        listed.append({"model": folder, "weight": weight})
    blend = json.loads(crossval.read_text()).get("blend", [])
    if [b["weight"] for b in blend] != [m["weight"] for m in listed]:
        raise SystemExit(
            f"--members: weights {[m['weight'] for m in listed]}, but {crossval} is for a blend of "
            f"{[b['weight'] for b in blend]}"
        )
    for entry, made in zip(listed, blend):
        if made.get("weighed_by_reading"):
            entry["weighed_by_reading"] = True
    out.mkdir(parents=True, exist_ok=True)
    config: dict = {"portcullis": {"name": name, "members": listed}}
    if screen:
        folder, margin = sibling(out, "--screen", screen)
        config["portcullis"]["screen"] = {"model": folder, "margin": margin, "top": screen_top}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def validate(out: Path) -> dict:
    from train import load_split, load_written

    from gateway.guard.ensemble import load_guard
    from gateway.guard.evaluation import metrics

    model = load_guard(out, device="cpu", precision="int8")
    rows = load_split("validation") + load_written("test")
    started = time.perf_counter()
    scores = model.score_texts([r["text"] for r in rows], window=model.max_length, stride=32)
    elapsed = time.perf_counter() - started
    report: dict = {"model": model.path.name, "threshold": model.threshold, "seconds": round(elapsed, 1)}
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
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--checkpoint", type=Path)
    what.add_argument("--members", nargs="+", metavar="FOLDER=WEIGHT", help="write an ensemble folder instead")
    ap.add_argument("--screen", metavar="FOLDER=MARGIN", help="with --members: the screening model of long texts")
    ap.add_argument("--screen-top", type=int, default=8, help="the screen's windows the members always read")
    ap.add_argument("--crossval", type=Path, help="crossval.py's crossval.json (not for a screen)")
    ap.add_argument("--out", type=Path, default=ROOT / "guard_models" / "minilm-pi")
    ap.add_argument("--work", type=Path, default=ROOT / ".bench" / "guard-train" / "export")
    ap.add_argument("--fp16", action="store_true", help="also write model_fp16.onnx (GPU) under --work")
    ap.add_argument("--max-length", type=int, default=128, help="the window the model was fine-tuned on")
    ap.add_argument("--q4-word-embeddings", action="store_true", help="4-bit token embeddings (see above)")
    ap.add_argument("--name", help="the model card's name in config.json (default: portcullis-guard-<out's name>)")
    args = ap.parse_args()
    name = args.name or f"portcullis-guard-{args.out.name}"
    if args.members:
        if not args.crossval:
            ap.error("--members needs --crossval: the blend's calibration and threshold")
        write_ensemble(args.out, args.members, name, args.crossval, args.screen, args.screen_top)
    else:
        export(args.checkpoint, args.out, args.work, args.fp16, args.max_length, args.q4_word_embeddings, name)
    if args.crossval:
        ship(args.out, args.crossval)
    print(json.dumps(validate(args.out), indent=2))


if __name__ == "__main__":
    main()
