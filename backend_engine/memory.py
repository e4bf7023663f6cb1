"""How much memory the KV cache gets: weights and a step's activations first, the cache from the rest."""

from __future__ import annotations

from dataclasses import dataclass

from backend_engine.backend import ArrayBackend
from backend_engine.config import EngineConfig
from backend_engine.model.llama import LlamaModel


@dataclass
class MemoryBudget:
    weights_bytes: int
    runtime_bytes: int
    kv_cache_bytes: int
    num_blocks: int
    block_size: int

    @property
    def kv_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def describe(self) -> str:
        mib = 1 << 20
        return (
            f"memory budget: weights {self.weights_bytes / mib:.1f} MiB, runtime overhead "
            f"{self.runtime_bytes / mib:.1f} MiB, KV cache {self.kv_cache_bytes / mib:.1f} MiB = "
            f"{self.num_blocks} blocks x {self.block_size} tokens = {self.kv_tokens} tokens"
        )


def plan_memory(model: LlamaModel, backend: ArrayBackend, cfg: EngineConfig) -> MemoryBudget:
    """Size the KV cache: an explicit byte budget, else a fraction of free GPU memory once a full step's
    float32 activations are set aside, else (CPU) a capped quarter of free memory."""
    c = model.cfg
    weights = model.weight_bytes()
    T = cfg.max_num_batched_tokens
    qkv = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    per_token = 4 * (4 * c.hidden_size + 2 * qkv + 3 * c.intermediate_size)
    attn_scores = 4 * 2 * c.num_heads * T * min(c.max_position, 8192)
    logits = 4 * 2 * cfg.max_num_seqs * c.vocab_size
    rope = 2 * 4 * c.max_position * c.head_dim // 2
    runtime = per_token * T + attn_scores + logits + rope
    per_block = model.kv_bytes_per_token() * cfg.block_size
    if cfg.kv_cache_bytes is not None:
        kv = cfg.kv_cache_bytes
    elif backend.device == "cuda":
        kv = int((backend.free_memory_bytes() - runtime) * cfg.kv_cache_memory_fraction)
    else:
        kv = min(cfg.cpu_default_kv_cache_bytes, max(backend.free_memory_bytes() // 4, per_block))
    num_blocks = kv // per_block
    if num_blocks < 1:
        raise ValueError(f"KV cache budget {kv} bytes is smaller than one block ({per_block} bytes)")
    return MemoryBudget(weights, runtime, num_blocks * per_block, int(num_blocks), cfg.block_size)
