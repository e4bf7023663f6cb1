"""portcullis.yaml reloaded by a running gateway: pools, models and static keys change without a restart, on a file
change (an atomic rewrite, a Kubernetes ConfigMap's symlink swap) or SIGHUP; a file that fails validation, or that
changes a setting only a restart applies, is refused with its file and key path, and the last good config serves."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
import yaml

from tests.conftest import Launcher, Process, free_port, pool
from tests.integration.test_policy_configmap import ConfigMapVolume
from tests.integration.test_workers import AUTH, fresh_connection_posts, start_workers

OLD_KEY, NEW_KEY = "sk-old-static-key", "sk-new-static-key"
RELOAD_DEADLINE = 10.0  # seconds a reload may take to be served, under a loaded test machine


def static_key(key: str, tenant: str) -> dict:
    return {"tenant": tenant, "sha256": hashlib.sha256(key.encode()).hexdigest()}


def config_file(gw: Process, launcher: Launcher) -> Path:
    """The file `launcher.gateway` wrote for `gw` (named by its port)."""
    return launcher.directory / f"portcullis-{gw.url.rsplit(':', 1)[1]}.yaml"


def rewrite(path: Path, change: Callable[[dict], None] | str) -> None:
    """Replace the file in one rename, as an editor or a config tool does: `change` edits its YAML, or is the text."""
    if isinstance(change, str):
        text = change
    else:
        config = yaml.safe_load(path.read_text())
        change(config)
        text = yaml.safe_dump(config)
    written = path.with_name(path.name + ".tmp")
    written.write_text(text)
    os.replace(written, path)


def chat(gw: Process, key: str, model: str) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hello"}]}
    headers = {"authorization": f"Bearer {key}"}
    return httpx.post(gw.url + "/v1/chat/completions", json=body, headers=headers, timeout=30)


def wait_for(condition: Callable[[], bool], what: str, gw: Process) -> None:
    deadline = time.monotonic() + RELOAD_DEADLINE
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {RELOAD_DEADLINE}s; gateway log:\n{gw.output()[-3000:]}")
        time.sleep(0.1)


def reloads(gw: Process, result: str) -> float:
    for line in gw.admin.get("/metrics").text.splitlines():
        if line.startswith(f'portcullis_config_reload_total{{result="{result}"}}'):
            return float(line.split()[-1])
    return 0.0


def test_a_rewritten_file_adds_a_pool_and_a_key_and_removes_a_model_and_a_key(launcher: Launcher):
    first, second = launcher.fake_upstream("first"), launcher.fake_upstream("second")
    gw = launcher.gateway(
        {"pools": [pool("alpha", first.url, models=["alpha"])], "auth": {"keys": [static_key(OLD_KEY, "old")]}}
    )
    assert chat(gw, OLD_KEY, "alpha").status_code == 200
    assert chat(gw, NEW_KEY, "alpha").status_code == 401

    def change(config: dict) -> None:
        config["pools"] = [pool("beta", second.url, models=["beta"])]
        config["auth"] = {"keys": [static_key(NEW_KEY, "new")]}

    rewrite(config_file(gw, launcher), change)
    wait_for(lambda: chat(gw, NEW_KEY, "beta").status_code == 200, "the new pool and key", gw)
    assert chat(gw, NEW_KEY, "beta").json()["system_fingerprint"] == "second"

    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=OLD_KEY, max_retries=0)
    with pytest.raises(openai.AuthenticationError) as refused:  # a removed static key opens nothing
        client.chat.completions.create(model="beta", messages=[{"role": "user", "content": "hi"}])
    assert refused.value.code == "invalid_api_key"
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=NEW_KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError) as missing:  # the removed pool's model, in the route's own error shape
        client.chat.completions.create(model="alpha", messages=[{"role": "user", "content": "hi"}])
    assert missing.value.code == "model_not_found"
    messages = anthropic.Anthropic(base_url=gw.url, api_key=NEW_KEY, max_retries=0)
    with pytest.raises(anthropic.NotFoundError) as gone:  # and in the Messages route's shape there
        messages.messages.create(model="alpha", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    assert gone.value.body["type"] == "error" and gone.value.body["error"]["type"] == "not_found_error"
    assert reloads(gw, "applied") == 1


def test_other_files_beside_the_config_wake_no_reload_and_no_log_line(launcher: Launcher):
    """The config's directory may hold busy files: here the gateway's own log and SQLite store, and one more file
    written over and over. None is the source: no log line, so the log (in that directory) stops growing."""
    upstream = launcher.fake_upstream()
    gw = launcher.gateway({"pools": [pool("alpha", upstream.url, models=["alpha"])]})
    busy = launcher.directory / "busy.db"
    for n in range(5):
        busy.write_text(str(n))
        time.sleep(0.2)
    time.sleep(1.0)
    settled = gw.output()
    time.sleep(1.5)
    assert "change detected" not in gw.output() and gw.output() == settled
    assert reloads(gw, "unchanged") == 1  # the watch's first pass only


def test_an_invalid_file_is_refused_and_the_last_good_config_serves(launcher: Launcher):
    upstream = launcher.fake_upstream()
    gw = launcher.gateway(
        {"pools": [pool("alpha", upstream.url, models=["alpha"])], "auth": {"keys": [static_key(OLD_KEY, "old")]}}
    )
    path = config_file(gw, launcher)
    good = path.read_text()

    def without_key(config: dict) -> None:  # valid, were it not for what else each bad file below gets wrong
        config["auth"] = {"keys": [static_key(NEW_KEY, "new")]}

    def bad_url(config: dict) -> None:
        without_key(config)
        config["pools"][0]["replicas"][0]["url"] = "ftp://nowhere"

    def unknown_fallback_pool(config: dict) -> None:
        without_key(config)
        config["fallbacks"] = [{"model": "alpha", "to": [{"pool": "missing"}]}]

    def new_port(config: dict) -> None:
        without_key(config)
        config["listen"]["port"] = free_port()

    cases: list[tuple[Callable[[dict], None] | str, str]] = [
        ("pools: [unclosed\n", f"{path}: invalid YAML"),
        (bad_url, f"{path}: pools[0].replicas[0].url"),
        (unknown_fallback_pool, "fallbacks[0].to[0].pool: no pool named 'missing'"),
        (new_port, f"{path}: listen.port: changed, restart the gateway to apply"),
    ]
    for number, (change, logged) in enumerate(cases, 1):
        rewrite(path, change if isinstance(change, str) else _on(good, change))
        # the admin API may report the refusal before its log line is written: both must come
        wait_for(lambda: logged in _last_error(gw) and logged in gw.output(), f"refusing {logged}", gw)  # noqa: B023
        assert reloads(gw, "refused") >= number
        assert chat(gw, OLD_KEY, "alpha").status_code == 200, "the last good config stopped serving"
        assert chat(gw, NEW_KEY, "alpha").status_code == 401, f"part of a refused file was applied ({logged})"
    assert reloads(gw, "applied") == 0


def _last_error(gw: Process) -> str:
    return gw.admin.get("/admin/config").json()["last_error"] or ""


def _on(text: str, change: Callable[[dict], None]) -> str:
    config = yaml.safe_load(text)
    change(config)
    return yaml.safe_dump(config)


def test_a_configmap_swap_and_sighup_reload(launcher: Launcher, tmp_path: Path):
    """The file as a Kubernetes ConfigMap volume holds it (a symlink through `..data`, swapped in one rename); then,
    for a file the watch cannot see (a symlink to another directory), SIGHUP."""
    first, second = launcher.fake_upstream("first"), launcher.fake_upstream("second")
    volume = ConfigMapVolume(tmp_path / "config")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    def config(port: int, upstream: Process, model: str) -> str:
        return yaml.safe_dump(
            {
                "listen": {"host": "127.0.0.1", "port": port},
                "admin": {"enabled": False},
                "store": {"sqlite_path": str(tmp_path / "portcullis.db")},
                "pools": [pool("main", upstream.url, models=[model])],
                "auth": {"keys": [static_key(OLD_KEY, "old")]},
            }
        )

    ports: list[int] = []

    def cmd(port: int) -> list[str]:
        ports.append(port)
        volume.publish({"portcullis.yaml": config(port, first, "alpha")})
        return [sys.executable, "-m", "gateway.cli", "serve", "--config", str(volume.directory / "portcullis.yaml")]

    gw = launcher.spawn(cmd, "gateway", env={"XDG_STATE_HOME": str(tmp_path / "state")})
    assert chat(gw, OLD_KEY, "alpha").status_code == 200
    volume.publish({"portcullis.yaml": config(ports[-1], second, "beta")})
    wait_for(lambda: chat(gw, OLD_KEY, "beta").status_code == 200, "the ConfigMap's new pool", gw)
    assert chat(gw, OLD_KEY, "alpha").status_code == 404

    target = elsewhere / "portcullis.yaml"  # the volume's file becomes a symlink into a directory nobody watches
    target.write_text(config(ports[-1], second, "beta"))
    volume.publish({"portcullis.yaml": config(ports[-1], second, "beta")})
    visible = volume.directory / "portcullis.yaml"
    visible.unlink()
    visible.symlink_to(target)
    time.sleep(1.0)  # what the watch saw of the swap is read by now
    target.write_text(config(ports[-1], first, "gamma"))
    time.sleep(1.0)
    assert chat(gw, OLD_KEY, "gamma").status_code == 404, "the watch saw a file outside its directory"
    gw.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: chat(gw, OLD_KEY, "gamma").status_code == 200, "the file SIGHUP reloads", gw)
    assert chat(gw, OLD_KEY, "gamma").json()["system_fingerprint"] == "first"


def test_every_worker_reloads_the_file_and_a_refused_one_changes_none(
    launcher: Launcher, processes: list[Process], tmp_path: Path
):
    """With `listen.workers`, the supervisor validates the edit and hands it to every worker; SIGHUP does the same."""
    first, second = launcher.fake_upstream("first"), launcher.fake_upstream("second")
    gw = start_workers(processes, tmp_path, {"pools": [pool("main", first.url, models=["alpha"])], "auth": AUTH})
    path = tmp_path / "portcullis.yaml"

    def to_second(config: dict) -> None:
        config["pools"] = [pool("main", second.url, models=["beta"])]

    rewrite(path, to_second)
    good = path.read_text()
    wait_for(lambda: set(fresh_connection_posts(gw, 16, model="beta")) == {200}, "the new pool in every worker", gw)
    wait_for(lambda: _reloaded_workers(gw) == {0, 1}, "every worker's reload, in its log", gw)

    rewrite(path, lambda config: config["listen"].update(port=free_port()))
    wait_for(lambda: "config reload refused" in gw.output(), "the supervisor's refusal", gw)
    assert "listen.port: changed, restart the gateway to apply" in gw.output()
    to_first = _on(good, lambda config: config.update(pools=[pool("main", first.url, models=["gamma"])]))
    path.write_text(to_first)  # in place, and at once told by SIGHUP: the supervisor is not stopped by it
    gw.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: set(fresh_connection_posts(gw, 16, model="gamma")) == {200}, "the SIGHUP'd file", gw)
    assert gw.proc.poll() is None


def _reloaded_workers(gw: Process) -> set[int]:
    lines = [json.loads(line) for line in gw.output().splitlines() if line.startswith("{")]
    return {line["worker"] for line in lines if line.get("message", "").startswith("config reloaded")}
