"""Policies from a Kubernetes ConfigMap volume, updated the way kubelet updates one, in a real gateway process.

kubelet never edits a mounted ConfigMap's files in place. The volume holds a timestamped directory with the data
(`..2026_12_06_14_51_41.123456789/`), a symlink `..data` to it, and for each key a symlink `base.yaml ->
..data/base.yaml`. An update writes a new timestamped directory, points a new symlink `..data_tmp` at it, renames that
over `..data` (the one atomic step), then removes the old directory. `ConfigMapVolume` below does the same steps in the
same order (kubelet's AtomicWriter), so the gateway sees on disk what it would see in a pod.
"""

from __future__ import annotations

import os
import shutil
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
import yaml

from tests.conftest import Launcher, Process, chat_body, pool
from tests.integration.test_workers import AUTH, access_lines, fresh_connection_posts, start_workers

CHAT = "/v1/chat/completions"
DATA = "..data"
RELOAD_DEADLINE = 5.0  # seconds an update may take to be served: kubelet's own sync period is far longer


class ConfigMapVolume:
    """A directory laid out, and updated, as kubelet lays out a ConfigMap volume."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True)

    def publish(self, files: dict[str, str]) -> None:
        """Write `files` (key -> content) as the volume's new payload, atomically for a reader of `..data`."""
        stamp = f"..{datetime.now(UTC):%Y_%m_%d_%H_%M_%S}.{time.monotonic_ns()}"
        payload = self.directory / stamp
        payload.mkdir()
        for name, text in files.items():
            (payload / name).write_text(text)
        data = self.directory / DATA
        previous = os.readlink(data) if data.is_symlink() else None
        os.symlink(stamp, self.directory / "..data_tmp")
        os.rename(self.directory / "..data_tmp", data)
        for name in files:  # the user-visible names, made once
            visible = self.directory / name
            if not visible.is_symlink():
                os.symlink(f"{DATA}/{name}", visible)
        for entry in self.directory.iterdir():  # keys no longer in the ConfigMap
            if entry.is_symlink() and not entry.name.startswith("..") and entry.name not in files:
                entry.unlink()
        if previous is not None:
            shutil.rmtree(self.directory / previous)


def policy(blocked_word: str, regex: str | None = None) -> str:
    rule = {"id": "no-word", "action": "block", "when": {"target": "prompt", "regex": regex or blocked_word}}
    document = {"apiVersion": "portcullis.dev/v1", "kind": "Policy", "metadata": {"name": "k8s"}}
    return yaml.safe_dump({**document, "spec": {"waf": {"rules": [rule]}}})


def ask(gw: Process, prompt: str) -> int:
    body = {**chat_body(), "messages": [{"role": "user", "content": prompt}]}
    return httpx.post(gw.url + CHAT, json=body, timeout=30).status_code


def wait_for(gw: Process, condition, what: str) -> float:
    """Seconds until `condition()` held; fails past RELOAD_DEADLINE with the gateway's policy status."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > RELOAD_DEADLINE:
            pytest.fail(f"{what}: not within {RELOAD_DEADLINE}s; /admin/policy: {gw.admin.get('/admin/policy').json()}")
        time.sleep(0.1)
    return time.monotonic() - started


def test_a_configmap_update_is_served_and_a_broken_one_refused(launcher: Launcher, tmp_path):
    upstream = launcher.fake_upstream()
    volume = ConfigMapVolume(tmp_path / "policies")
    volume.publish({"base.yaml": policy("first-word")})
    gw = launcher.gateway({"pools": [pool("main", upstream.url)], "policy_dir": str(volume.directory)})
    assert ask(gw, "say first-word") == 403
    assert ask(gw, "say second-word") == 200

    volume.publish({"base.yaml": policy("second-word")})
    wait_for(gw, lambda: ask(gw, "say second-word") == 403, "the updated ConfigMap's policy")
    assert ask(gw, "say first-word") == 200
    good = gw.admin.get("/admin/policy").json()

    volume.publish({"base.yaml": policy("third-word", regex="(?<=x)third-word")})  # RE2 has no look-behind
    wait_for(gw, lambda: gw.admin.get("/admin/policy").json()["last_error"], "the broken policy's refusal")
    status = gw.admin.get("/admin/policy").json()
    assert "base.yaml" in status["last_error"] and status["version"] == good["version"]
    assert ask(gw, "say second-word") == 403, "the last good policy stopped serving"
    assert ask(gw, "say third-word") == 200
    assert 'portcullis_policy_reload_total{result="refused"} 1.0' in gw.admin.get("/metrics").text

    volume.publish({"base.yaml": policy("fourth-word")})  # the watch survives a refused update
    wait_for(gw, lambda: ask(gw, "say fourth-word") == 403, "the policy after the broken one")
    assert gw.admin.get("/admin/policy").json()["last_error"] is None


def test_every_worker_serves_the_update(launcher: Launcher, processes: list[Process], tmp_path):
    """The Kubernetes config runs `workers: auto`: each worker watches the volume and reloads on its own."""
    upstream = launcher.fake_upstream()
    volume = ConfigMapVolume(tmp_path / "policies")
    volume.publish({"base.yaml": policy("first-word")})
    config = {"pools": [pool("main", upstream.url)], "auth": AUTH, "policy_dir": str(volume.directory)}
    gw = start_workers(processes, tmp_path, config)
    volume.publish({"base.yaml": policy("second-word")})
    since = len(gw.output())
    prompt = [{"role": "user", "content": "say second-word"}]

    def every_worker_blocks() -> bool:
        """A batch answered 403 throughout, and each worker has logged a 403 since the update.

        A worker's access line may reach the log after its answer reaches the client, and the kernel may hand one
        batch's connections all to one worker, so both are asked again until the deadline.
        """
        batch = fresh_connection_posts(gw, 16, messages=prompt)
        served = {line["worker"] for line in access_lines(gw, since) if line.get("status") == 403}
        return set(batch) == {403} and served == {0, 1}

    wait_for(gw, every_worker_blocks, "the update in every worker")
