"""bench/gpu_first_run.py without a GPU: its CPU smoke runs every part for real, a missing piece is named with exit 3,
and `--merge` writes a CUDA run's figures into docs/benchmarks.md's GPU row. What keeps the GPU script from rotting
between the rare runs on a GPU machine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu_first_run import GPU_ROW
from tests.conftest import ROOT


def first_run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "bench.gpu_first_run", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_cpu_smoke_runs_the_gpu_tests_the_engine_and_the_guard_and_writes_their_figures(tmp_path: Path) -> None:
    small = ["--engine-streams", "2", "--engine-tokens", "8", "--guard-requests", "8", "--threads", "1"]
    done = first_run("--device", "cpu", "--smoke", "--out", str(tmp_path), *small)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_first_run.json").read_text())
    parts = report["parts"]
    assert {name: part["status"] for name, part in parts.items()} == dict.fromkeys(
        ("tests", "engine", "guard"), "passed"
    )
    # -m gpu found the five GPU tests of the three files, and each skipped for want of a GPU
    assert len(parts["tests"]["skipped"]) == 5 and parts["tests"]["failed"] == []
    assert {s.split("::")[0] for s in parts["tests"]["skipped"]} == {
        "test_gpu",
        "test_guard_model",
        "test_guard_ensemble",
    }
    engine = parts["engine"]["figures"]
    assert engine["device"] == "cpu" and set(engine["aggregate_tok_s"]) == {"2"} and engine["aggregate_tok_s"]["2"] > 0
    guard = parts["guard"]["figures"]
    assert guard["provider"] == "CPUExecutionProvider" and guard["latency"]["128tok_c1"]["p50_ms"] > 0
    table = (tmp_path / "gpu_first_run.md").read_text()
    assert "| engine | passed |" in table and "output tok/s at 2 streams" in table


def test_a_missing_piece_is_named_and_its_part_skipped_with_exit_3(tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime")
    try:
        import cupy  # noqa: F401

        pytest.skip("CuPy is installed here")
    except ImportError:
        pass
    done = first_run("--device", "cuda", "--parts", "engine", "--out", str(tmp_path), timeout=60)
    assert done.returncode == 3, done.stderr
    assert "engine: skipped, missing" in done.stderr and "CuPy is not installed" in done.stderr
    report = json.loads((tmp_path / "gpu_first_run.json").read_text())
    assert report["parts"]["engine"]["status"] == "skipped"


def cuda_report() -> dict:
    return {
        "device": "cuda",
        "machine": {"python": "3.12.3", "cpu": "Intel Xeon", "cores": "16", "gpu": "NVIDIA H100 80GB HBM3"},
        "commit": "abc1234",
        "command": "python -m bench.gpu_first_run --out /tmp/out",
        "parts": {
            "tests": {"status": "passed", "seconds": 80.0, "passed": 5, "failed": [], "skipped": []},
            "engine": {
                "status": "passed",
                "seconds": 95.0,
                "command": "python -m bench.engine_bench --backend portcullis --device cuda",
                "figures": {
                    "single_stream_decode_tok_s": 211.4,
                    "ttft_cold_1000_s": 0.0812,
                    "ttft_cached_1000_s": 0.0051,
                    "aggregate_tok_s": {"1": 205.0, "8": 1501.2, "32": 4420.9, "64": 6177.3},
                },
            },
            "guard": {
                "status": "skipped",
                "missing": ["onnxruntime 1.30.0 has no CUDAExecutionProvider (the CPU build; pip: onnxruntime-gpu)"],
            },
        },
    }


def test_merge_rewrites_the_gpu_row_in_place_and_refuses_a_cpu_run(tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text((ROOT / "docs" / "benchmarks.md").read_text())
    before = doc.read_text().splitlines()
    run = tmp_path / "run"
    run.mkdir()
    (run / "gpu_first_run.json").write_text(json.dumps(cuda_report()))
    done = first_run("--merge", str(run), "--doc", str(doc), timeout=30)
    assert done.returncode == 0, done.stderr
    after = doc.read_text().splitlines()
    assert len(after) == len(before)
    changed = [new for old, new in zip(before, after) if old != new]
    assert len(changed) == 1 and changed[0].startswith(f"| {GPU_ROW}")
    row = changed[0]
    assert "**205 / 1501 / 4421 / 6177**" in row and "5 passed" in row and "NVIDIA H100 80GB HBM3" in row
    assert "guard: skipped: missing onnxruntime 1.30.0 has no CUDAExecutionProvider" in row
    assert row.endswith("| abc1234 |") and row.count(" | ") == 5

    cpu = cuda_report() | {"device": "cpu"}
    (run / "gpu_first_run.json").write_text(json.dumps(cpu))
    refused = first_run("--merge", str(run), "--doc", str(doc), timeout=30)
    assert refused.returncode != 0 and "only a cuda run's figures" in refused.stderr
    assert doc.read_text().splitlines() == after
