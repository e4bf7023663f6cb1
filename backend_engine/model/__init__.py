"""Model loading: a GGUF file or a Hugging Face folder -> forward pass, tokenizer, chat template."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backend_engine.backend import ArrayBackend
from backend_engine.model.calibration import (
    CALIBRATION_CHAT,
    activation_ranges,
    few_row_layers,
    smooth_layers,
    smoothed_head,
)
from backend_engine.model.chat_template import ChatTemplate
from backend_engine.model.int8_decode_step import StepWeights
from backend_engine.model.int8_rows import row_kernel_available
from backend_engine.model.llama import LayerRewrite, LayerWeights, LlamaConfig, LlamaModel, hf_tensors_to_weights
from backend_engine.model.prompt import PromptRenderer
from backend_engine.model.tokenizer import Tokenizer


@dataclass
class LoadedModel:
    model: LlamaModel
    tokenizer: Tokenizer
    chat_template: ChatTemplate
    config: LlamaConfig
    source: str
    load_seconds: float

    @property
    def renderer(self) -> PromptRenderer:
        return PromptRenderer(self.tokenizer, self.chat_template)


def _checked(path: str) -> Path:
    p = Path(path)
    if not (p.is_dir() or (p.suffix == ".gguf" and p.exists())):
        raise FileNotFoundError(f"model {path!r}: expected a .gguf file or a Hugging Face folder")
    return p


def _template(tok: Tokenizer) -> ChatTemplate:
    return ChatTemplate(tok.chat_template, tok.bos_token, tok.eos_token)


def load_prompt_renderer(path: str) -> PromptRenderer:
    """Tokenizer and chat template without the weights: what a router needs to count tokens as the engine does.

    Loaded once per process and file version: every model entry, tool and test that counts with the same file
    shares it (a vocabulary takes seconds to read), and a file replaced on disk is read again."""
    p = _checked(path)
    stat = p.stat()
    return _renderer_of(p.resolve(), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4)
def _renderer_of(p: Path, mtime_ns: int, size: int) -> PromptRenderer:
    if p.is_dir():
        return PromptRenderer(tok := Tokenizer.from_pretrained_dir(p), _template(tok))
    from backend_engine.model.gguf import open_gguf, read_metadata

    tok = Tokenizer.from_gguf_metadata(read_metadata(open_gguf(str(p))))
    return PromptRenderer(tok, _template(tok))


def _return_freed_heap() -> None:
    """Hand the pages the load's temporaries freed back to the operating system. glibc keeps freed heap memory for
    reuse, and loading int8 weights frees a lot of it (dequantized layers, requantized copies, serialized graphs):
    170 MiB of the bundled model's resident memory with smoothed rows. A no-op without glibc."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        if libc is not None and hasattr(libc, "malloc_trim"):
            libc.malloc_trim(0)
    except OSError:
        pass


def load_model(path: str, backend: ArrayBackend, compute: str = "float32") -> LoadedModel:
    """`path` is a .gguf file or a folder with config.json, model.safetensors and tokenizer.json.

    `compute="int8"` keeps a GGUF's Q4_0/Q4_1/Q8_0 matrices quantized (CPU only; see `int8_matmul.py`), and where
    the CPU has VNNI, smooths most of them for the u8s8 GEMM by a calibration chat's activations (`int8_rows.py`)."""
    t0 = time.perf_counter()
    p = _checked(path)
    if compute not in ("float32", "int8"):
        raise ValueError(f"--compute must be float32 or int8, not {compute!r}")
    if compute == "int8" and (backend.device != "cpu" or p.is_dir()):
        raise ValueError("--compute int8 needs the CPU device and a GGUF model with Q4_0/Q4_1/Q8_0 weights")
    if p.is_dir():
        from backend_engine.model.safetensors import load_safetensors_dir

        cfg, tensors = load_safetensors_dir(p)
        tok = Tokenizer.from_pretrained_dir(p)
    else:
        from backend_engine.model.gguf import load_gguf

        cfg, tensors, meta = load_gguf(str(p), keep_blocks=compute == "int8")
        tok = Tokenizer.from_gguf_metadata(meta)
    rewrite: LayerRewrite | None = None
    if compute == "int8" and row_kernel_available():
        ids = PromptRenderer(tok, _template(tok)).chat_ids(CALIBRATION_CHAT, add_generation_prompt=False)

        def rewrite(
            layers: list[LayerWeights], head: Any, embed: Any, final_norm: Any
        ) -> tuple[list[LayerWeights], StepWeights, StepWeights]:
            ranges = activation_ranges(cfg, layers, embed, final_norm, ids, backend)
            rows = smooth_layers(layers, ranges)
            return rows, StepWeights(few_row_layers(layers), head), StepWeights(rows, smoothed_head(head, ranges))

    weights = hf_tensors_to_weights(cfg, tensors, backend, rewrite)
    _return_freed_heap()
    model = LlamaModel(cfg, weights, backend)
    return LoadedModel(model, tok, _template(tok), cfg, str(p), time.perf_counter() - t0)
