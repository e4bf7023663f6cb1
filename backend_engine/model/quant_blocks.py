"""GGUF weight matrices kept in their 32-value blocks: unsigned codes, a scale and an offset per block.

Every supported layout is written in one form, w = scale * (code - zero) + offset, with `zero` 8 for 4-bit codes
and 128 for 8-bit ones:

- Q4_0: w = d * (q - 8)              → scale d, no offset
- Q4_1: w = d * q + m                → scale d, offset m + 8 d
- Q8_0: w = d * q (q signed int8)    → codes q + 128, scale d, no offset

That is the form onnxruntime's MatMulNBits kernel multiplies (`int8_matmul.py`), plus a per-block offset term.
The byte layouts are ggml's (block_q4_0, block_q4_1, block_q8_0 in ggml-common.h); `dequantize` must agree with
the `gguf` package's own dequantizer, and a test checks that it does on the bundled model.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BLOCK = 32
SUPPORTED = ("Q4_0", "Q4_1", "Q8_0")


@dataclass
class BlockQuantized:
    """A matrix [out, in] in blocks of `block` values along `in` (ggml's 32, or wider once `requantized`)."""

    bits: int  # 4 or 8
    codes: np.ndarray  # uint8 [out, in], each < 2**bits
    scale: np.ndarray  # float32 [out, in / block]
    offset: np.ndarray | None  # float32 [out, in / block], or None when every offset is 0
    block: int = BLOCK

    @property
    def zero(self) -> int:
        return 1 << (self.bits - 1)

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape

    @property
    def nbytes(self) -> int:
        """Bytes as the kernel keeps them: codes packed to `bits`, float32 scales and offsets."""
        return (
            self.codes.nbytes * self.bits // 8 + self.scale.nbytes + (0 if self.offset is None else self.offset.nbytes)
        )

    def dequantize(self) -> np.ndarray:
        rows, cols = self.shape
        blocks = self.codes.reshape(rows, cols // self.block, self.block).astype(np.float32) - self.zero
        w = blocks * self.scale[..., None]
        if self.offset is not None:
            w += self.offset[..., None]
        return w.reshape(rows, cols)

    def take_rows(self, order: np.ndarray) -> BlockQuantized:
        offset = None if self.offset is None else self.offset[order]
        return BlockQuantized(self.bits, self.codes[order], self.scale[order], offset, self.block)

    @staticmethod
    def stack_rows(parts: list[BlockQuantized]) -> BlockQuantized | None:
        """One matrix from several with the same input size, bits and blocks (Q|K|V, gate|up); None if they differ."""
        if len({(p.bits, p.block, p.shape[1]) for p in parts}) != 1:
            return None
        if all(p.offset is None for p in parts):
            offset = None
        else:
            offset = np.concatenate([p.offset if p.offset is not None else np.zeros_like(p.scale) for p in parts])
        codes, scale = np.concatenate([p.codes for p in parts]), np.concatenate([p.scale for p in parts])
        return BlockQuantized(parts[0].bits, codes, scale, offset, parts[0].block)


def from_gguf(raw: np.ndarray, kind: str, rows: int, cols: int) -> BlockQuantized:
    """Decode ggml blocks (`raw`: uint8 bytes as the GGUF reader returns them) of a [rows, cols] matrix."""
    if kind not in SUPPORTED:
        raise ValueError(f"{kind} blocks are not supported (supported: {', '.join(SUPPORTED)})")
    nb = cols // BLOCK
    head = 4 if kind == "Q4_1" else 2  # f16 d, and f16 m for Q4_1
    blocks = np.ascontiguousarray(raw).reshape(rows, nb, -1)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    payload = blocks[..., head:]
    if kind == "Q8_0":
        codes = (payload.view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return BlockQuantized(8, codes.reshape(rows, cols), d, None)
    codes = np.concatenate([payload & 0x0F, payload >> 4], axis=-1)  # element j in the low nibble, j + 16 high
    offset = None
    if kind == "Q4_1":
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        offset = m + 8 * d
    return BlockQuantized(4, codes.reshape(rows, cols), d, offset)


def requantized(w: BlockQuantized, block: int) -> BlockQuantized:
    """`w` as 8-bit codes in blocks of `block` along `in`, symmetric around 128, with no offset: a Q4_1 matrix's
    offsets fold into the codes, and the kernel quantizes its input in blocks of `block` too (`int8_matmul.py`)."""
    dense = w.dequantize().astype(np.float64)
    rows, cols = dense.shape
    blocks = dense.reshape(rows, cols // block, block)
    scale = np.maximum(np.abs(blocks).max(axis=-1), 1e-12) / 127
    codes = np.clip(np.rint(blocks / scale[..., None]), -127, 127) + 128
    return BlockQuantized(8, codes.astype(np.uint8).reshape(rows, cols), scale.astype(np.float32), None, block)
