"""Operator mistakes caught before they cost traffic: a WAF rule that matches every request, YAML 1.1 booleans in
policy files, client-chosen model names as metric labels, and `portcullis up` leaving its engines behind.

Every gateway here is configured its own way, is refused at start, or reloads its policy, so each test starts its
own; they share the module's fake upstream, which none counts."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.conftest import ROOT, STATE_ENV, Launcher, Process, chat_body, free_port, pool

CHAT = "/v1/chat/completions"
BASE = {"apiVersion": "portcullis.dev/v1", "kind": "Policy", "metadata": {"name": "ops"}}
FORBIDDEN = {"id": "no-forbidden-word", "action": "block", "when": {"target": "prompt", "regex": "forbidden-word"}}


def write_policy(directory: Path, waf: dict) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "base.yaml").write_text(yaml.safe_dump({**BASE, "spec": {"waf": waf}}))
    return directory


def policy_check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", "policy", "check", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def ask(gw, prompt: str) -> httpx.Response:
    return httpx.post(
        gw.url + CHAT, json={**chat_body(), "messages": [{"role": "user", "content": prompt}]}, timeout=30
    )


@pytest.fixture(scope="module")
def upstream(module_launcher: Launcher) -> Process:
    return module_launcher.fake_upstream()


# -- rules that match every request ----------------------------------------------------------------------------


def test_policy_check_warns_on_a_match_all_rule_and_strict_fails(tmp_path):
    # a notice (2 points) under the threshold (5): it marks every request, it does not block them all
    directory = write_policy(
        tmp_path / "policies",
        {"rules": [{"id": "everything", "severity": "notice", "when": {"target": "prompt", "regex": ".*"}}]},
    )
    lenient = policy_check(str(directory))
    assert lenient.returncode == 0, lenient.stderr
    assert "'everything'" in lenient.stderr and "matches every request" in lenient.stderr
    strict = policy_check("--strict", str(directory))
    assert strict.returncode == 1, strict.stderr
    assert "matches every request" in strict.stderr


def test_policy_check_refuses_a_rule_that_blocks_every_request(tmp_path):
    directory = write_policy(
        tmp_path / "policies", {"rules": [{"id": "oops", "action": "block", "when": {"target": "prompt", "regex": ""}}]}
    )
    result = policy_check(str(directory))
    assert result.returncode == 1
    assert "blocks every request" in result.stderr and "'oops'" in result.stderr


def test_a_gateway_refuses_to_start_with_a_blanket_block(upstream, gateway, tmp_path):
    directory = write_policy(
        tmp_path / "policies", {"rules": [{"id": "oops", "action": "block", "when": {"target": "path", "regex": "a*"}}]}
    )
    with pytest.raises(RuntimeError, match="blocks every request"):
        gateway({"pools": [pool("main", upstream.url)], "policy_dir": str(directory)})


@pytest.mark.parametrize("where", ["missing/portcullis.db", "."])
def test_a_store_file_that_cannot_be_opened_is_a_clear_start_error(upstream, gateway, tmp_path, where):
    path = tmp_path / where  # in a directory that does not exist; a directory itself
    with pytest.raises(RuntimeError) as failed:
        gateway({"pools": [pool("main", upstream.url)], "store": {"sqlite_path": str(path)}})
    assert f"portcullis: store.sqlite_path: cannot open {path}" in str(failed.value)
    assert "Traceback" not in str(failed.value)


def test_a_reload_to_a_blanket_block_keeps_the_last_good_policy(upstream, gateway, tmp_path):
    directory = write_policy(tmp_path / "policies", {"rules": [FORBIDDEN]})
    gw = gateway({"pools": [pool("main", upstream.url)], "policy_dir": str(directory)})
    assert ask(gw, "hello").status_code == 200
    assert ask(gw, "say forbidden-word").status_code == 403

    write_policy(
        directory, {"rules": [FORBIDDEN, {"id": "oops", "action": "block", "when": {"target": "prompt", "regex": ""}}]}
    )
    gw.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 30
    while "policy reload" not in gw.output():
        assert time.monotonic() < deadline, gw.output()
        time.sleep(0.1)

    assert ask(gw, "hello").status_code == 200, "the blanket block took all traffic down"
    assert ask(gw, "say forbidden-word").status_code == 403  # the last good policy still runs
    status = gw.admin.get("/admin/policy").json()
    assert "blocks every request" in status["last_error"]


def test_a_policy_directory_replaced_while_serving_is_still_watched(upstream, gateway, tmp_path):
    """A deploy that renames a new directory over the old one, or removes it and writes it again: the watch follows
    the old directory's inode, so without watching the new one anew, later edits would never load."""
    directory = write_policy(tmp_path / "policies", {"rules": [FORBIDDEN]})
    gw = gateway({"pools": [pool("main", upstream.url)], "policy_dir": str(directory)})

    def until_blocked(word: str) -> None:
        deadline = time.monotonic() + 20
        while ask(gw, f"say {word}").status_code != 403:
            assert time.monotonic() < deadline, gw.admin.get("/admin/policy").json()
            time.sleep(0.1)

    def blocking(word: str) -> dict:
        return {"rules": [{**FORBIDDEN, "when": {"target": "prompt", "regex": word}}]}

    write_policy(tmp_path / "next", blocking("first-word"))
    directory.rename(tmp_path / "old")
    (tmp_path / "next").rename(directory)
    until_blocked("first-word")
    write_policy(directory, blocking("second-word"))  # an edit in the directory renamed in
    until_blocked("second-word")

    for path in (directory / "base.yaml", directory):
        path.unlink() if path.is_file() else path.rmdir()
    time.sleep(0.5)  # the reload of an empty directory is refused; the last good policy keeps serving
    assert ask(gw, "say second-word").status_code == 403
    write_policy(directory, blocking("third-word"))
    until_blocked("third-word")
    assert gw.admin.get("/admin/policy").json()["last_error"] is None


# -- YAML 1.1 booleans -------------------------------------------------------------------------------------------


def test_unquoted_off_and_no_load_as_off(upstream, gateway, tmp_path):
    directory = tmp_path / "policies"
    directory.mkdir()
    # written by hand: yaml.safe_dump would quote them
    (directory / "base.yaml").write_text("""apiVersion: portcullis.dev/v1
kind: Policy
metadata: {name: ops}
spec:
  waf:
    mode: off
    rules:
      - {id: no-forbidden-word, action: block, when: {target: prompt, regex: forbidden-word}}
  guard:
    pii: {pii: off, secrets: no}
""")
    gw = gateway({"pools": [pool("main", upstream.url)], "policy_dir": str(directory)})
    assert ask(gw, "say forbidden-word").status_code == 200  # mode off: the rule does not run


# -- metric labels -----------------------------------------------------------------------------------------------


def test_made_up_model_names_do_not_grow_metrics(upstream, gateway):
    gw = gateway(
        {
            "pools": [pool("any", upstream.url)],  # a catch-all pool: every name is served
            "models": [{"name": "known-model"}],
        }
    )

    def send(models: list[str]) -> None:
        async def run() -> None:
            limit = asyncio.Semaphore(32)
            async with httpx.AsyncClient(timeout=60) as client:

                async def one(model: str) -> None:
                    async with limit:
                        response = await client.post(gw.url + CHAT, json=chat_body(model=model))
                        assert response.status_code == 200, response.text

                await asyncio.gather(*(one(m) for m in models))

        asyncio.run(run())

    send(["known-model", "made-up-warmup"])
    before = gw.admin.get("/metrics").text
    assert 'model="known-model"' in before  # configured models keep their own label
    send([f"made-up-{i}" for i in range(500)])  # labelled, each would add hundreds of bytes
    after = gw.admin.get("/metrics").text
    assert "made-up-" not in after
    assert len(after) - len(before) < 4096, f"/metrics grew from {len(before)} to {len(after)} bytes"


# -- portcullis up -------------------------------------------------------------------------------------------------


def children(pid: int) -> list[int]:
    """Processes whose parent is `pid` (from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rpartition(")")[2].split()[1]) == pid:
                found.append(int(entry))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture
def up(tmp_path):
    """`portcullis up --replicas 1` on free ports, healthy; yields (process, engine pid, engine port, log path)."""
    port, engine_port, admin_port = free_port(), free_port(), free_port()
    log = tmp_path / "up.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gateway.cli",
                "up",
                "--replicas",
                "1",
                "--engine-port",
                str(engine_port),
                "--port",
                str(port),
                "--admin-port",
                str(admin_port),
            ],
            cwd=ROOT,
            env={**os.environ, STATE_ENV: str(tmp_path / "state")},  # its generated admin token: not in $HOME
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    engines: list[int] = []
    try:
        deadline = time.monotonic() + 300  # the real engine loads its model: 10-30 s alone, more on a busy box
        while True:
            assert proc.poll() is None, log.read_text(errors="replace")
            assert time.monotonic() < deadline, log.read_text(errors="replace")
            engines = engines or children(proc.pid)
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        assert len(engines) == 1, engines
        yield proc, engines[0], engine_port, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in engines:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_sigterm_to_up_leaves_no_engine_running(up):
    proc, engine, engine_port, log = up
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    deadline = time.monotonic() + 30
    while alive(engine) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(engine), f"engine pid {engine} outlived `portcullis up`:\n{log.read_text(errors='replace')}"
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{engine_port}/health", timeout=2)


def test_up_reports_an_engine_that_dies(up):
    proc, engine, engine_port, log = up
    os.kill(engine, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while f"engine on port {engine_port}" not in log.read_text(errors="replace"):
        assert time.monotonic() < deadline, log.read_text(errors="replace")
        time.sleep(0.2)
    assert proc.poll() is None  # the gateway goes on
