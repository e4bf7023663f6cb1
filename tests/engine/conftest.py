"""Shared fixtures: the bundled model is loaded once per session and shared by every engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"
SHARED_FIXTURES = Path(__file__).resolve().parents[2].parent / "shared" / "fixtures"


def reference(name: str = "smollm2_f32_reference.json") -> dict:
    """The shared fixture when ../shared exists (the source of truth), else the copy beside the tests."""
    path = SHARED_FIXTURES / name
    if not path.exists():
        path = FIXTURES / name
    return json.loads(path.read_text())


@pytest.fixture(scope="session")
def cpu_backend():
    from backend_engine.backend import select_backend, set_blas_threads

    # One BLAS thread: the suite shares a 2-core machine, where spinning OpenBLAS threads collapse.
    set_blas_threads(1)
    return select_backend("cpu")


@pytest.fixture(scope="session")
def loaded(cpu_backend):
    from backend_engine.config import default_model_path
    from backend_engine.model import load_model

    return load_model(default_model_path(), cpu_backend)


@pytest.fixture(scope="session")
def make_engine(loaded, cpu_backend):
    """Build engines with their own KV cache and scheduler around the one loaded model."""
    from backend_engine.config import EngineConfig
    from backend_engine.engine import LLMEngine

    def make(**kw):
        kw.setdefault("kv_cache_bytes", 64 << 20)
        return LLMEngine(EngineConfig(device="cpu", **kw), loaded=loaded, backend=cpu_backend)

    return make


@pytest.fixture(scope="session")
def engine(make_engine):
    return make_engine()
