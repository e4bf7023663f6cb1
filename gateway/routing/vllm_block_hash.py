"""vLLM's prefix-cache block hashes, reproduced, so a gateway can look a prompt up in what a vLLM replica reports.

Followed from vLLM's source (vllm-project/vllm, main as of commit 001cabc; recent releases hash the same way, with
digests as bytes): `vllm/v1/core/kv_cache_utils.py` (`init_none_hash`, `hash_block_tokens`,
`get_request_block_hasher`, `generate_block_hash_extra_keys`, `maybe_convert_block_hash`), `vllm/utils/hashing.py`
(`sha256`, `sha256_cbor`) and `vllm/v1/core/kv_cache_manager.py` (`get_computed_blocks`).

- A full block's hash is `hash_fn((parent_hash, tuple(block_token_ids), extra_keys))`; the first block's parent is
  `NONE_HASH = hash_fn(PYTHONHASHSEED)` (the env var's *string*). Without PYTHONHASHSEED vLLM draws NONE_HASH from
  os.urandom at start, and no outsider can predict any of its hashes: set it on every replica.
- `sha256` pickles the tuple (highest protocol), `sha256_cbor` encodes it as canonical CBOR (vLLM uses cbor2; the
  few types a block hash holds are encoded here, so the gateway needs no CBOR library); both SHA-256.
  vLLM's `xxhash`/`xxhash_cbor` (xxh3-128, a C extension) are not reproduced here.
- Extra keys: a request's `cache_salt` goes into the first block only (`(salt,)`; other blocks get None). LoRA and
  multimodal keys are not reproduced: such prompts simply never match.
- KV events carry a hash as the raw digest, or (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1, vLLM's default) as
  `int.from_bytes(digest, "big") & (2**64 - 1)`. `event_key` maps both forms to that int, the prefix index's key.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence
from typing import Any, Literal

HashAlgo = Literal["sha256", "sha256_cbor"]
_MASK64 = (1 << 64) - 1


def _sha256_pickle(value: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _sha256_cbor(value: Any) -> bytes:
    return hashlib.sha256(canonical_cbor(value)).digest()


def canonical_cbor(value: Any) -> bytes:
    """Canonical CBOR (RFC 8949 §4.2.1, what `cbor2.dumps(canonical=True)` writes) for the values a block hash
    holds: ints, bytes, str, None and tuples or lists of them."""
    if value is None:
        return b"\xf6"
    if isinstance(value, bool):
        raise TypeError("a block hash holds no booleans")
    if isinstance(value, int):
        return _cbor_head(0, value) if value >= 0 else _cbor_head(1, -1 - value)
    if isinstance(value, bytes):
        return _cbor_head(2, len(value)) + value
    if isinstance(value, str):
        encoded = value.encode()
        return _cbor_head(3, len(encoded)) + encoded
    if isinstance(value, tuple | list):
        return _cbor_head(4, len(value)) + b"".join(canonical_cbor(item) for item in value)
    raise TypeError(f"a block hash holds no {type(value).__name__}")


def _cbor_head(major: int, argument: int) -> bytes:
    """A data item's head in its shortest form."""
    if argument < 24:
        return bytes([major << 5 | argument])
    for info, size in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if argument < 1 << (8 * size):
            return bytes([major << 5 | info]) + argument.to_bytes(size, "big")
    raise ValueError("CBOR integers stop at 64 bits")


HASH_FUNCTIONS: dict[str, Callable[[Any], bytes]] = {"sha256": _sha256_pickle, "sha256_cbor": _sha256_cbor}


def event_key(block_hash: bytes | int) -> int:
    """The index key of a hash as a KV event carries it (digest bytes or vLLM's 64-bit int form)."""
    if isinstance(block_hash, bytes):
        return int.from_bytes(block_hash, "big") & _MASK64
    return block_hash & _MASK64


class VllmBlockHasher:
    """Hashes prompts into vLLM's full-block hashes for one algorithm, seed and block size."""

    def __init__(self, algo: HashAlgo, seed: str, block_size: int) -> None:
        self.hash_fn = HASH_FUNCTIONS[algo]
        self.block_size = block_size
        self.none_hash = self.hash_fn(seed)

    def block_hashes(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[bytes]:
        """The digest of every full block, in order (a trailing partial block has none)."""
        hashes: list[bytes] = []
        parent = self.none_hash
        size = self.block_size
        for start in range(0, len(token_ids) - size + 1, size):
            extra = (cache_salt,) if start == 0 and cache_salt else None
            parent = self.hash_fn((parent, tuple(token_ids[start : start + size]), extra))
            hashes.append(parent)
        return hashes

    def prompt_keys(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[int]:
        """The prompt's blocks as prefix-index keys (`event_key` of each digest)."""
        return [event_key(h) for h in self.block_hashes(token_ids, cache_salt)]


def reported_cached_tokens(cached_blocks: int, prompt_tokens: int, block_size: int) -> int:
    """What vLLM reports as `cached_tokens` for a prompt whose first `cached_blocks` blocks it holds.

    vLLM caps a hit at prompt length − 1 (the last prompt token is always recomputed for its logits), in whole
    blocks, so a fully cached prompt gives back its last block.
    """
    usable = max(0, prompt_tokens - 1) // block_size
    return min(cached_blocks, usable) * block_size
