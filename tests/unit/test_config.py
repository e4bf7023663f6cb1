"""Config loading: embedded defaults, and errors that name the file, the key path and the problem."""

from __future__ import annotations

import hashlib

import pytest

from gateway.config import ConfigError, GatewayConfig, load_config


def test_no_file_gives_working_defaults(monkeypatch):
    monkeypatch.delenv("PORTCULLIS_CONFIG", raising=False)
    config = load_config()
    assert config.listen.port == 8080 and config.listen.host == "127.0.0.1"
    assert [r.url for r in config.pools[0].replicas] == ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]
    assert config.telemetry.otlp.enabled is False and config.telemetry.otlp.endpoint == "http://localhost:4318"


def test_path_comes_from_environment(monkeypatch, tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("listen: {port: 9999}\n")
    monkeypatch.setenv("PORTCULLIS_CONFIG", str(path))
    assert load_config().listen.port == 9999


@pytest.mark.parametrize(
    "text, where, problem",
    [
        ("pools:\n  - name: a\n    replicas: [{url: 'ftp://x'}]\n", "pools[0].replicas[0].url", "http://"),
        ("listen: {port: 70000}\n", "listen.port", "less than or equal"),
        ("pools: []\n", "pools", "at least 1"),
        ("telemetry: {otlp: {protocol: thrift}}\n", "telemetry.otlp.protocol", "grpc"),
        ("listn: {port: 1}\n", "listn", "Extra inputs"),
        ("auth: {keys: [{tenant: t}]}\n", "auth.keys[0]", "exactly one of"),
        ("auth: {keys: [{tenant: t, sha256: abc}]}\n", "auth.keys[0]", "64 lowercase hex"),
        ("redis: {url: 'localhost:6379'}\n", "redis.url", "redis://"),
        ("redis: {url: 'redis://cache:99999'}\n", "redis.url", "Port out of range"),
        ("redis: {url: 'redis://cache?socket_timeout=soon'}\n", "redis.url", "socket_timeout"),
        ("admin: {host: '::'}\n", "admin", "admin.token_env is not set"),
        ("admin: {host: admin.internal, token_file: /t}\n", "admin", "admin.token_env is not set"),
        ("admin: {token_env: T, token_file: /t}\n", "admin", "set one of them"),
        ("admin: {allowed_hosts: ['ops.example/x']}\n", "admin.allowed_hosts[0]", "should match pattern"),
        # a model a config names is one a client could name (gateway/apis/model_name.py): visible ASCII, 256 at most
        ("pools:\n  - {name: a, replicas: [{url: 'http://x'}], models: [模型]}\n", "pools[0].models[0]", "pattern"),
        ("models: [{name: 'a model'}]\n", "models[0].name", "pattern"),
        ('fallbacks: [{model: a, to: [{model: "b\\x7f"}]}]\n', "fallbacks[0].to[0].model", "pattern"),
        (f"fallbacks: [{{model: {'m' * 257}, to: [{{pool: p}}]}}]\n", "fallbacks[0].model", "pattern"),
        (
            "pools:\n  - {name: a, replicas: [{url: 'http://x'}]}\n  - {name: a, replicas: [{url: 'http://y'}]}\n",
            "pools",
            "unique",
        ),
    ],
)
def test_errors_name_file_key_path_and_problem(tmp_path, text, where, problem):
    path = tmp_path / "portcullis.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert f"{path}: {where}:" in message and problem in message


@pytest.mark.parametrize("text, problem", [(":\n  - [", "invalid YAML"), ("- a\n- b\n", "must be a mapping")])
def test_unparseable_files_are_reported(tmp_path, text, problem):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=problem):
        load_config(path)


def test_missing_file_is_reported(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "absent.yaml")


def test_secrets_come_from_the_environment(monkeypatch):
    config = GatewayConfig.model_validate(
        {
            "pools": [{"name": "p", "replicas": [{"url": "http://x"}], "api_key_env": "UPSTREAM_KEY"}],
            "auth": {"keys": [{"tenant": "t", "key_env": "CLIENT_KEY"}]},
        }
    )
    monkeypatch.setenv("UPSTREAM_KEY", "sk-up")
    monkeypatch.setenv("CLIENT_KEY", "sk-client")
    assert config.pools[0].api_key() == "sk-up"
    assert config.auth.keys[0].digest() == hashlib.sha256(b"sk-client").digest()
    monkeypatch.delenv("CLIENT_KEY")
    with pytest.raises(ConfigError, match="CLIENT_KEY is not set"):
        config.auth.keys[0].digest()
