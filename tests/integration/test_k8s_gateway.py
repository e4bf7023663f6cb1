"""The Kubernetes deployment's gateway config, as the overlays render it, run by two real gateway processes: two pods
of the Deployment. Only what cannot exist here is swapped: the engines become a fake upstream, Redis a local
redis-server, the ports free loopback ones, one worker a pod, and tracing is off (no Jaeger here). The Secret's
variables come from the example Secret's keys."""

from __future__ import annotations

import time

import httpx
import pytest
import yaml

from tests.conftest import Launcher, RedisServer, chat_body
from tests.kustomize import BASE, OVERLAYS, render

CHAT = "/v1/chat/completions"


def rendered_config(overlay: str) -> dict:
    """The portcullis.yaml the overlay mounts into the gateway pods."""
    objects = render(overlay)
    (configmap,) = [o for o in objects if o["kind"] == "ConfigMap" and "portcullis.yaml" in o.get("data", {})]
    return yaml.safe_load(configmap["data"]["portcullis.yaml"])


def example_secret() -> dict[str, str]:
    (secret,) = [d for d in yaml.safe_load_all((BASE / "secret.example.yaml").read_text()) if d["kind"] == "Secret"]
    return {name: f"test-{name.lower()}" if value else "" for name, value in secret["stringData"].items()}


@pytest.fixture(scope="module")
def pods(module_launcher: Launcher, module_redis_server: RedisServer) -> tuple[list, dict[str, str]]:
    """Two gateway pods sharing one Redis; the tests below keep to a tenant and keys of their own."""
    configs = [rendered_config(overlay) for overlay in OVERLAYS]
    assert all(c == configs[0] for c in configs), "the overlays run different gateway configs: test each"
    config = configs[0]
    upstream = module_launcher.fake_upstream()
    for pool in config["pools"]:
        pool["replicas"] = [{"url": upstream.url}]
    config["redis"]["url"] = module_redis_server.url
    config["listen"]["workers"] = 1
    config["telemetry"]["otlp"]["enabled"] = False
    del config["admin"]["host"], config["admin"]["port"]  # the launcher's loopback port
    env = example_secret()
    return [module_launcher.gateway(config, env=env) for _ in range(2)], env


def test_a_key_made_through_one_pod_works_on_the_other(pods, module_launcher: Launcher):
    (one, other), env = pods
    made = one.admin.post("/admin/keys", json={"tenant": "team-k8s"})
    assert made.status_code == 201, made.text
    secret = made.json()["secret"]
    deadline = time.monotonic() + 5  # store.poll_interval is 0.25 s
    while (status := _chat(other, secret)) != 200:
        assert status == 401 and time.monotonic() < deadline, f"the other pod answers {status} to the new key"
        time.sleep(0.1)
    assert _chat(one, env["PORTCULLIS_CLIENT_KEY"]) == _chat(other, env["PORTCULLIS_CLIENT_KEY"]) == 200
    assert _chat(other, "sk-never-made") == 401
    leftovers = sorted(p.name for p in module_launcher.directory.glob("portcullis-*.db*"))
    assert leftovers == [], f"a pod wrote a SQLite store on its read-only root filesystem: {leftovers}"


def test_the_admin_port_answers_prometheus_with_the_secrets_token_only(pods):
    (gw, _), env = pods
    scraped = httpx.get(gw.admin_url + "/metrics", headers={"authorization": f"Bearer {env['PORTCULLIS_ADMIN_TOKEN']}"})
    assert scraped.status_code == 200 and "portcullis_requests_total" in scraped.text
    assert httpx.get(gw.admin_url + "/metrics").status_code == 401
    wrong = httpx.get(gw.admin_url + "/metrics", headers={"authorization": f"Bearer {env['PORTCULLIS_CLIENT_KEY']}"})
    assert wrong.status_code == 401


def _chat(gw, key: str) -> int:
    return httpx.post(
        gw.url + CHAT, json=chat_body(), headers={"authorization": f"Bearer {key}"}, timeout=30
    ).status_code
