#!/usr/bin/env python
"""Gateway proxy overhead benchmark: Portcullis vs nginx vs LiteLLM in front of the same static upstream.

    python -m bench.proxy_bench [--duration 10] [--out results.json] [--profile-dir DIR] [--keys [--keys-pairs N]]

One run, all on 127.0.0.1 free ports:

* a static upstream: nginx (1 worker) answering POST /v1/chat/completions with a fixed chat.completion (with usage),
* nginx (1 worker) as a reverse proxy in front of it (keepalive upstream connections),
* the Portcullis gateway (`portcullis serve`, 1 process), auth on, twice: access log on (the default, written to a
  file) and access log off,
* the LiteLLM proxy (1 worker, master key so auth is on) from a separate venv at .bench/litellm-venv
  (`pip install 'litellm[proxy]'` there; skipped with a note if it is missing),

then wrk against each: `-t1 -c32` for throughput and `-t1 -c1 --latency` for p50/p99, POSTing a small non-streaming
chat request with an Authorization header. "Added" latency is a target's p50/p99 minus the direct upstream's.

With --keys, three more rows, access log off: the config's static key ("Portcullis, static key", the baseline), and
a key made in the key store before the gateway starts (SQLite, then Redis on a local redis-server) with a priced
policy and a budget rule (per tenant) no run spends; wrk sends each row's own key. Before and after the runs, a
request priced past the limit must be refused for the budget, saying what is left. --keys-pairs N alternates short
c32 runs of each key-store row and the static-key row (A B B A ...) and reports the median RPS and CPU-per-request
ratios with their quartiles.

With --cache, two more rows, access log off: the repo's base policy with the response cache on (`spec.cache`: wrk's
request is a deterministic one, temperature 0), its answers in memory, then in Redis (a local redis-server): every
request but the first is a hit, answered without the upstream. Read against "Portcullis (access log off)", the same
policy without the cache, where every request is proxied: what a hit costs beside the gateway's own overhead.

With --profile-dir, py-spy (from .bench/tools-venv, or $PY_SPY) records the access-log-on gateway during an extra
32-connection run and the script prints a self-time summary grouped by package.

With --workers-compare, only this: the gateway with listen.workers 1, then 2, wrk and the static upstream pinned
(taskset) to --load-cpus in both runs; RPS, latency and CPU per request of the gateway's whole process tree.
--with-workers adds those rows after the others, so one run gives the whole gateway table.

Not a pytest module (no test_ prefix, no test functions): it needs nginx, wrk and minutes of wall time.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import hashlib
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NGINX_TEMPLATES = Path(__file__).resolve().parent / "nginx"
LITELLM_VENV = REPO / ".bench" / "litellm-venv"
TOOLS_VENV = REPO / ".bench" / "tools-venv"

API_KEY = "sk-bench-portcullis-0123456789abcdef"
MODEL = "bench-model"

CHAT_COMPLETION = {
    "id": "chatcmpl-bench0001",
    "object": "chat.completion",
    "created": 1700000000,
    "model": MODEL,
    "system_fingerprint": "fp_bench",
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Hello! This is a fixed benchmark completion."},
            "logprobs": None,
            "finish_reason": "stop",
        }
    ],
    "usage": {"prompt_tokens": 12, "completion_tokens": 9, "total_tokens": 21},
}
MODELS = {"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0, "owned_by": "bench"}]}
REQUEST = {
    "model": MODEL,
    "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}],
    "max_tokens": 16,
    "temperature": 0.0,
    "stream": False,
}

WRK_LUA = r"""
wrk.method = "POST"
wrk.body = [==[@BODY@]==]
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer @KEY@"

done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRKJSON {"requests":%d,"duration_us":%d,"bytes":%d,"err_connect":%d,"err_read":%d,"err_write":%d,' ..
    '"err_status":%d,"err_timeout":%d,"lat_mean_us":%.3f,"lat_stdev_us":%.3f,"lat_max_us":%d,' ..
    '"p50_us":%d,"p90_us":%d,"p99_us":%d,"p999_us":%d}\n',
    summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write, e.status, e.timeout,
    latency.mean, latency.stdev, latency.max,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency:percentile(99.9)))
end
"""


# Appended to WRK_LUA for a body holding "@N@": each request gets a number of its own there (a user message that
# differs on every request, as real traffic does), random per wrk thread and run so no two runs repeat a body
VARY_LUA = r"""
math.randomseed(os.time() + tonumber(tostring({}):match("0x(%x+)") or "0", 16))
local head, tail = string.match(wrk.body, "^(.-)@N@(.*)$")
request = function()
  return wrk.format(nil, nil, nil, head .. math.random(1, 2000000000) .. tail)
end
"""


def write_wrk_script(path: Path, key: str, request: dict | None = None) -> Path:
    """wrk's Lua script POSTing `request` (default REQUEST) with `key` as the bearer token."""
    body = json.dumps(request or REQUEST, separators=(",", ":"))
    path.write_text(WRK_LUA.replace("@BODY@", body).replace("@KEY@", key))
    return path


# --------------------------------------------------------------------------------------------------------------------
# processes


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Service:
    name: str
    proc: subprocess.Popen
    port: int
    log_path: Path
    admin_port: int | None = None  # a gateway's admin listener (/metrics)


@dataclass
class Procs:
    services: list[Service] = field(default_factory=list)

    def start(
        self,
        name: str,
        argv: list[str],
        port: int,
        log_path: Path,
        env: dict | None = None,
        stderr_path: Path | None = None,
    ) -> Service:
        out = open(log_path, "ab")
        err = open(stderr_path, "ab") if stderr_path else subprocess.STDOUT
        proc = subprocess.Popen(argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        service = Service(name, proc, port, log_path)
        self.services.append(service)
        return service

    def stop(self, service: Service) -> None:
        """SIGTERM the service's own process group (it leads one: start_new_session), then SIGKILL if it lingers."""
        proc = service.proc
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)
        else:  # the leader is gone; make sure nothing it forked is left in its group
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        if service in self.services:
            self.services.remove(service)

    def stop_all(self) -> None:
        for service in reversed(list(self.services)):
            try:
                self.stop(service)
            except Exception as exc:  # keep cleaning up the rest
                print(f"warning: stopping {service.name}: {exc}", file=sys.stderr)


def wait_http(service: Service, path: str, timeout: float, method: str = "GET", **kwargs) -> None:
    import httpx

    url = f"http://127.0.0.1:{service.port}{path}"
    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        if service.proc.poll() is not None:
            raise RuntimeError(
                f"{service.name} exited with {service.proc.returncode} before it was ready; "
                f"see {service.log_path}:\n{tail(service.log_path)}"
            )
        try:
            response = httpx.request(method, url, timeout=2.0, **kwargs)
            if response.status_code < 500:
                return
            last = f"HTTP {response.status_code}"
        except Exception as exc:  # noqa: BLE001 - anything means "not yet"
            last = f"{type(exc).__name__}: {exc}"
        time.sleep(0.25)
    raise RuntimeError(
        f"{service.name} not ready after {timeout:.0f}s ({last}); see {service.log_path}:\n{tail(service.log_path)}"
    )


def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def check_chat(port: int, key: str | None = API_KEY, request: dict | None = None) -> dict:
    """One real request: must be 200 with a chat.completion body. Also confirms a wrong key is refused (auth on)."""
    import httpx

    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    request = request or REQUEST
    response = httpx.post(url, json=request, headers={"authorization": f"Bearer {key}"} if key else {}, timeout=30)
    if response.status_code != 200:
        raise RuntimeError(f"check of :{port} answered {response.status_code}: {response.text[:500]}")
    body = response.json()
    if body.get("object") != "chat.completion" or not body.get("choices"):
        raise RuntimeError(f"check of :{port} answered an unexpected body: {response.text[:500]}")
    refused = httpx.post(url, json=request, headers={"authorization": "Bearer sk-wrong-key"}, timeout=30)
    return {
        "status": response.status_code,
        "wrong_key_status": refused.status_code,
        "content": body["choices"][0]["message"]["content"],
        "cache": response.headers.get("x-portcullis-cache"),
    }


# --------------------------------------------------------------------------------------------------------------------
# targets


def render(template: str, **values: object) -> str:
    text = (NGINX_TEMPLATES / template).read_text()
    for key, value in values.items():
        text = text.replace(f"@{key}@", str(value))
    leftover = re.findall(r"@[A-Z_]+@", text)
    if leftover:
        raise RuntimeError(f"{template}: unfilled placeholders {leftover}")
    return text


def start_nginx(procs: Procs, tmp: Path, name: str, template: str, **values: object) -> Service:
    port = free_port()
    conf = tmp / f"{name}.conf"
    conf.write_text(render(template, PREFIX=tmp, PORT=port, **values))
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    service = procs.start(
        name, [nginx, "-c", str(conf), "-p", str(tmp), "-e", str(tmp / f"{name}-error.log")], port, tmp / f"{name}.out"
    )
    return service


def start_static_upstream(procs: Procs, tmp: Path, name: str = "static") -> Service:
    """The static upstream every gateway row proxies to: nginx answering a fixed chat.completion and model list,
    ready for requests."""
    compact = {"separators": (",", ":")}
    static = start_nginx(
        procs,
        tmp,
        name,
        "static.conf.tmpl",
        CHAT_COMPLETION=json.dumps(CHAT_COMPLETION, **compact),
        MODELS=json.dumps(MODELS, **compact),
    )
    wait_http(static, "/v1/models", 15)
    return static


# Rate limits as a typical policy sets them (requests per key, tokens per tenant, concurrency per tenant), with
# quotas no benchmark reaches: every request pays for a full decision and its settlement, none is refused.
LIMITS_POLICY = {
    "apiVersion": "portcullis.dev/v1",
    "kind": "Policy",
    "metadata": {"name": "bench-limits"},
    "spec": {
        "rate_limits": [
            {"id": "key-rpm", "key": ["api_key"], "requests": {"limit": 10**9, "per": "1m"}},
            {"id": "tenant-tpm", "key": ["tenant"], "tokens": {"limit": 10**12, "per": "1m"}},
            {"id": "tenant-slots", "key": ["tenant"], "concurrency": {"limit": 10**6}},
        ]
    },
}


# What the key-store rows add: a price table and a budget rule per tenant, with a limit no run spends, so
# every request reserves spend and settles its cost, and none is refused.
BUDGETS_POLICY = {
    "apiVersion": "portcullis.dev/v1",
    "kind": "Policy",
    "metadata": {"name": "bench-budgets"},
    "spec": {
        "prices": {"models": {MODEL: {"input": 1.0, "output": 2.0}}},
        "budgets": [
            {"id": "tenant-spend", "key": "tenant", "limit": 9_000_000, "period": "month"},
        ],
    },
}


# output tokens whose price alone (2.0 per million) is past BUDGETS_POLICY's limit: a request that reserves them is
# refused for its budget, and the refusal says what is left
PROBE_MAX_TOKENS = 5 * 10**12


# --keys' baseline: the same policy less the prices and budgets (not the repo's, which may gain stages meanwhile).
# --cache's rows: the repo's base policy, the response cache on (a TTL no run outlasts)
def cache_policy() -> dict:
    import yaml

    base = yaml.safe_load((REPO / "policies" / "base.yaml").read_text())
    return {**base, "spec": {**base["spec"], "cache": {"enabled": True, "ttl": "1h"}}}


CACHE_ROWS = (  # target, label, response_cache.store
    ("portcullis_cache_memory", "Portcullis, response cache hit (memory)", "memory"),
    ("portcullis_cache_redis", "Portcullis, response cache hit (Redis)", "redis"),
)

NO_BUDGETS_POLICY = {**BUDGETS_POLICY, "metadata": {"name": "bench-no-budgets"}, "spec": {}}
STATIC_KEY_ROW = "portcullis_static_key"  # --keys' baseline: the config's key
# a second static-key gateway, paired with the first like the key-store rows: how far two identical gateways' ratio
# strays on this machine, the noise floor to read the others against
CONTROL_ROW = "portcullis_static_key_control"
KEY_STORE_ROWS = (  # target, label, store backend: a stored key and BUDGETS_POLICY
    ("portcullis_keys_sqlite", "Portcullis + key store (SQLite) + budget", "sqlite"),
    ("portcullis_keys_redis", "Portcullis + key store (Redis) + budget", "redis"),
)


def start_portcullis(
    procs: Procs,
    tmp: Path,
    name: str,
    upstream_port: int,
    access_log: bool,
    redis_url: str | None = None,
    policy: dict | None = None,
    store: str = "sqlite",
    static_key: bool = True,
    checkout: Path | None = None,
    workers: int = 1,
    response_cache: dict | None = None,
) -> Service:
    """One gateway worker with the repo's policies, or `policy` alone; with `redis_url`, limits (and a `store` of
    'redis': keys and spend) in Redis. Its SQLite key store is a file of its own in `tmp` (see `sqlite_path`);
    `static_key`: the config's key (API_KEY) works, besides any stored one.

    `workers`: listen.workers (--workers-compare). `response_cache`: its config section (--cache).

    `checkout` runs an earlier commit's gateway (a `git worktree` of it) with this venv, for a side-by-side row; it
    gets the same config, less the admin listener.
    """
    port = free_port()
    policy_dir = (checkout or REPO) / "policies"
    if policy is not None:
        policy_dir = tmp / f"{name}-policies"
        policy_dir.mkdir()
        (policy_dir / "base.yaml").write_text(json.dumps(policy))
    config: dict = {
        "listen": {"host": "127.0.0.1", "port": port},
        "pools": [{"name": "static", "replicas": [{"url": f"http://127.0.0.1:{upstream_port}"}]}],
        "auth": {"keys": [{"tenant": "bench", "sha256": hashlib.sha256(API_KEY.encode()).hexdigest()}]}
        if static_key
        else {},
        "policy_dir": str(policy_dir),
        "telemetry": {"access_log": access_log},
    }
    if workers != 1:
        config["listen"]["workers"] = workers
    admin_port = free_port()
    config["admin"] = {"port": admin_port, "token_file": str(tmp / f"{name}-admin-token")}  # not in $HOME
    config["store"] = {"backend": store, "sqlite_path": str(sqlite_path(tmp, name))}
    if checkout is not None:  # a gateway of before the admin token file, whose admin plane nothing here reads
        config["admin"] = {"enabled": False}
    if redis_url:
        config["redis"] = {"url": redis_url, "on_failure": "fail_closed", "timeout": 2.0}
    if response_cache is not None:
        config["response_cache"] = response_cache
    path = tmp / f"{name}.yaml"
    path.write_text(json.dumps(config, indent=2))  # JSON is YAML
    exe = Path(sys.prefix) / "bin" / "portcullis"
    if not exe.exists():
        exe = REPO / ".venv" / "bin" / "portcullis"
    env = {**os.environ, "PYTHONUNBUFFERED": "0"}
    argv = [str(exe), "serve", "--config", str(path)]
    if checkout is not None:
        argv = [sys.executable, "-P", "-m", "gateway.cli", "serve", "--config", str(path)]  # -P: not the cwd
        env["PYTHONPATH"] = str(checkout)  # before the venv's editable install of this checkout
    # stdout/stderr to a file, as a collector would take them: the access log is JSON lines on stderr.
    service = procs.start(name, argv, port, tmp / f"{name}.log", env=env)
    service.admin_port = admin_port
    return service


def sqlite_path(tmp: Path, name: str) -> Path:
    """The gateway `name`'s SQLite key store and spend ledger: one per gateway, none left in the working directory."""
    return tmp / f"{name}.db"


def store_key(store: str, tmp: Path, name: str, redis_url: str | None = None) -> str:
    """Write a key for tenant 'bench' into gateway `name`'s key store (its SQLite file, or Redis at `redis_url`), as
    the admin API would, before that gateway starts; returns the secret wrk is to send."""
    import asyncio

    from gateway.keystore.records import KeyRecord, digest_of, new_key_id, new_secret
    from gateway.keystore.redis_store import RedisKeyStore
    from gateway.keystore.sqlite_store import SqliteKeyStore

    key_id = new_key_id()
    secret = new_secret(key_id)
    at = time.time()
    record = KeyRecord(tenant="bench", label=name, id=key_id, digest=digest_of(secret), created_at=at, updated_at=at)

    async def put() -> None:
        if store == "redis":
            assert redis_url is not None
            backend: RedisKeyStore | SqliteKeyStore = RedisKeyStore(redis_url, timeout=2.0)
        else:
            backend = SqliteKeyStore(sqlite_path(tmp, name))
        try:
            await backend.put(record)
        finally:
            await backend.aclose()

    asyncio.run(put())
    return secret


def start_redis(procs: Procs, tmp: Path) -> Service:
    """A local redis-server that keeps nothing on disk, ready for commands."""
    port = free_port()
    argv = [shutil.which("redis-server") or "redis-server", "--port", str(port), "--save", "", "--appendonly", "no"]
    redis = procs.start("redis", [*argv, "--dir", str(tmp)], port, tmp / "redis.log")
    deadline = time.monotonic() + 15
    while True:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1) as conn:
            conn.sendall(b"PING\r\n")
            if conn.recv(64).startswith(b"+PONG"):
                return redis
        if redis.proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"redis-server not ready on :{port}; see {redis.log_path}:\n{tail(redis.log_path)}")
        time.sleep(0.1)


def budget_left(service: Service, key: str) -> str:
    """What is left of the key's tightest budget (`x-portcullis-budget`), as a refusal says it: asked with a request
    whose output budget alone costs more than BUDGETS_POLICY's limit (answers far from a soft threshold carry no
    budget header). Fails when the request is not refused for its budget, i.e. the budgets are not on."""
    import httpx

    response = httpx.post(
        f"http://127.0.0.1:{service.port}/v1/chat/completions",
        json={**REQUEST, "max_tokens": PROBE_MAX_TOKENS},
        headers={"authorization": f"Bearer {key}"},
        timeout=30,
    )
    budget = response.headers.get("x-portcullis-budget")
    code = response.json().get("error", {}).get("code") if response.status_code == 429 else None
    if code != "budget_exceeded" or budget is None:
        raise RuntimeError(
            f"{service.name}: answered {response.status_code} to a request past its budget; budgets off?"
        )
    return budget


def start_litellm(procs: Procs, tmp: Path, upstream_port: int) -> Service | None:
    exe = LITELLM_VENV / "bin" / "litellm"
    if not exe.exists():
        print(
            f"note: {exe} not found; LiteLLM row skipped (python -m venv .bench/litellm-venv && "
            f".bench/litellm-venv/bin/pip install 'litellm[proxy]')",
            file=sys.stderr,
        )
        return None
    port = free_port()
    config = {
        "model_list": [
            {
                "model_name": MODEL,
                "litellm_params": {
                    "model": f"openai/{MODEL}",
                    "api_base": f"http://127.0.0.1:{upstream_port}/v1",
                    "api_key": "dummy",
                },
            }
        ],
        "general_settings": {"master_key": API_KEY},
        "litellm_settings": {"telemetry": False, "set_verbose": False, "json_logs": False},
    }
    path = tmp / "litellm.yaml"
    path.write_text(json.dumps(config, indent=2))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHON"))}
    env.update(
        {
            "LITELLM_LOG": "ERROR",
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # do not fetch the model cost map from GitHub
            "LITELLM_TELEMETRY": "False",
            "DISABLE_ADMIN_UI": "True",
            "NO_DOCS": "True",
            "HOME": str(tmp),  # keep any caches it writes out of the real home
            "PATH": f"{LITELLM_VENV / 'bin'}:{os.environ.get('PATH', '')}",
        }
    )
    env.pop("DATABASE_URL", None)
    argv = [
        str(exe),
        "--config",
        str(path),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--num_workers",
        "1",
        "--telemetry",
        "False",
    ]
    return procs.start("litellm", argv, port, tmp / "litellm.log", env=env)


def litellm_version() -> str | None:
    python = LITELLM_VENV / "bin" / "python"
    if not python.exists():
        return None
    out = subprocess.run(
        [str(python), "-c", "from importlib.metadata import version; print(version('litellm'))"],
        capture_output=True,
        text=True,
    )
    return out.stdout.strip() or None


# --------------------------------------------------------------------------------------------------------------------
# load


def ab_pairs(
    current: Service,
    baseline: Service,
    lua: Path,
    pairs: int,
    seconds: float = 5.0,
    current_lua: Path | None = None,
    store: Service | None = None,
) -> dict:
    """Short c32 runs of one gateway (`current`, e.g. this checkout's) and a `baseline`, alternating (A B B A ...), so
    that load from outside lands on both; the ratio of each adjacent pair, then their median, is what the difference
    costs. Each run also records the gateway's CPU per request, which outside load disturbs far less than its RPS.

    `current_lua`: current's own wrk script (its own key), else `lua`; `store`: a process current's requests also
    cost (redis-server), whose CPU per request is recorded beside, not in, the ratio."""
    ratios, cpu_ratios = [], []
    rps: dict[str, list[float]] = {"current": [], "baseline": []}
    cpu: dict[str, list[float]] = {"current": [], "baseline": []}
    errors = {"current": 0, "baseline": 0}
    store_cpu: list[float] = []
    for number in range(pairs):
        order = [("current", current, current_lua or lua), ("baseline", baseline, lua)]
        measured, spent = {}, {}
        for name, service, script in order if number % 2 == 0 else reversed(order):
            cpu0 = group_cpu_seconds(service.proc.pid)
            store_cpu0 = group_cpu_seconds(store.proc.pid) if store and name == "current" else 0.0
            run = run_wrk(service.port, script, 32, seconds)
            requests = max(run["requests"], 1)
            measured[name] = run["rps"]
            spent[name] = (group_cpu_seconds(service.proc.pid) - cpu0) / requests * 1e6
            if store and name == "current":
                store_cpu.append(round((group_cpu_seconds(store.proc.pid) - store_cpu0) / requests * 1e6, 1))
            rps[name].append(round(measured[name], 1))
            cpu[name].append(round(spent[name], 1))
            errors[name] += run["errors"]
        ratios.append(measured["current"] / measured["baseline"])
        cpu_ratios.append(spent["current"] / spent["baseline"])
    result = {
        "pairs": pairs,
        "seconds": seconds,
        "rps": rps,
        "cpu_us_per_request": cpu,
        "errors": errors,
        "median_ratio": _median_with_quartiles(ratios)[0],
        "ratio_quartiles": _median_with_quartiles(ratios)[1],
        "median_cpu_ratio": _median_with_quartiles(cpu_ratios)[0],
        "cpu_ratio_quartiles": _median_with_quartiles(cpu_ratios)[1],
    }
    if store_cpu:
        result["store_cpu_us_per_request"] = store_cpu
    return result


def _median_with_quartiles(values: list[float]) -> tuple[float, list[float]]:
    ordered = sorted(values)
    n = len(ordered)
    return round(ordered[n // 2], 3), [round(ordered[n // 4], 3), round(ordered[3 * n // 4], 3)]


def pick_median(runs: list[dict]) -> dict:
    """The median round by c32 RPS and, separately, by c1 p50 (each with its own p99 and errors)."""
    by_rps = sorted(runs, key=lambda r: r["c32"]["rps"])
    by_p50 = sorted(runs, key=lambda r: r["c1"]["p50_us"])
    result = {
        "target": runs[0]["target"],
        "port": runs[0]["port"],
        "c32": by_rps[len(runs) // 2]["c32"],
        "c1": by_p50[len(runs) // 2]["c1"],
        "rounds": len(runs),
    }
    if len(runs) > 1:
        result["all_rounds"] = [
            {
                "c32_rps": round(r["c32"]["rps"], 1),
                "c1_p50_us": r["c1"]["p50_us"],
                "c1_p99_us": r["c1"]["p99_us"],
                "cpu_us_per_request": r["c32"]["cpu_us_per_request"],
                "errors": r["c32"]["errors"] + r["c1"]["errors"],
            }
            for r in runs
        ]
    return result


def run_wrk(
    port: int, lua: Path, connections: int, duration: float, latency: bool = False, cpus: str | None = None
) -> dict:
    """wrk -t1 against `port`; `cpus`: pinned there (a taskset list)."""
    argv = ["wrk", "-t1", f"-c{connections}", f"-d{max(1, round(duration))}s", "--timeout", "10s", "-s", str(lua)]
    if cpus is not None:
        argv = ["taskset", "-c", cpus, *argv]
    if latency:
        argv.append("--latency")
    argv.append(f"http://127.0.0.1:{port}/v1/chat/completions")
    out = subprocess.run(argv, capture_output=True, text=True, timeout=duration + 60)
    match = re.search(r"^WRKJSON (\{.*\})$", out.stdout, re.MULTILINE)
    if out.returncode != 0 or not match:
        raise RuntimeError(f"wrk failed ({out.returncode}): {out.stdout[-2000:]} {out.stderr[-2000:]}")
    result = json.loads(match.group(1))
    non2xx = re.search(r"Non-2xx or 3xx responses:\s*(\d+)", out.stdout)
    result["non_2xx"] = int(non2xx.group(1)) if non2xx else 0
    result["errors"] = (
        result["err_connect"] + result["err_read"] + result["err_write"] + result["err_timeout"] + result["non_2xx"]
    )
    result["rps"] = result["requests"] / (result["duration_us"] / 1e6)
    return result


def group_cpu_seconds(pgid: int) -> float:
    """User+system CPU of every live process in a process group (a service and the workers it forked)."""
    ticks = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid:  # fields[0] is field 3 (state): pgrp is field 5, utime 14, stime 15
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def wait_idle(services: list[Service], timeout: float = 60.0) -> None:
    """Wait until just-started gateways stop using CPU: each warms its tokenizer in a background thread for seconds,
    which would otherwise steal CPU from (or be counted in) the first runs."""
    deadline = time.monotonic() + timeout
    before = [group_cpu_seconds(s.proc.pid) for s in services]
    while time.monotonic() < deadline:
        time.sleep(0.5)
        after = [group_cpu_seconds(s.proc.pid) for s in services]
        if all(b - a < 0.05 for a, b in zip(before, after)):
            return
        before = after


def measure(
    name: str, service: Service, lua: Path, duration: float, warmup: float, store: Service | None = None
) -> dict:
    """wrk at 32 connections (RPS, CPU) and at 1 (latency); `store`: a process whose CPU the target also costs."""
    print(
        f"[{time.strftime('%H:%M:%S')}] {name}: warmup {warmup:g}s, c32 {duration:g}s, c1 {duration:g}s",
        file=sys.stderr,
        flush=True,
    )
    port = service.port
    if warmup > 0:
        run_wrk(port, lua, 32, warmup)
    cpu0 = group_cpu_seconds(service.proc.pid)
    store_cpu0 = group_cpu_seconds(store.proc.pid) if store else 0.0
    c32 = run_wrk(port, lua, 32, duration)
    cpu = group_cpu_seconds(service.proc.pid) - cpu0
    if store and c32["requests"]:
        store_cpu = group_cpu_seconds(store.proc.pid) - store_cpu0
        c32["store_cpu_us_per_request"] = round(store_cpu / c32["requests"] * 1e6, 1)
    # CPU the target itself spent per request (excludes the static upstream behind it): independent of how much of
    # the shared cores it got, so it is the steadier number on a busy 2-core machine.
    c32["cpu_s"] = round(cpu, 3)
    c32["cpu_us_per_request"] = round(cpu / c32["requests"] * 1e6, 1) if c32["requests"] else None
    c32["cpu_util"] = round(cpu / (c32["duration_us"] / 1e6), 3)
    c1 = run_wrk(port, lua, 1, duration, latency=True)
    return {"target": name, "port": port, "c32": c32, "c1": c1}


# --------------------------------------------------------------------------------------------------------------------
# upstream-client floor: what one Python process pays per upstream call, with nothing else around it

CLIENT_MICRO = r"""
import asyncio, json, sys, time
client, port, conc, duration = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
body = json.dumps({"model": "bench-model", "messages": [{"role": "user", "content": "hi"}]}).encode()
url = f"http://127.0.0.1:{port}/v1/chat/completions"

async def main():
    if client == "httpx":  # configured as gateway/routing/pool.py configures it
        import httpx
        c = httpx.AsyncClient(limits=httpx.Limits(max_connections=256, max_keepalive_connections=256), trust_env=False)
        async def one():
            r = await c.send(c.build_request("POST", url, content=body, headers={"content-type": "application/json"}),
                             stream=True)
            await r.aread()
            await r.aclose()
        close = c.aclose
    elif client == "aiohttp":
        import aiohttp
        c = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256))
        async def one():
            async with c.post(url, data=body, headers={"content-type": "application/json"}) as r:
                await r.read()
        close = c.close
    else:  # raw: a minimal keep-alive HTTP/1.1 client on asyncio streams, one connection per worker
        conns = asyncio.Queue()
        req = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body
        for _ in range(conc):
            conns.put_nowait(await asyncio.open_connection("127.0.0.1", port))
        async def one():
            r, w = await conns.get()
            w.write(req)
            head = await r.readuntil(b"\r\n\r\n")
            length = next(int(l.split(b":")[1]) for l in head.split(b"\r\n") if l.lower().startswith(b"content-length"))
            await r.readexactly(length)
            conns.put_nowait((r, w))
        async def close():
            while not conns.empty():
                conns.get_nowait()[1].close()
    count = 0
    async def worker(until):
        nonlocal count
        while time.perf_counter() < until:
            await one()
            count += 1
    await asyncio.gather(*(worker(time.perf_counter() + 1.0) for _ in range(conc)))  # warm up
    count = 0
    cpu0, t0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker(t0 + duration) for _ in range(conc)))
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
    await close()
    print("CLIENTJSON " + json.dumps({"client": client, "connections": conc, "requests": count,
                                      "rps": count / wall, "cpu_us_per_request": cpu / count * 1e6}))

try:
    import uvloop
    uvloop.run(main())
except ImportError:
    asyncio.run(main())
"""


def client_floor(port: int, duration: float) -> list[dict]:
    """Per-request CPU of the upstream call alone (httpx as the gateway uses it, aiohttp, a raw asyncio client)."""
    seconds = max(2.0, min(duration, 5.0))
    runs = [("httpx", sys.executable), ("raw", sys.executable)]
    aiohttp_python = next(
        (
            py
            for py in (sys.executable, str(LITELLM_VENV / "bin" / "python"))
            if Path(py).exists() and subprocess.run([py, "-c", "import aiohttp"], capture_output=True).returncode == 0
        ),
        None,
    )
    if aiohttp_python:
        runs.insert(1, ("aiohttp", aiohttp_python))
    out = []
    for client, python in runs:
        for conc in (1, 32):
            print(f"[{time.strftime('%H:%M:%S')}] client floor: {client} x{conc}", file=sys.stderr, flush=True)
            proc = subprocess.run(
                [python, "-c", CLIENT_MICRO, client, str(port), str(conc), str(seconds)],
                capture_output=True,
                text=True,
                timeout=seconds + 60,
            )
            match = re.search(r"^CLIENTJSON (\{.*\})$", proc.stdout, re.MULTILINE)
            if not match:
                print(f"note: client floor {client} failed: {proc.stderr[-500:]}", file=sys.stderr)
                continue
            row = json.loads(match.group(1))
            if client == "aiohttp":
                row["python"] = python
            out.append(row)
    return out


# --------------------------------------------------------------------------------------------------------------------
# profile


CATEGORIES = {  # first path component of a py-spy frame's file -> package group
    "gateway": "gateway",
    "opentelemetry": "opentelemetry",
    "prometheus_client": "prometheus_client",
    "logging": "logging",
    "json": "json",
    "httpx": "httpx",
    "httpcore": "httpcore/h11",
    "h11": "httpcore/h11",
    "anyio": "anyio",
    "sniffio": "anyio",
    "starlette": "starlette",
    "uvicorn": "uvicorn",
    "httptools": "uvicorn",
    "asyncio": "asyncio/uvloop",
    "contextvars": "asyncio/uvloop",
    "uvloop": "asyncio/uvloop",
    "pydantic": "pydantic",
}


def categorise(frame: str) -> str:
    """`func (httpcore/_async/http11.py:283)` -> "httpcore/h11"; single-file stdlib modules -> "stdlib other"."""
    m = re.search(r"\(([^()]*?):\d+\)$", frame) or re.search(r"\(([^()]*)\)$", frame)
    path = m.group(1) if m else frame
    if "/gateway/" in path and "site-packages" not in path:
        return "gateway"
    path = re.sub(r"^.*/(site-packages|lib/python3\.\d+)/", "", path)
    head = path.split("/", 1)[0]
    if head in CATEGORIES:
        return CATEGORIES[head]
    if "/" not in path and path.endswith(".py"):
        return "stdlib other"
    return "other"


INCLUSIVE = {"opentelemetry", "prometheus_client", "logging", "json", "httpx", "httpcore/h11", "anyio", "gateway"}


def summarise_profile(raw: Path, top: int = 15) -> dict:
    """Self time from py-spy's collapsed (`-f raw`) output: the leaf frame of each stack gets its samples."""
    by_func: collections.Counter[str] = collections.Counter()
    by_cat: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        leaf = frames[-1]
        by_func[_short(leaf)] += n
        by_cat[categorise(leaf)] += n
        cats = {categorise(f) for f in frames}
        for cat in cats & INCLUSIVE:
            inclusive[cat] += n
        if cats & {"httpx", "httpcore/h11"}:
            inclusive["upstream client (any httpx/httpcore frame)"] += n
    pct = (lambda n: round(100.0 * n / total, 1)) if total else (lambda n: 0.0)
    return {
        "samples": total,
        "self_by_function": [{"function": f, "pct": pct(n)} for f, n in by_func.most_common(top)],
        "self_by_package": [{"package": c, "pct": pct(n)} for c, n in by_cat.most_common()],
        "inclusive_pct": {c: pct(n) for c, n in inclusive.most_common()},
    }


def _short(frame: str) -> str:
    """`func (/long/path/site-packages/pkg/mod.py:123)` -> `func (pkg/mod.py:123)`."""
    m = re.match(r"(.*) \((.*)\)$", frame)
    if not m:
        return frame
    func, where = m.groups()
    where = re.sub(r"^.*/(site-packages|lib/python3\.\d+)/", "", where)
    where = re.sub(r"^.*/(gateway/)", r"\1", where)
    return f"{func} ({where})"


def profile_gateway(service: Service, lua: Path, duration: float, out_dir: Path) -> dict | None:
    py_spy = os.environ.get("PY_SPY") or str(TOOLS_VENV / "bin" / "py-spy")
    if not Path(py_spy).exists() and not shutil.which(py_spy):
        print(f"note: py-spy not found at {py_spy}; profile skipped", file=sys.stderr)
        return None
    out_dir.mkdir(parents=True, exist_ok=True)
    raw = out_dir / f"{service.name}.collapsed.txt"
    seconds = max(3, round(duration))
    print(
        f"[{time.strftime('%H:%M:%S')}] profiling {service.name} (pid {service.proc.pid}) for {seconds}s under c32",
        file=sys.stderr,
        flush=True,
    )
    spy = subprocess.Popen(
        [
            py_spy,
            "record",
            "--pid",
            str(service.proc.pid),
            "-d",
            str(seconds),
            "-r",
            "250",
            "-f",
            "raw",
            "-o",
            str(raw),
            "--nonblocking",
            "--full-filenames",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(0.5)
    load = run_wrk(service.port, lua, 32, seconds + 1)
    _, err = spy.communicate(timeout=seconds + 30)
    if spy.returncode != 0 or not raw.exists():
        print(f"note: py-spy failed ({spy.returncode}): {err[-1000:]}", file=sys.stderr)
        return None
    summary = summarise_profile(raw)
    summary["rps_while_profiling"] = round(load["rps"], 1)
    summary["collapsed_stacks"] = str(raw)
    return summary


# --------------------------------------------------------------------------------------------------------------------
# report


def compare_policies(
    name: str,
    specs: dict[str, dict],
    duration: float,
    repeat: int,
    request: dict | None = None,
    headers: dict[str, str] | None = None,
    checkouts: dict[str, Path] | None = None,
) -> int:
    """One static upstream and one gateway per policy `spec` variant (e.g. a stage off and on), measured side by side
    with wrk like the proxy benchmark; used by the WAF and guard benchmarks' --proxy mode. A variant named in
    `checkouts` runs that earlier commit's gateway (a `git worktree` of it) with this venv."""
    request = request or REQUEST
    tmp = Path(tempfile.mkdtemp(prefix=f"portcullis-{name}-bench-"))
    tmp.chmod(0o755)
    procs = Procs()
    try:
        lua = tmp / "chat.lua"
        body = json.dumps(request, separators=(",", ":"))
        script = WRK_LUA.replace("@BODY@", body).replace("@KEY@", API_KEY) + (VARY_LUA if "@N@" in body else "")
        for header, value in (headers or {}).items():
            script = script.replace('wrk.method = "POST"', f'wrk.method = "POST"\nwrk.headers["{header}"] = "{value}"')
        lua.write_text(script)
        static = start_static_upstream(procs, tmp)
        targets = {}
        for variant, spec in specs.items():
            policies = tmp / f"{variant}-policies"
            policies.mkdir()
            (policies / "base.yaml").write_text(
                json.dumps(
                    {"apiVersion": "portcullis.dev/v1", "kind": "Policy", "metadata": {"name": variant}, "spec": spec}
                )
            )
            port = free_port()
            config = {
                "listen": {"host": "127.0.0.1", "port": port},
                "pools": [{"name": "static", "replicas": [{"url": f"http://127.0.0.1:{static.port}"}]}],
                "auth": {"keys": [{"tenant": "bench", "sha256": hashlib.sha256(API_KEY.encode()).hexdigest()}]},
                "policy_dir": str(policies),
                "telemetry": {"access_log": False},
                "admin": {"enabled": False},  # one admin port for all variants would clash; nothing here reads it
            }
            path = tmp / f"{variant}.yaml"
            path.write_text(json.dumps(config))
            argv = [str(Path(sys.prefix) / "bin" / "portcullis"), "serve", "--config", str(path)]
            env = dict(os.environ)
            if variant in (checkouts or {}):
                argv = [sys.executable, "-P", "-m", "gateway.cli", "serve", "--config", str(path)]  # -P: not the cwd
                env["PYTHONPATH"] = str((checkouts or {})[variant])
            svc = procs.start(variant, argv, port, tmp / f"{variant}.log", env=env)
            wait_http(svc, "/healthz", 60)
            check_chat(svc.port, request=request)
            targets[variant] = svc
        wait_idle(list(targets.values()))
        runs = collections.defaultdict(list)
        for round_no in range(repeat):
            for variant, svc in targets.items():
                runs[variant].append(measure(variant, svc, lua, duration, 2.0 if round_no == 0 else 0))
        print(f"machine: {machine()}  load: {loadavg()}")
        for variant in targets:
            best = pick_median(runs[variant])
            print(
                f"{variant:26} c32 {best['c32']['rps']:8.0f} rps  cpu {best['c32']['cpu_us_per_request']} us/req  "
                f"c1 p50 {best['c1']['p50_us']} us  p99 {best['c1']['p99_us']} us  "
                f"errors {best['c32']['errors'] + best['c1']['errors']}"
            )
    finally:
        procs.stop_all()
    return 0


def machine() -> dict:
    def cmd(*argv: str) -> str:
        try:
            out = subprocess.run(argv, capture_output=True, text=True, timeout=10)
            return (out.stdout + out.stderr).strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""

    model = next(
        (line.split(":", 1)[1].strip() for line in cmd("lscpu").splitlines() if line.startswith("Model name")),
        platform.processor(),
    )
    mem_kb = next(
        (
            int(line.split()[1])
            for line in Path("/proc/meminfo").read_text().splitlines()
            if line.startswith("MemTotal")
        ),
        0,
    )
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "ram_gib": round(mem_kb / 1024 / 1024, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "nginx": cmd("nginx", "-v").replace("nginx version: ", ""),
        "wrk": cmd("wrk", "--version").splitlines()[0].split(" [")[0] if cmd("wrk", "--version") else "",
        "litellm": litellm_version(),
        "commit": cmd("git", "-C", str(REPO), "rev-parse", "--short", "HEAD"),
        "gateway_uncommitted": cmd("git", "-C", str(REPO), "status", "--porcelain", "--", "gateway").splitlines(),
    }


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def table(results: list[dict]) -> str:
    direct = next((r for r in results if r["target"] == "direct"), None)
    width = max(30, *(len(r["label"]) for r in results))
    header = (
        f"{'target':<{width}} {'RPS c32':>9} {'err':>5} {'p50 c1 ms':>10} {'p99 c1 ms':>10} "
        f"{'+p50 ms':>8} {'+p99 ms':>8} {'RPS c1':>8} {'CPU us/req':>10} {'CPU util':>8}"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        c32, c1 = r["c32"], r["c1"]
        p50, p99 = c1["p50_us"] / 1000, c1["p99_us"] / 1000
        add50 = add99 = "-"
        if direct is not None and r is not direct:
            add50 = f"{p50 - direct['c1']['p50_us'] / 1000:.3f}"
            add99 = f"{p99 - direct['c1']['p99_us'] / 1000:.3f}"
        errors = sum(x["errors"] for x in r["all_rounds"]) if "all_rounds" in r else c32["errors"] + c1["errors"]
        lines.append(
            f"{r['label']:<{width}} {c32['rps']:>9.0f} {errors:>5} {p50:>10.3f} {p99:>10.3f} "
            f"{add50:>8} {add99:>8} {c1['rps']:>8.0f} {c32['cpu_us_per_request']:>10} {c32['cpu_util']:>8}"
        )
    return "\n".join(lines)


def keys_table(keys_ab: dict[str, dict]) -> str:
    """Each key-store row against the static-key row, from alternating pairs: what the acceptance reads."""
    first = next(iter(keys_ab.values()))
    header = (
        f"{'against Portcullis, static key':<42} {'RPS ratio':>9} {'quartiles':>15} {'CPU/req ratio':>13} "
        f"{'quartiles':>15} {'redis us/req':>12} {'err':>5}"
    )
    lines = [
        f"\nalternating pairs ({first['pairs']} x {first['seconds']:g} s each, c32, access log off), medians:",
        header,
        "-" * len(header),
    ]
    for ab in keys_ab.values():
        store = ab.get("store_cpu_us_per_request")
        redis_cpu = f"{sorted(store)[len(store) // 2]:.1f}" if store else "-"
        lines.append(
            f"{ab['label']:<42} {ab['median_ratio']:>9.3f} {str(ab['ratio_quartiles']):>15} "
            f"{ab['median_cpu_ratio']:>13.3f} {str(ab['cpu_ratio_quartiles']):>15} {redis_cpu:>12} "
            f"{sum(ab['errors'].values()):>5}"
        )
    return "\n".join(lines)


def add_latency_deltas(results: list[dict]) -> None:
    direct = next((r for r in results if r["target"] == "direct"), None)
    for r in results:
        if direct is not None and r is not direct:
            r["added_p50_ms"] = round((r["c1"]["p50_us"] - direct["c1"]["p50_us"]) / 1000, 3)
            r["added_p99_ms"] = round((r["c1"]["p99_us"] - direct["c1"]["p99_us"]) / 1000, 3)


# --------------------------------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------------------------------
# --workers-compare: one gateway process against two (listen.workers)

COMPARED_WORKERS = (1, 2)


def workers_compare(args: argparse.Namespace) -> int:
    """`--workers-compare`: the workers rows alone."""
    rows = measure_workers(args)
    print(f"\nmachine: {machine()}\n{workers_table(rows, args)}")
    if args.out:
        report = {"machine": machine(), "load_cpus": args.load_cpus, "duration_s": args.duration, "workers": rows}
        args.out.write_text(json.dumps(report, indent=2))
    return 0


def measure_workers(args: argparse.Namespace) -> list[dict]:
    """The gateway (auth on, access log off) with listen.workers 1, then 2, one at a time in front of the static
    upstream. wrk and the upstream run pinned to --load-cpus in both runs, so the cores the gateway may take are the
    only difference; on a 2-core machine the second worker shares the load generator's core. Reported: RPS and
    latency at 32 connections, and the CPU per request of the gateway's whole process tree (supervisor included)."""
    tmp = Path(tempfile.mkdtemp(prefix="portcullis-workers-bench-"))
    tmp.chmod(0o755)
    procs = Procs()
    rows: list[dict] = []
    try:
        lua = write_wrk_script(tmp / "chat.lua", API_KEY)
        static = start_static_upstream(procs, tmp)
        for pid in tree_pids(static.proc.pid):
            subprocess.run(["taskset", "-a", "-p", "-c", args.load_cpus, str(pid)], check=True, capture_output=True)
        for workers in COMPARED_WORKERS:
            svc = start_portcullis(procs, tmp, f"portcullis_workers_{workers}", static.port, False, workers=workers)
            wait_http(svc, "/healthz", 60)
            wait_serving(svc, workers)
            wait_tree_idle(svc.proc.pid)
            check_chat(svc.port)
            if args.warmup > 0:
                run_wrk(svc.port, lua, 32, args.warmup, cpus=args.load_cpus)
            cpu0 = tree_cpu_seconds(svc.proc.pid)
            c32 = run_wrk(svc.port, lua, 32, args.duration, cpus=args.load_cpus)
            cpu = tree_cpu_seconds(svc.proc.pid) - cpu0
            rows.append(
                {
                    "workers": workers,
                    "processes": len(tree_pids(svc.proc.pid)),
                    "rps": round(c32["rps"]),
                    "errors": c32["errors"],
                    "p50_ms": c32["p50_us"] / 1000,
                    "p99_ms": c32["p99_us"] / 1000,
                    "cpu_us_per_request": round(cpu / c32["requests"] * 1e6, 1) if c32["requests"] else None,
                    "cpu_util": round(cpu / (c32["duration_us"] / 1e6), 3),
                }
            )
            procs.stop(svc)  # one gateway at a time: an idle one still takes a little CPU
    finally:
        procs.stop_all()
        shutil.rmtree(tmp, ignore_errors=True)
    return rows


def workers_table(rows: list[dict], args: argparse.Namespace) -> str:
    lines = [
        f"wrk -t1 -c32 and the static upstream pinned to cores {args.load_cpus}, {args.duration:g}s",
        f"{'workers':>7} {'processes':>9} {'RPS c32':>9} {'err':>5} {'p50 ms':>8} {'p99 ms':>8} "
        f"{'CPU us/req':>10} {'CPU util':>8}",
    ]
    for r in rows:
        lines.append(
            f"{r['workers']:>7} {r['processes']:>9} {r['rps']:>9} {r['errors']:>5} {r['p50_ms']:>8.3f} "
            f"{r['p99_ms']:>8.3f} {r['cpu_us_per_request']:>10} {r['cpu_util']:>8}"
        )
    return "\n".join(lines)


def wait_serving(service: Service, workers: int, timeout: float = 60.0) -> None:
    """Until every worker serves (the supervisor logs it), not just the first to answer /healthz."""
    deadline = time.monotonic() + timeout
    while workers > 1 and f"all {workers} workers serving".encode() not in service.log_path.read_bytes():
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{service.name}: not every worker serving after {timeout:g}s:\n{tail(service.log_path)}"
            )
        time.sleep(0.2)


def wait_tree_idle(root: int, timeout: float = 60.0) -> None:
    """`wait_idle` for a process tree: each worker warms its tokenizer in the background after it serves."""
    deadline = time.monotonic() + timeout
    before = tree_cpu_seconds(root)
    while time.monotonic() < deadline:
        time.sleep(0.5)
        after = tree_cpu_seconds(root)
        if after - before < 0.05:
            return
        before = after


def tree_pids(root: int) -> list[int]:
    """`root` and every live process below it (workers run in process groups of their own)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                stat = (entry / "stat").read_text()
                parents[int(entry.name)] = int(stat[stat.rindex(")") + 2 :].split()[1])
    tree = [root]
    for pid in tree:
        tree += [child for child, parent in parents.items() if parent == pid]
    return tree


def tree_cpu_seconds(root: int) -> float:
    """User+system CPU of `root` and the live processes below it."""
    ticks = 0
    for pid in tree_pids(root):
        with contextlib.suppress(OSError):
            stat = Path(f"/proc/{pid}/stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per wrk run (default 10)")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds of c32 load before measuring (default 2)")
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="rounds over all targets, interleaved; the median round is reported (default 1)",
    )
    parser.add_argument("--out", type=Path, help="write results as JSON here")
    parser.add_argument("--skip-litellm", action="store_true", help="leave out the LiteLLM row")
    parser.add_argument("--profile-dir", type=Path, help="py-spy the gateway (access log on) and write stacks here")
    parser.add_argument(
        "--no-client-floor",
        action="store_true",
        help="skip the upstream-client micro-benchmark (httpx vs aiohttp vs raw asyncio)",
    )
    parser.add_argument("--keep-tmp", action="store_true", help="keep the temp dir with configs and logs")
    parser.add_argument(
        "--baseline", type=Path, help="a checkout of an earlier commit (git worktree): its gateway as one more row"
    )
    parser.add_argument(
        "--ab-pairs",
        type=int,
        default=0,
        help="with --baseline: this many alternating 5 s c32 pairs of it and this checkout (log on)",
    )
    parser.add_argument(
        "--limits",
        action="store_true",
        help="add rows with rate limits on (memory and a local redis-server), access log off",
    )
    parser.add_argument(
        "--cache",
        action="store_true",
        help="add rows, access log off: every request a response cache hit (memory, a local redis-server)",
    )
    parser.add_argument(
        "--keys",
        action="store_true",
        help="add rows, access log off: the static key, and a stored key (SQLite, Redis) with a budget rule on",
    )
    parser.add_argument(
        "--keys-pairs",
        type=int,
        default=0,
        help="with --keys: this many alternating 5 s c32 pairs of each key-store row and the static-key row",
    )
    parser.add_argument(
        "--workers-compare",
        action="store_true",
        help="only this: the gateway with listen.workers 1, then 2, wrk and the upstream pinned to --load-cpus",
    )
    parser.add_argument(
        "--with-workers",
        action="store_true",
        help="after the other rows, in the same run: the --workers-compare rows (the whole gateway table in one run)",
    )
    parser.add_argument(
        "--load-cpus",
        default=str(max(os.sched_getaffinity(0))),
        help="with --workers-compare or --with-workers: the cores (taskset list) of wrk and the static upstream "
        "(default: the last)",
    )
    args = parser.parse_args(argv)

    for tool in ("nginx", "wrk"):
        if not shutil.which(tool) and not Path(f"/usr/sbin/{tool}").exists():
            print(f"error: {tool} not found (apt-get install -y nginx-light wrk)", file=sys.stderr)
            return 2
    if args.workers_compare:
        return workers_compare(args)

    tmp = Path(tempfile.mkdtemp(prefix="portcullis-proxy-bench-"))
    tmp.chmod(0o755)
    procs = Procs()
    results: list[dict] = []
    report: dict = {
        "machine": machine(),
        "loadavg_start": loadavg(),
        "duration_s": args.duration,
        "warmup_s": args.warmup,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    try:
        lua = write_wrk_script(tmp / "chat.lua", API_KEY)

        static = start_static_upstream(procs, tmp)
        proxy = start_nginx(procs, tmp, "nginx-proxy", "proxy.conf.tmpl", UPSTREAM_PORT=static.port)
        wait_http(proxy, "/v1/models", 15)

        targets: list[tuple[str, str, Service, bool]] = [
            ("direct", "direct (static nginx)", static, False),
            ("nginx_proxy", "nginx reverse proxy", proxy, False),
        ]
        for key, label, access_log in (
            ("portcullis_access_log_on", "Portcullis (access log on)", True),
            ("portcullis_access_log_off", "Portcullis (access log off)", False),
        ):
            svc = start_portcullis(procs, tmp, key, static.port, access_log)
            wait_http(svc, "/healthz", 60)
            targets.append((key, label, svc, True))
        if args.baseline:
            commit = subprocess.run(
                ["git", "-C", str(args.baseline), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
            ).stdout.strip()
            svc = start_portcullis(procs, tmp, "portcullis_baseline", static.port, True, checkout=args.baseline)
            wait_http(svc, "/healthz", 60)
            targets.append(("portcullis_baseline", f"Portcullis at {commit} (access log on)", svc, True))
        stores: dict[str, Service] = {}  # target -> the store whose CPU its requests cost too
        bearer: dict[str, str] = {}  # target -> the key it takes, where not API_KEY
        scripts: dict[str, Path] = {}  # target -> its wrk script, where not `lua`
        redis = start_redis(procs, tmp) if args.limits or args.keys or args.cache else None
        if args.limits:
            assert redis is not None
            stores["portcullis_limits_redis"] = redis
            for key, label, url in (
                ("portcullis_limits_memory", "Portcullis + limits in memory", None),
                ("portcullis_limits_redis", "Portcullis + limits in Redis", f"redis://127.0.0.1:{redis.port}/0"),
            ):
                svc = start_portcullis(procs, tmp, key, static.port, False, redis_url=url, policy=LIMITS_POLICY)
                wait_http(svc, "/healthz", 60)
                targets.append((key, label, svc, True))
        if args.keys:
            assert redis is not None
            for key, label in (
                (STATIC_KEY_ROW, "Portcullis, static key"),
                (CONTROL_ROW, "Portcullis, static key again"),
            ):
                svc = start_portcullis(procs, tmp, key, static.port, False, policy=NO_BUDGETS_POLICY)
                wait_http(svc, "/healthz", 60)
                targets.append((key, label, svc, True))
            for key, label, store in KEY_STORE_ROWS:
                url = f"redis://127.0.0.1:{redis.port}/1" if store == "redis" else None  # apart from --limits' db
                bearer[key] = store_key(store, tmp, key, url)
                scripts[key] = write_wrk_script(tmp / f"{key}.lua", bearer[key])
                svc = start_portcullis(
                    procs, tmp, key, static.port, False, url, policy=BUDGETS_POLICY, store=store, static_key=False
                )
                wait_http(svc, "/healthz", 60)
                targets.append((key, label, svc, True))
                if url:
                    stores[key] = redis
        if args.cache:
            assert redis is not None
            for key, label, store in CACHE_ROWS:
                url = f"redis://127.0.0.1:{redis.port}/2" if store == "redis" else None  # apart from the others' dbs
                svc = start_portcullis(
                    procs, tmp, key, static.port, False, url, policy=cache_policy(), response_cache={"store": store}
                )
                wait_http(svc, "/healthz", 60)
                targets.append((key, label, svc, True))
                if url:
                    stores[key] = redis
        if not args.skip_litellm:
            litellm = start_litellm(procs, tmp, static.port)
            if litellm is not None:
                wait_http(litellm, "/health/liveliness", 180)
                targets.append(("litellm", "LiteLLM proxy (1 worker)", litellm, True))

        wait_idle([svc for key, _, svc, _ in targets if key.startswith("portcullis")])
        checks = {}
        for key, label, svc, auth in targets:
            check = check_chat(svc.port, bearer.get(key, API_KEY))
            # LiteLLM without a database answers an unknown key with 400 ("No connected db"), not 401.
            if auth and not 400 <= check["wrong_key_status"] < 500:
                raise RuntimeError(f"{label}: a wrong key got {check['wrong_key_status']}; auth is not on")
            check["auth_on"] = auth
            checks[key] = check
            if key in {row for row, _, _ in CACHE_ROWS} and check_chat(svc.port)["cache"] != "hit":
                raise RuntimeError(f"{label}: a repeated request was not a cache hit")
        budgeted = {key: svc for key, _, svc, _ in targets if key in {row for row, _, _ in KEY_STORE_ROWS}}
        budget_before = {key: budget_left(svc, bearer[key]) for key, svc in budgeted.items()}
        # Rounds interleave the targets, so a burst of outside load lands on all of them rather than on one.
        runs: dict[str, list[dict]] = collections.defaultdict(list)
        for round_no in range(args.repeat):
            for key, _label, svc, _auth in targets:
                script = scripts.get(key, lua)
                warmup = args.warmup if round_no == 0 else 0
                runs[key].append(measure(key, svc, script, args.duration, warmup, stores.get(key)))
        for key, label, _svc, _auth in targets:
            results.append(pick_median(runs[key]) | {"label": label, "check": checks[key]})

        add_latency_deltas(results)
        report["results"] = results
        if args.baseline and args.ab_pairs:
            current = next(svc for key, _, svc, _ in targets if key == "portcullis_access_log_on")
            baseline = next(svc for key, _, svc, _ in targets if key == "portcullis_baseline")
            report["ab"] = ab_pairs(current, baseline, lua, args.ab_pairs)
        if budgeted and args.keys_pairs:
            static_key = next(svc for key, _, svc, _ in targets if key == STATIC_KEY_ROW)
            report["keys_ab"] = {
                key: ab_pairs(
                    svc, static_key, lua, args.keys_pairs, current_lua=scripts.get(key, lua), store=stores.get(key)
                )
                | {"label": label}
                for key, label, svc, _ in targets
                if key in budgeted or key == CONTROL_ROW
            }
        if budgeted:  # what the run spent of each budget
            report["budget_left"] = {
                key: {"before": budget_before[key], "after": budget_left(svc, bearer[key])}
                for key, svc in budgeted.items()
            }
        report["loadavg_end"] = loadavg()

        for key, _, svc, _ in targets:
            if key.startswith("portcullis"):
                lines = svc.log_path.read_bytes().splitlines()
                report.setdefault("portcullis_stderr", {})[key] = {
                    "lines": len(lines),
                    "httpx_request_lines": sum(1 for line in lines if b'"logger":"httpx"' in line),
                    "access_lines": sum(1 for line in lines if b'"request_id"' in line),
                }

        if not args.no_client_floor:
            report["client_floor"] = client_floor(static.port, args.duration)

        if args.profile_dir:
            svc = next(s for k, _, s, _ in targets if k == "portcullis_access_log_on")
            report["profile"] = profile_gateway(svc, lua, args.duration, args.profile_dir.resolve())
    finally:
        procs.stop_all()
        if args.keep_tmp:
            print(f"temp dir kept: {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    if args.with_workers:  # after the other targets are stopped: the pinned runs want the cores to themselves
        report["workers"] = measure_workers(args)
        report["load_cpus"] = args.load_cpus
        report["loadavg_end"] = loadavg()

    print(f"\nmachine: {report['machine']}")
    print(f"load average: start {report['loadavg_start']}, end {report['loadavg_end']}")
    print(
        f"wrk -t1, {args.duration:g}s per run, median of {args.repeat} interleaved round(s); "
        f"RPS at 32 connections, latency at 1 connection; +p50/+p99 = added over direct\n"
    )
    print(table(results))
    if report.get("ab"):
        ab = report["ab"]
        print(
            f"\nalternating pairs against the baseline ({ab['pairs']} x {ab['seconds']:g} s, c32, access log on): "
            f"median RPS ratio {ab['median_ratio']} (quartiles {ab['ratio_quartiles']}), "
            f"median CPU-per-request ratio {ab['median_cpu_ratio']} (quartiles {ab['cpu_ratio_quartiles']})"
        )
    if report.get("keys_ab"):
        print(keys_table(report["keys_ab"]))
    for key, left in report.get("budget_left", {}).items():
        print(f"{key}: budget before the runs {left['before']}, after {left['after']}")
    for r in results:
        if "store_cpu_us_per_request" in r["c32"]:
            print(f"{r['label']}: redis-server CPU {r['c32']['store_cpu_us_per_request']} us/req on top (c32 run)")
    for key, info in report.get("portcullis_stderr", {}).items():
        print(
            f"{key}: {info['lines']} stderr lines in all ({info['access_lines']} access-log lines, "
            f"{info['httpx_request_lines']} httpx 'HTTP Request' lines)"
        )
    if report.get("client_floor"):
        print("\nupstream client alone against the static upstream (one process, CPU per request):")
        for row in report["client_floor"]:
            print(
                f"  {row['client']:<8} x{row['connections']:<3} {row['rps']:>8.0f} req/s "
                f"{row['cpu_us_per_request']:>8.1f} CPU us/req"
            )
    if report.get("profile"):
        prof = report["profile"]
        print(
            f"\npy-spy self time, Portcullis (access log on) under c32 "
            f"({prof['samples']} samples, {prof['rps_while_profiling']} RPS while profiled):"
        )
        for row in prof["self_by_package"]:
            print(f"  {row['pct']:>5.1f}%  {row['package']}")
        print("  top functions:")
        for row in prof["self_by_function"]:
            print(f"  {row['pct']:>5.1f}%  {row['function']}")
        print(f"  inclusive: {prof['inclusive_pct']}")
    if report.get("workers"):
        print(f"\nlisten.workers 1 against 2, same run:\n{workers_table(report['workers'], args)}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
