"""What an operator runs around the gateway: `portcullis --version`, `portcullis config check`, and one log format
(`--log-format` / $PORTCULLIS_LOG_FORMAT) for the gateway and the engine alike."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from backend_engine.config import DEFAULT_SERVED_MODEL_NAME
from tests.conftest import ROOT, chat_body, free_port, pool


def portcullis(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=60, env=env
    )


def test_version_names_the_release_the_build_info_metric_reports(launcher):
    shown = portcullis("--version")
    assert shown.returncode == 0
    name, version = shown.stdout.split()
    assert name == "portcullis" and version
    gw = launcher.gateway({"pools": [pool("main", launcher.fake_upstream().url)]})
    families = text_string_to_metric_families(gw.admin.get("/metrics").text)
    (info,) = [s for f in families if f.name == "portcullis_build_info" for s in f.samples]
    assert info.labels["version"] == version and info.value == 1


def test_config_check_reports_start_s_own_errors_and_exits_1(tmp_path: Path):
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump({"pools": [pool("main", "http://127.0.0.1:8001")]}))
    checked = portcullis("config", "check", str(good))
    assert (checked.returncode, checked.stdout.split(":")[0]) == (0, str(good))

    bad = tmp_path / "portcullis.yaml"
    bad.write_text(yaml.safe_dump({"pools": [pool("main", "ftp://127.0.0.1:8001")], "telemetry": {"sampling": 1}}))
    checked = portcullis("config", "check", str(bad))
    assert checked.returncode == 1
    assert f"{bad}: pools[0].replicas[0].url: Value error, must start with http:// or https://" in checked.stderr
    assert f"{bad}: telemetry.sampling: Extra inputs are not permitted" in checked.stderr
    started = portcullis("serve", "--config", str(bad))
    assert started.returncode != 0 and checked.stderr in started.stderr, "the same errors as start"


def test_config_check_refuses_an_otel_variable_the_gateway_cannot_use(tmp_path: Path):
    good = tmp_path / "portcullis.yaml"
    good.write_text(yaml.safe_dump({"pools": [pool("main", "http://127.0.0.1:8001")]}))
    env = {"PATH": "/usr/bin:/bin", "OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "1.5"}
    checked = portcullis("config", "check", env={**env, "PORTCULLIS_CONFIG": str(good)})
    assert checked.returncode == 1 and "OTEL_TRACES_SAMPLER_ARG: '1.5'" in checked.stderr


def test_the_gateway_logs_text_when_asked(launcher):
    upstream = launcher.fake_upstream()
    gw = launcher.gateway({"pools": [pool("main", upstream.url)]}, env={"PORTCULLIS_LOG_FORMAT": "text"})
    response = httpx.post(gw.url + "/v1/chat/completions", json=chat_body())
    request_id = response.headers["x-request-id"]
    gw.terminate()
    gw.proc.wait(timeout=15)
    lines = [line for line in gw.output().splitlines() if line.strip()]
    assert not [line for line in lines if line.startswith("{")], "no JSON line"
    (access,) = [line for line in lines if f"request_id={request_id}" in line]
    assert " access " in access and " status=200" in access


def test_the_engine_logs_json_lines_as_the_gateway_does(launcher):
    def engine(port: int) -> list[str]:
        args = ["engine", "serve", "--port", str(port), "--threads", "1", "--kv-cache-bytes", "64M"]
        return [sys.executable, "-m", "gateway.cli", *args]

    served = launcher.spawn(engine, "engine", ready_path="/health", timeout=300)
    body = {"model": DEFAULT_SERVED_MODEL_NAME, "prompt": "Hello", "max_tokens": 2}
    assert httpx.post(served.url + "/v1/completions", json=body, timeout=60).status_code == 200
    served.terminate()
    served.proc.wait(timeout=15)
    lines = [line for line in served.output().splitlines() if line.strip()]
    records = [json.loads(line) for line in lines]  # every line, uvicorn's too
    assert {"level", "logger", "message"} <= set(records[0])
    assert any(r["logger"].startswith("uvicorn") for r in records)


def test_a_log_format_that_does_not_exist_stops_the_start_naming_the_variable(tmp_path: Path):
    config = tmp_path / "portcullis.yaml"
    listen = {"host": "127.0.0.1", "port": free_port()}  # were it to start, on no port of anyone's
    admin = {"port": free_port(), "token_file": str(tmp_path / "token")}
    config.write_text(
        yaml.safe_dump({"pools": [pool("main", "http://127.0.0.1:8001")], "listen": listen, "admin": admin})
    )
    env = {"PATH": "/usr/bin:/bin", "PORTCULLIS_LOG_FORMAT": "xml"}
    started = portcullis("serve", "--config", str(config), env=env)
    assert started.returncode == 2
    assert "PORTCULLIS_LOG_FORMAT='xml' is none of json, text" in started.stderr


def test_config_check_refuses_an_mcp_servers_credential_the_environment_lacks(tmp_path: Path):
    config = tmp_path / "portcullis.yaml"
    server = {"name": "github", "url": "https://mcp.example.com/mcp", "api_key_env": "PORTCULLIS_TEST_MCP_TOKEN"}
    config.write_text(yaml.safe_dump({"pools": [pool("main", "http://127.0.0.1:8001")], "mcp_servers": [server]}))
    env = {"PATH": "/usr/bin:/bin"}
    checked = portcullis("config", "check", str(config), env=env)
    assert checked.returncode == 1
    assert (
        "mcp_servers[github].api_key_env: environment variable PORTCULLIS_TEST_MCP_TOKEN is not set" in checked.stderr
    )
    assert portcullis("config", "check", str(config), env={**env, "PORTCULLIS_TEST_MCP_TOKEN": "t"}).returncode == 0
