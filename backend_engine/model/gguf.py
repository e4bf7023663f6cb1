"""Load a Llama-family GGUF: metadata, tokenizer fields and dequantized float32 tensors.

The `gguf` package's numpy routines dequantize Q4_0/Q4_1/Q8_0/F16/F32 (and more). Tensors are
renamed to Hugging Face names so both loaders feed the same weight builder. llama.cpp's converter
permutes the rows of Q and K so RoPE can rotate interleaved pairs; we undo that permutation and
apply the half-split (NeoX-order) rotation Hugging Face checkpoints use.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from backend_engine.model import quant_blocks
from backend_engine.model.llama import LlamaConfig

_SUPPORTED_ARCH = {"llama"}

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def open_gguf(path: str) -> Any:
    """The `gguf` package's reader over `path`, with its byte array a plain ndarray over the same mapped pages.

    The reader slices its array once or more per metadata field, and the bundled model's vocabulary and merges are
    ~98k string fields: through np.memmap, whose every slice runs Python hooks, that took 10 s of CPU per load (each
    engine start, each gateway counting tokens with the bundled tokenizer); through a plain view, a quarter of it."""
    import gguf

    class Reader(gguf.GGUFReader):
        @property  # type: ignore[override]  # the same bytes, without memmap's per-slice hooks
        def data(self) -> np.ndarray:
            return self._mapped

        @data.setter
        def data(self, mapped: np.memmap) -> None:
            self._mapped = mapped.view(np.ndarray)  # keeps the memmap (its base) and so the mapping alive

    return Reader(path)


def read_metadata(reader: Any) -> dict[str, Any]:
    """All key/value fields as plain Python values."""
    meta: dict[str, Any] = {}
    for key, fld in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        meta[key] = fld.contents()
    return meta


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's convert permute: interleaved-pair rows back to half-split rows."""
    out, inp = w.shape
    return w.reshape(n_head, out // n_head // 2, 2, inp).swapaxes(1, 2).reshape(out, inp)


def _unpermuted(w: np.ndarray | quant_blocks.BlockQuantized, n_head: int) -> Any:
    """The permutation only moves whole rows, so blocks (which run along a row) move with them."""
    if isinstance(w, np.ndarray):
        return unpermute_qk(w, n_head)
    rows = unpermute_qk(np.arange(w.shape[0])[:, None], n_head)[:, 0]
    return w.take_rows(rows)


def config_from_metadata(meta: dict[str, Any]) -> LlamaConfig:
    arch = meta.get("general.architecture", "llama")
    if arch not in _SUPPORTED_ARCH:
        raise ValueError(f"unsupported GGUF architecture {arch!r} (supported: {sorted(_SUPPORTED_ARCH)})")
    a = arch + "."
    hidden = int(meta[a + "embedding_length"])
    heads = int(meta[a + "attention.head_count"])
    vocab = meta.get(a + "vocab_size") or len(meta["tokenizer.ggml.tokens"])
    rope_scaling = None
    if meta.get(a + "rope.scaling.type") == "linear":
        rope_scaling = {"type": "linear", "factor": float(meta[a + "rope.scaling.factor"])}
    return LlamaConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(meta[a + "feed_forward_length"]),
        num_layers=int(meta[a + "block_count"]),
        num_heads=heads,
        num_kv_heads=int(meta.get(a + "attention.head_count_kv", heads)),
        head_dim=int(meta.get(a + "rope.dimension_count", hidden // heads)),
        rope_theta=float(meta.get(a + "rope.freq_base", 10000.0)),
        rms_eps=float(meta.get(a + "attention.layer_norm_rms_epsilon", 1e-5)),
        max_position=int(meta.get(a + "context_length", 4096)),
        rope_scaling=rope_scaling,
    )


def load_gguf(path: str, keep_blocks: bool = False) -> tuple[LlamaConfig, dict[str, Any], dict[str, Any]]:
    """Returns (config, HF-named tensors [out, in], raw metadata). Tensors are float32, except that with
    `keep_blocks` the Q4_0/Q4_1/Q8_0 matrices stay in their blocks (`BlockQuantized`) for `--compute int8`."""
    import gguf

    reader = open_gguf(path)
    meta = read_metadata(reader)
    cfg = config_from_metadata(meta)
    tensors: dict[str, np.ndarray | quant_blocks.BlockQuantized] = {}
    for t in reader.tensors:
        name = t.name
        if name.startswith("blk."):
            _, idx, kind, suffix = name.split(".", 3)
            if kind not in _LAYER_NAMES:
                continue  # e.g. rope_freqs: not needed by this forward pass
            hf = f"model.layers.{idx}.{_LAYER_NAMES[kind]}.{suffix}"
        elif name in _GLOBAL_NAMES:
            hf = _GLOBAL_NAMES[name]
        else:
            continue
        shape = [int(d) for d in reversed(t.shape)]
        arr: np.ndarray | quant_blocks.BlockQuantized
        if keep_blocks and t.tensor_type.name in quant_blocks.SUPPORTED and len(shape) == 2:
            arr = quant_blocks.from_gguf(t.data, t.tensor_type.name, *shape)
        else:
            arr = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        if kind_is(name, "attn_q"):
            arr = _unpermuted(arr, cfg.num_heads)
        elif kind_is(name, "attn_k"):
            arr = _unpermuted(arr, cfg.num_kv_heads)
        tensors[hf] = arr
    cfg.tie_embeddings = "lm_head.weight" not in tensors
    return cfg, tensors, meta


def kind_is(name: str, kind: str) -> bool:
    return name.startswith("blk.") and name.split(".")[2] == kind
