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
    xp: Any  # numpy or cupy
    device: str  # "cpu" or "cuda"
    weight_dtype: Any  # storage dtype of the matmul weights

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


def set_blas_threads(n: int) -> bool:
    """Set OpenBLAS's thread count at runtime (numpy's bundled build), like threadpoolctl does.

    OpenBLAS threads spin while waiting; on a small machine shared with other busy processes two
    spinning threads can make a matmul 10x slower, so the engine lets the operator choose."""
    import ctypes

    try:
        with open("/proc/self/maps") as f:
            libs = {line.split()[-1] for line in f if "openblas" in line.lower() and line.rstrip().endswith(".so")}
    except OSError:
        return False
    for path in libs:
        lib = ctypes.CDLL(path)
        for sym in ("scipy_openblas_set_num_threads64_", "openblas_set_num_threads64_", "openblas_set_num_threads"):
            fn = getattr(lib, sym, None)
            if fn is not None:
                fn(ctypes.c_int(n))
                return True
    return False


def get_blas_threads() -> int | None:
    import ctypes

    try:
        with open("/proc/self/maps") as f:
            libs = {line.split()[-1] for line in f if "openblas" in line.lower() and line.rstrip().endswith(".so")}
    except OSError:
        return None
    for path in libs:
        lib = ctypes.CDLL(path)
        for sym in ("scipy_openblas_get_num_threads64_", "openblas_get_num_threads64_", "openblas_get_num_threads"):
            fn = getattr(lib, sym, None)
            if fn is not None:
                return int(fn())
    return None
