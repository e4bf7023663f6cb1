"""The array-module seam: the forward pass is written once against `xp` (numpy or CuPy).

CPU keeps weights float32 (OpenBLAS has no fast float16 path); CUDA keeps them float16 to halve
memory traffic and lets cuBLAS accumulate, while norms, softmax and logits stay float32.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class ArrayBackend:
    xp: Any                 # numpy or cupy
    device: str             # "cpu" or "cuda"
    weight_dtype: Any       # storage dtype of the matmul weights

    def asarray(self, a: np.ndarray, dtype: Any = None) -> Any:
        """Move a host array onto the device, contiguous, in `dtype` (default: keep)."""
        if dtype is not None:
            a = a.astype(dtype, copy=False)
        return self.xp.ascontiguousarray(self.xp.asarray(a))

    def to_numpy(self, a: Any) -> np.ndarray:
        return a if isinstance(a, np.ndarray) else a.get()

    def free_memory_bytes(self) -> int:
        if self.device == "cuda":
            free, _total = self.xp.cuda.runtime.memGetInfo()
            return int(free)
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            return 8 << 30

    def synchronize(self) -> None:
        if self.device == "cuda":
            self.xp.cuda.Stream.null.synchronize()


def cuda_available() -> bool:
    try:
        import cupy  # noqa: F401

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def select_backend(device: str = "auto") -> ArrayBackend:
    """auto picks CUDA when CuPy sees a GPU, else CPU; asking for cuda without one is an error."""
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"--device must be auto, cpu or cuda, not {device!r}")
    if device == "cuda" or (device == "auto" and cuda_available()):
        if not cuda_available():
            raise RuntimeError("--device cuda: CuPy with a visible CUDA device is required")
        import cupy

        return ArrayBackend(xp=cupy, device="cuda", weight_dtype=cupy.float16)
    return ArrayBackend(xp=np, device="cpu", weight_dtype=np.float32)
