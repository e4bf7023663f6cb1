"""The admin plane answers only on its own listener, and only to its operator: the public port says nothing about
internals, and a web page the operator opens (a cross-site request, a DNS-rebound name) can neither change nor read
anything on the admin listener, though it binds loopback.

The module's gateway runs as `portcullis serve` does by default: no `admin.token_env`, so it generated its admin
token. The tests that only read, or make keys of a tenant of their own, share it; those that need a home directory,
a configured token or a stopped Redis start their own."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import yaml

from tests.conftest import ROOT, STATE_ENV, Launcher, Process, chat_body, free_port, pool
from tests.hostile.raw_http import Answer, connect, read_answer

INTERNAL = ("/metrics", "/admin/policy")


@pytest.fixture(scope="module")
def upstream(module_launcher: Launcher) -> Process:
    return module_launcher.fake_upstream()


@pytest.fixture(scope="module")
def gw(module_launcher: Launcher, upstream: Process) -> Process:
    return module_launcher.gateway(
        {
            "pools": [pool("main", upstream.url), pool("gone", "http://127.0.0.1:9", models=["x"])],
            "auth": {"keys": [{"tenant": "team-secret", "sha256": "a" * 64}]},
        }
    )


def test_internals_are_not_served_on_the_public_port(gw):
    for path in INTERNAL:
        response = httpx.get(gw.url + path)
        assert response.status_code == 404, path
        assert response.json()["error"]["code"] == "not_found"
        assert "team-secret" not in response.text
    ready = httpx.get(gw.url + "/readyz")
    assert ready.status_code == 503 and ready.json() == {"status": "not_ready"}  # no replica URLs
    assert httpx.get(gw.url + "/healthz").json() == {"status": "ok"}


def test_the_admin_listener_serves_metrics_readiness_and_policy(gw):
    assert "# TYPE portcullis_requests_total counter" in gw.admin.get("/metrics").text
    assert gw.admin.get("/admin/policy").json()["directory"] == "policies"
    pools = gw.admin.get("/readyz").json()["pools"]
    assert pools["gone"] == [{"url": "http://127.0.0.1:9", "up": False}]


def test_the_admin_listener_does_not_proxy(gw):
    response = gw.admin.post("/v1/chat/completions", json={"model": "m", "messages": []})
    assert response.status_code == 404


def test_an_admin_token_is_required_when_configured(upstream, gateway):
    gw = gateway(
        {"pools": [pool("main", upstream.url)], "admin": {"token_env": "ADMIN_TOKEN"}},
        env={"ADMIN_TOKEN": "s3cret-admin"},
    )
    refused = httpx.get(gw.admin_url + "/metrics")
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_admin_token"
    assert httpx.get(gw.admin_url + "/metrics", headers={"authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(gw.admin_url + "/metrics", headers={"authorization": "Bearer s3cret-admin"}).status_code == 200


def test_a_store_that_is_down_is_a_503_on_the_key_and_spend_routes(upstream, gateway, redis_server):
    """Keys and spend in Redis, and Redis gone: the operator is told the store is unavailable, not that the gateway
    failed; once it is back the same calls work."""
    gw = gateway(
        {
            "pools": [pool("main", upstream.url)],
            "redis": {"url": redis_server.url},
            "store": {"backend": "redis"},
        }
    )
    redis_server.kill()
    for answer in (
        gw.admin.post("/admin/keys", json={"tenant": "team-a"}, timeout=10),
        gw.admin.post("/admin/keys/0123456789ab/revoke", json={}, timeout=10),  # not taken as a 404
        gw.admin.get("/admin/keys", timeout=10),
        gw.admin.get("/admin/spend", timeout=10),
    ):
        assert answer.status_code == 503, answer.text
        assert answer.json()["error"]["code"] == "store_unavailable"
    redis_server.start()
    assert gw.admin.post("/admin/keys", json={"tenant": "team-a"}, timeout=10).status_code == 201
    assert gw.admin.get("/admin/spend", timeout=10).status_code == 200


class MainThreadWaits:
    """How long a process's main thread (the gateway's event loop) has waited on something other than a CPU since
    this was made: wall time less the time it ran and the time it was runnable but queued (`/proc/PID/schedstat`).
    A loaded machine stretches a process's running and queueing, not its waits on a peer, so a bound on these holds
    under any load and still tells a read that waited `redis.timeout` from one that waited redis-py's 5 s."""

    def __init__(self, pid: int) -> None:
        self._schedstat = Path(f"/proc/{pid}/schedstat")
        self._start = self._last = self._read()
        assert self._start is not None, "the process is gone"

    def _read(self) -> tuple[float, float] | None:
        """(wall, running or queued) seconds now, or None once the process is gone."""
        try:
            on_cpu, queued, _ = self._schedstat.read_text().split()
        except (FileNotFoundError, ProcessLookupError, ValueError):
            return None
        return time.monotonic(), (int(on_cpu) + int(queued)) / 1e9

    def sample(self) -> None:
        """Take a reading (once the process is gone, the last one stands)."""
        self._last = self._read() or self._last

    def seconds(self) -> float:
        return (self._last[0] - self._start[0]) - (self._last[1] - self._start[1])


def test_a_frozen_redis_costs_the_admin_plane_and_shutdown_only_redis_timeout(upstream, gateway, redis_server):
    """Keys and spend in Redis, and Redis stopped (it accepts connections, answers nothing): each call gives up after
    `redis.timeout`, so the operator gets a 503 at once, and a stopping gateway whose spend cannot be written does
    not wait on Redis. Its waits are counted apart from its running, which a loaded machine stretches (a stop has
    taken 4 s there; under load most of it is its body-check workers' own exits)."""
    gw = gateway(
        {
            "pools": [pool("main", upstream.url)],
            "redis": {"url": redis_server.url, "timeout": 0.25},
            "store": {"backend": "redis", "flush_interval": 60},
            "models": [],  # no tokenizer to load: a stop waits for no warm-up, only for what it must write
        }
    )
    assert gw.admin.get("/admin/spend", timeout=10).status_code == 200  # connected before the freeze
    redis_server.proc.send_signal(signal.SIGSTOP)
    try:
        assert httpx.post(gw.url + "/v1/chat/completions", json=chat_body(), timeout=10).status_code == 200
        waits = MainThreadWaits(gw.proc.pid)
        answer = gw.admin.get("/admin/spend", timeout=30)
        waits.sample()
        assert answer.status_code == 503, answer.text
        assert answer.json()["error"]["code"] == "store_unavailable"
        assert waits.seconds() < 3  # a flush and a read, 0.25 s each, not redis-py's 5 s apiece
        waits = MainThreadWaits(gw.proc.pid)
        gw.proc.terminate()
        deadline = time.monotonic() + 30
        while "rows could not be written" not in gw.output() and gw.proc.poll() is None and time.monotonic() < deadline:
            waits.sample()
            time.sleep(0.005)
        assert "rows could not be written before stopping" in gw.output()
        assert waits.seconds() < 3, gw.output()  # from the signal, its last flush fails in 0.25 s, not 5 s
        gw.proc.wait(timeout=30)
    finally:
        redis_server.proc.send_signal(signal.SIGCONT)


# -- what a web page can make the operator's browser send ----------------------------------------------------------


def raw_request(gw: Process, method: str, path: str, headers: dict[str, str], body: bytes = b"") -> Answer:
    """One request to the admin listener, its head written byte for byte as given (no Host added, nothing normalised:
    what a browser sends for a page's form or fetch); the connection closes after the answer."""
    head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    head += f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    with connect(gw.admin_url) as sock:
        sock.sendall(head.encode() + body)
        answer = read_answer(sock)
    assert answer is not None, "the admin listener closed without an answer"
    return answer


def own_host(gw: Process) -> str:
    return urlsplit(gw.admin_url).netloc


def keys_of(gw: Process, tenant: str) -> list[dict]:
    return gw.admin.get("/admin/keys", params={"tenant": tenant}).json()["data"]


def test_a_cross_site_post_as_found_creates_no_key(gw):
    """The request an attacker's page sent through the operator's browser: a 'simple' POST (text/plain, so no CORS
    preflight), on a DNS-rebound name, from a foreign origin, without the token. Before, it answered 201 with a
    secret."""
    answer = raw_request(
        gw,
        "POST",
        "/admin/keys",
        {
            "host": f"evil.example:{urlsplit(gw.admin_url).port}",
            "origin": "http://evil.example",
            "content-type": "text/plain",
        },
        json.dumps({"tenant": "csrf-as-found"}).encode(),
    )
    assert answer.status in (403, 415, 421), answer.body
    assert b"secret" not in answer.body
    assert keys_of(gw, "csrf-as-found") == []


def test_a_text_plain_post_is_refused_with_415_even_with_the_token(gw):
    """A form or a text/plain fetch needs no preflight; the admin API takes only JSON for a change."""
    headers = {"host": own_host(gw), "authorization": f"Bearer {gw.admin_token}"}
    body = json.dumps({"tenant": "csrf-text-plain"}).encode()
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        answer = raw_request(gw, "POST", "/admin/keys", {**headers, "content-type": content_type}, body)
        assert answer.status == 415, (content_type, answer.body)
        assert answer.error()["code"] == "unsupported_media_type"
    assert raw_request(gw, "POST", "/admin/keys/abcdef123456/revoke", headers).status == 415  # no body, no type
    assert keys_of(gw, "csrf-text-plain") == []
    made = raw_request(gw, "POST", "/admin/keys", {**headers, "content-type": "application/json; charset=utf-8"}, body)
    assert made.status == 201, made.body  # the same request as JSON is served


def test_a_host_that_does_not_name_the_admin_listener_is_refused(gw):
    """A DNS-rebound name reaches the listener with the attacker's name in Host; the listener's own names pass."""
    port = urlsplit(gw.admin_url).port
    token = {"authorization": f"Bearer {gw.admin_token}"}
    for host in (
        f"evil.example:{port}",
        "evil.example",
        "127.0.0.1",
        f"127.0.0.1:{port + 1}",
        f"localhost.evil:{port}",
    ):
        answer = raw_request(gw, "GET", "/admin/keys", {**token, "host": host})
        assert answer.status == 421, (host, answer.body)
        assert answer.error()["code"] == "admin_host_not_allowed" and "admin.allowed_hosts" in answer.error()["message"]
    assert raw_request(gw, "GET", "/admin/keys", token).status == 421  # no Host at all
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"LOCALHOST:{port}"):
        assert raw_request(gw, "GET", "/admin/keys", {**token, "host": host}).status == 200, host


def test_a_foreign_origin_is_refused_and_the_listeners_own_is_not(gw):
    headers = {"host": own_host(gw), "authorization": f"Bearer {gw.admin_token}", "content-type": "application/json"}
    body = json.dumps({"tenant": "csrf-origin"}).encode()
    for origin in ("http://evil.example", "null", f"http://{own_host(gw)}.evil.example", "http://127.0.0.1:1"):
        answer = raw_request(gw, "POST", "/admin/keys", {**headers, "origin": origin}, body)
        assert answer.status == 403, (origin, answer.body)
        assert answer.error()["code"] == "admin_origin_not_allowed"
    assert raw_request(gw, "GET", "/metrics", {**headers, "origin": "http://evil.example"}).status == 403
    assert keys_of(gw, "csrf-origin") == []
    assert raw_request(gw, "POST", "/admin/keys", {**headers, "origin": f"http://{own_host(gw)}"}, body).status == 201


def test_every_admin_route_needs_the_token_by_default(gw):
    """No admin.token_env: the gateway generated a token, and nothing on the admin listener answers without it."""
    for path in ("/metrics", "/readyz", "/healthz", "/admin/policy", "/admin/keys", "/admin/spend"):
        answer = raw_request(gw, "GET", path, {"host": own_host(gw)})
        assert answer.status == 401, (path, answer.body)
        assert answer.error()["code"] == "invalid_admin_token" and answer.headers["www-authenticate"] == "Bearer"
    refused = raw_request(
        gw, "POST", "/admin/keys", {"host": own_host(gw), "content-type": "application/json"}, b'{"tenant": "no-token"}'
    )
    assert refused.status == 401 and keys_of(gw, "no-token") == []
    wrong = raw_request(gw, "GET", "/metrics", {"host": own_host(gw), "authorization": "Bearer " + "x" * 43})
    assert wrong.status == 401


def test_a_prometheus_scrape_with_the_token_is_served(gw):
    """What Prometheus sends: a GET with the bearer token, its Host the target's address, no Origin."""
    scrape = raw_request(
        gw,
        "GET",
        "/metrics",
        {"host": own_host(gw), "authorization": f"Bearer {gw.admin_token}", "accept": "text/plain;version=0.0.4"},
    )
    assert scrape.status == 200 and b"portcullis_requests_total" in scrape.body


# -- the generated token -------------------------------------------------------------------------------------------


def home_env(home: Path) -> dict[str, str]:
    """A user whose home is `home`, with no $XDG_STATE_HOME: the generated token goes to ~/.local/state."""
    return {"HOME": str(home), STATE_ENV: ""}


def test_the_generated_token_file_is_the_owners_alone_works_and_is_kept_across_starts(upstream, launcher, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    config = {"pools": [pool("main", upstream.url)]}
    first = launcher.gateway(config, env=home_env(home))
    path = home / ".local" / "state" / "portcullis" / "admin-token"
    assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o777 == 0o700
    assert not [p for p in path.parent.iterdir() if p != path], "no temporary file is left beside it"
    token = path.read_text().strip()
    assert len(token) >= 40
    assert first.output().count(token) == 1  # printed once, at the start that made it
    authorised = {"authorization": f"Bearer {token}"}
    assert httpx.get(first.admin_url + "/metrics", headers=authorised).status_code == 200
    assert httpx.get(first.admin_url + "/metrics").status_code == 401
    first.stop()

    second = launcher.gateway(config, env=home_env(home))
    assert path.read_text().strip() == token
    assert httpx.get(second.admin_url + "/metrics", headers=authorised).status_code == 200
    assert token not in second.output() and "generated the admin token" not in second.output()


def test_portcullis_keys_finds_the_generated_token_by_itself(upstream, launcher, tmp_path):
    """The operator's CLI on the same machine, run from another directory, neither told the token nor its file."""
    home = tmp_path / "home"
    elsewhere = tmp_path / "elsewhere"
    home.mkdir()
    elsewhere.mkdir()
    gw = launcher.gateway({"pools": [pool("main", upstream.url)]}, env=home_env(home))
    made = gw.admin.post("/admin/keys", json={"tenant": "cli-found-it"})
    assert made.status_code == 201
    env = {
        "PATH": os.environ["PATH"],
        "PYTHONPATH": str(ROOT),  # this checkout's gateway, run from another directory
        **home_env(home),
        "PORTCULLIS_ADMIN_URL": gw.admin_url,
    }
    command = [sys.executable, "-m", "gateway.cli", "keys", "list", "--tenant", "cli-found-it"]
    listed = subprocess.run(command, capture_output=True, text=True, cwd=elsewhere, env=env, timeout=60)
    assert listed.returncode == 0, listed.stderr
    assert made.json()["id"] in listed.stdout

    other_home = tmp_path / "other-home"  # another user: no token file, so a 401 that says where to look
    other_home.mkdir()
    stranger = subprocess.run(
        command, capture_output=True, text=True, cwd=elsewhere, env={**env, **home_env(other_home)}, timeout=60
    )
    assert stranger.returncode == 1 and "--admin-token-file" in stranger.stderr

    given = subprocess.run(
        [*command, "--admin-token-file", str(home / ".local" / "state" / "portcullis" / "admin-token")],
        capture_output=True,
        text=True,
        cwd=elsewhere,
        env={**env, **home_env(other_home)},
        timeout=60,
    )
    assert given.returncode == 0 and made.json()["id"] in given.stdout, given.stderr


# -- binding beyond loopback ---------------------------------------------------------------------------------------


def serve_refused(config: dict, tmp_path: Path) -> tuple[Path, str]:
    """Runs `portcullis serve` with `config` (ports and store filled in), which must refuse to start with status 2;
    returns the config file's path and what it printed."""
    full = {
        "listen": {"host": "127.0.0.1", "port": free_port()},
        "store": {"sqlite_path": str(tmp_path / "portcullis.db")},
        **config,
        "admin": {"port": free_port(), **config.get("admin", {})},
    }
    path = tmp_path / "portcullis.yaml"
    path.write_text(yaml.safe_dump(full))
    done = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "serve", "--config", str(path)],
        cwd=ROOT,
        env={**os.environ, STATE_ENV: str(tmp_path / "state")},
        capture_output=True,
        text=True,
        timeout=60,  # a gateway that starts runs until then: the refusal comes at once
    )
    assert done.returncode == 2, done.stderr
    return path, done.stderr


def test_binding_the_admin_listener_beyond_loopback_without_token_env_refuses_to_start(upstream, tmp_path):
    path, said = serve_refused({"admin": {"host": "0.0.0.0"}, "pools": [pool("main", upstream.url)]}, tmp_path)
    assert f"{path}: admin:" in said and "admin.host '0.0.0.0'" in said
    assert "admin.token_env" in said and "one machine's operator" in said
    assert not (tmp_path / "state").exists(), "no token was generated for it"


def test_a_token_file_others_may_read_refuses_the_start(upstream, tmp_path):
    token_file = tmp_path / "admin-token"
    token_file.write_text("a-token-someone-else-may-have-read\n")
    token_file.chmod(0o644)
    _, said = serve_refused({"admin": {"token_file": str(token_file)}, "pools": [pool("main", upstream.url)]}, tmp_path)
    assert f"admin.token_file: {token_file} may be read or written by others (mode 0644)" in said
    assert f"chmod 600 {token_file}" in said
