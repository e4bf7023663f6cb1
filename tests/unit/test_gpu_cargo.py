"""bench/gpu_cargo.py: the cargo cut into parts comes back whole only when every part has come, call after call."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import gpu_cargo
from bench.gpu_first_run import GGUF_NAME


def test_parts_carried_over_two_calls_unpack_to_the_same_files(tmp_path: Path) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(bytes(range(256)) * 9000)  # 2.2 MiB: three parts of 1 MiB
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "gguf-0.19.0-py3-none-any.whl").write_bytes(b"a wheel")
    packed = tmp_path / "packed"
    gpu_cargo.pack(packed, 1 << 20, gpu_cargo.cargo_files(str(gguf), str(wheels), []))
    assert sorted(p.name for p in packed.iterdir()) == ["1", "2", "3"]
    home = tmp_path / "home"

    first_call = tmp_path / "call1"
    first_call.mkdir()
    (packed / "1").rename(first_call / "1")
    assert gpu_cargo.unpack(first_call, home) == gpu_cargo.INCOMPLETE
    assert not (home / "files").exists()

    second_call = tmp_path / "call2"
    second_call.mkdir()
    for part in ("2", "3"):
        (packed / part).rename(second_call / part)
    assert gpu_cargo.unpack(second_call, home) == 0
    assert (home / "files" / GGUF_NAME).read_bytes() == gguf.read_bytes()
    assert (home / "files" / "wheels" / "gguf-0.19.0-py3-none-any.whl").read_bytes() == b"a wheel"


def test_a_part_that_changed_on_the_way_is_refused(tmp_path: Path) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"weights" * 1000)
    packed = tmp_path / "packed"
    gpu_cargo.pack(packed, 4096, gpu_cargo.cargo_files(str(gguf), None, []))
    part = packed / "2" / "cargo.part"
    part.write_bytes(b"X" + part.read_bytes()[1:])
    with pytest.raises(SystemExit, match="do not add up"):
        gpu_cargo.unpack(packed, tmp_path / "home")
    assert json.loads((packed / "1" / "manifest.json").read_text())["parts"] == len(list(packed.iterdir()))
