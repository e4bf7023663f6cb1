"""The policy watcher against a real directory: an edit made before its watch was in place (between the first load
and the watch, or right after the directory was replaced) is read by nothing but the watch's first pass."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import yaml

from gateway.policy.loader import PolicySet, load_policy_dir
from gateway.policy.reload import PolicyReloader


def write_policy(directory: Path, word: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    rule = {"id": "no-word", "action": "block", "when": {"target": "prompt", "regex": word}}
    policy = {"apiVersion": "portcullis.dev/v1", "kind": "Policy", "metadata": {"name": "ops"}}
    (directory / "base.yaml").write_text(yaml.safe_dump({**policy, "spec": {"waf": {"rules": [rule]}}}))
    return directory


async def installed_version(installed: list[PolicySet], wanted: str, seconds: float = 10) -> str:
    deadline = time.monotonic() + seconds
    while installed[-1].version != wanted and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return installed[-1].version


def test_an_edit_made_before_the_watch_began_is_loaded(tmp_path):
    directory = write_policy(tmp_path / "policies", "first-word")

    async def scenario() -> tuple[str, str]:
        installed = [load_policy_dir(directory)]
        reloader = PolicyReloader(directory, installed.append, lambda: installed[-1], debounce_ms=50)
        write_policy(directory, "second-word")  # no watch exists yet, so no change event will ever report it
        wanted = load_policy_dir(directory).version
        reloader.start()
        try:
            return await installed_version(installed, wanted), wanted
        finally:
            await reloader.stop()

    seen, wanted = asyncio.run(scenario())
    assert seen == wanted


def test_a_replaced_directory_is_watched_and_its_later_edits_load(tmp_path):
    directory = write_policy(tmp_path / "policies", "first-word")

    async def scenario() -> list[tuple[str, str]]:
        installed = [load_policy_dir(directory)]
        reloader = PolicyReloader(directory, installed.append, lambda: installed[-1], debounce_ms=50)
        reloader.start()
        steps = []
        try:
            await asyncio.sleep(0.5)  # the first watch is in place
            write_policy(tmp_path / "next", "replaced-word")
            directory.rename(tmp_path / "old")
            (tmp_path / "next").rename(directory)
            wanted = load_policy_dir(directory).version
            steps.append((await installed_version(installed, wanted), wanted))
            write_policy(directory, "edited-word")  # at once: the new watch may not be in place yet
            wanted = load_policy_dir(directory).version
            steps.append((await installed_version(installed, wanted), wanted))
        finally:
            await reloader.stop()
        return steps

    for seen, wanted in asyncio.run(scenario()):
        assert seen == wanted
