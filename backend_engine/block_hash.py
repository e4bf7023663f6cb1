"""Prefix-cache block hashes, as a pure function the gateway can import without numpy.

A full KV block's identity is its parent's hash plus its own token ids (plus an optional
per-tenant salt), so equal hashes mean equal prefixes. The engine uses exactly these functions,
so a router that hashes a prompt the same way predicts which blocks an engine already holds.

Encoding (stable across processes and versions of Python): blake2b, 8-byte digest, over
  b"pcb1" | parent (8 bytes little-endian, or 8 x 0xff for the first block) |
  salt length (4 bytes LE) | salt utf-8 | each token id as 4 bytes LE;
the result is the digest as a little-endian integer masked to 63 bits (fits a signed int64
and JSON without loss in most consumers).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

_NO_PARENT = b"\xff" * 8
_MASK63 = (1 << 63) - 1


def hash_block(parent: int | None, token_ids: Sequence[int], salt: str | None = None) -> int:
    """Hash one full block: chains `parent` (None for the first block) and its token ids."""
    h = hashlib.blake2b(digest_size=8)
    h.update(b"pcb1")
    h.update(_NO_PARENT if parent is None else struct.pack("<Q", parent))
    salt_bytes = salt.encode("utf-8") if salt else b""
    h.update(struct.pack("<I", len(salt_bytes)))
    h.update(salt_bytes)
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return int.from_bytes(h.digest(), "little") & _MASK63


def hash_prompt_blocks(token_ids: Sequence[int], block_size: int = 16, salt: str | None = None) -> list[int]:
    """Hashes of every *full* block of `token_ids`, in order (a trailing partial block has none)."""
    hashes: list[int] = []
    parent: int | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size], salt)
        hashes.append(parent)
    return hashes
