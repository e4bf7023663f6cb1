"""`listen.workers`: a whole number of processes or 'auto'; anything else is refused naming the key."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from gateway.config import ConfigError, load_config
from tests.conftest import ROOT


def load(tmp_path, listen: str):
    path = tmp_path / "portcullis.yaml"
    path.write_text(f"listen: {listen}\n")
    return load_config(path)


def test_one_worker_is_the_default(tmp_path):
    assert load(tmp_path, "{port: 8080}").listen.worker_count() == 1


def test_a_number_of_workers_is_taken_as_given(tmp_path):
    assert load(tmp_path, "{workers: 2}").listen.worker_count() == 2


def test_auto_is_one_worker_per_core_this_process_may_use(tmp_path):
    assert load(tmp_path, "{workers: auto}").listen.worker_count() == len(os.sched_getaffinity(0))
    path = tmp_path / "portcullis.yaml"
    count = "from gateway.config import load_config; import sys; print(load_config(sys.argv[1]).listen.worker_count())"
    pinned = subprocess.run(
        ["taskset", "-c", "0", sys.executable, "-c", count, str(path)], cwd=ROOT, capture_output=True, text=True
    )
    assert pinned.stdout.strip() == "1", pinned.stderr  # a process pinned to one core gets one worker


@pytest.mark.parametrize("workers", ["0", "-1", "two", "true", "1.5", "'2'"])
def test_anything_else_is_refused_naming_the_key(tmp_path, workers):
    with pytest.raises(ConfigError) as refused:
        load(tmp_path, f"{{workers: {workers}}}")
    assert "listen.workers: " in str(refused.value)
    assert "whole number of processes (1 or more) or 'auto'" in str(refused.value)
