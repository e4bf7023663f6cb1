"""Load a Hugging Face Llama folder: config.json + model.safetensors (or shards) + tokenizer.json.

The safetensors header is parsed directly so BF16 (which numpy lacks) can be widened to float32:
a bfloat16 is the top half of a float32.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from backend_engine.model.llama import LlamaConfig

_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64}


def read_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """All tensors of one file as float32 numpy arrays."""
    path = Path(path)
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    raw = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n)
    out: dict[str, np.ndarray] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dt = info["dtype"]
        if dt not in _DTYPES:
            raise ValueError(f"{path}: tensor {name} has unsupported dtype {dt}")
        a, b = info["data_offsets"]
        arr = raw[a:b].view(_DTYPES[dt]).reshape(info["shape"])
        if dt == "BF16":
            arr = (arr.astype(np.uint32) << 16).view(np.float32)
        out[name] = np.asarray(arr, dtype=np.float32)
    return out


def write_safetensors(path: str | Path, tensors: dict[str, np.ndarray]) -> None:
    """Write float32 tensors (used by tests to build a checkpoint folder)."""
    header, offset, blobs = {}, 0, []
    for name, arr in tensors.items():
        b = np.ascontiguousarray(arr, dtype=np.float32).tobytes()
        header[name] = {"dtype": "F32", "shape": list(arr.shape), "data_offsets": [offset, offset + len(b)]}
        offset += len(b)
        blobs.append(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with Path(path).open("wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def config_from_hf(cfg: dict) -> LlamaConfig:
    if cfg.get("model_type", "llama") not in ("llama", "mistral"):
        raise ValueError(f"unsupported model_type {cfg.get('model_type')!r}")
    heads = cfg["num_attention_heads"]
    return LlamaConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads", heads),
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rope_theta=float(cfg.get("rope_theta", 10000.0)),
        rms_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        max_position=int(cfg.get("max_position_embeddings", 4096)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rope_scaling=cfg.get("rope_scaling"),
    )


def load_safetensors_dir(folder: str | Path) -> tuple[LlamaConfig, dict[str, np.ndarray]]:
    folder = Path(folder)
    cfg = config_from_hf(json.loads((folder / "config.json").read_text()))
    index = folder / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    )
    tensors: dict[str, np.ndarray] = {}
    for fn in files:
        tensors.update(read_safetensors(folder / fn))
    return cfg, tensors
