"""Operator configuration (`portcullis.yaml`): listeners, upstream pools, auth keys, Redis, telemetry.

Security policy (WAF, limits, guard thresholds) lives in `policies/`, not here. Every field has a default, so the
gateway runs with no file at all; a file that is present is validated whole at start, and each error names the
file, the key path and the problem. Secrets never live in the file: pools and keys name environment variables.
"""

from __future__ import annotations

import hashlib
import math
import os
from ipaddress import ip_address
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    IPvAnyNetwork,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from gateway.apis.model_name import MODEL_NAME_PATTERN
from gateway.tenancy.catalog import uncovered
from gateway.tenancy.tenant_name import TenantName

CONFIG_ENV = "PORTCULLIS_CONFIG"
# a Host header's name, with a port or without: a DNS name, an IPv4 address or a bracketed IPv6 one
_HOST_NAME = r"^([A-Za-z0-9](?:[A-Za-z0-9.-]{0,252})|\[[0-9A-Fa-f:.]{2,45}\])(:[0-9]{1,5})?$"


# A model as a config names it: as a request may (gateway/apis/model_name.py), since it travels the same ways.
ModelName = Annotated[str, Field(pattern=MODEL_NAME_PATTERN)]


class ConfigError(Exception):
    """A configuration file that cannot be used; the message says where and why."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def usable_cores() -> int:
    """The cores this process may run on, not the host's count: its CPU affinity (cpusets, `taskset`), capped by a
    cgroup CPU quota (a container's CPU limit), which leaves affinity alone."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = _cgroup_cpu_quota()
    return max(1, min(cores, math.ceil(quota))) if quota else cores


def _cgroup_cpu_quota() -> float | None:
    """CPUs' worth of time per period the cgroup allows (cgroup v2 `cpu.max`, else v1's CFS files); None: no limit."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        v1 = Path("/sys/fs/cgroup/cpu")
        quota_us = int((v1 / "cpu.cfs_quota_us").read_text())
        return None if quota_us <= 0 else quota_us / int((v1 / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None


class ListenConfig(_Strict):
    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 8080
    workers: int | Literal["auto"] = Field(
        default=1,
        description=(
            "gateway processes sharing the public port (SO_REUSEPORT), supervised by `portcullis serve`; "
            "'auto': one per usable core. 1: one process serves, no supervisor (docs/workers.md)"
        ),
    )

    @field_validator("workers", mode="before")
    @classmethod
    def _whole_workers_or_auto(cls, value: object) -> object:
        if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            return value
        raise ValueError(
            f"must be a whole number of processes (1 or more) or 'auto' (one per usable core), not {value!r}"
        )

    def worker_count(self) -> int:
        return self.workers if isinstance(self.workers, int) else usable_cores()


class LimitsConfig(_Strict):
    """What one client may send: enforced while the bytes arrive (gateway/edge/http_server.py) and before anything else
    reads the body (the parse stage). Every limit answers with its own OpenAI-shaped 4xx and names itself."""

    max_body_bytes: Annotated[int, Field(gt=0)] = 4 * 1024 * 1024
    max_url_bytes: Annotated[int, Field(gt=0, description="request target (path and query) → 414")] = 8 * 1024
    max_header_bytes: Annotated[
        int, Field(gt=0, description=("all header names and values of one request together → 431"))
    ] = 32 * 1024
    header_timeout: Annotated[
        float,
        Field(
            gt=0,
            description=(
                "seconds from a connection's first byte (or its accept) until the request head is complete → 408; "
                "slowloris clients are cut off here"
            ),
        ),
    ] = 10.0
    body_idle_timeout: Annotated[
        float, Field(gt=0, description=("seconds the request body may go without a byte → 408"))
    ] = 10.0
    body_timeout: Annotated[
        float,
        Field(
            gt=0,
            description=(
                "seconds from the start of the body's read to its last byte, however it trickles → 408; a client "
                "that sends a byte just inside each idle wait is cut off here. Raise it with max_body_bytes for "
                "large passthrough uploads"
            ),
        ),
    ] = 60.0
    send_timeout: Annotated[
        float,
        Field(
            gt=0,
            description=(
                "seconds the answer may wait on a client that does not read it (its socket's buffers full); "
                "then the connection is dropped, and its slots, upstream stream and KV are freed"
            ),
        ),
    ] = 30.0
    max_connections: Annotated[
        int,
        Field(
            gt=0,
            description=("open client connections per public listener; beyond it a connection gets 503 and is closed"),
        ),
    ] = 4096
    max_connections_per_client: Annotated[
        int,
        Field(
            gt=0,
            description=(
                "open connections from one client address per listener (the socket peer; a peer in "
                "trusted_proxies carries many clients and is not capped); beyond it a connection gets 429 and is "
                "closed, so one client cannot hold every connection the listener has"
            ),
        ),
    ] = 1024
    # The shape of a JSON body bounds what the stages after parse spend on it (the WAF runs before auth).
    max_json_depth: Annotated[
        int,
        Field(
            gt=0,
            le=1000,
            description=(
                "nesting of objects and arrays in a body → 400 json_too_deep; deep tool schemas need about 10"
            ),
        ),
    ] = 64
    max_json_values: Annotated[
        int,
        Field(
            gt=0,
            description=(
                "values (objects, arrays, strings, numbers, ...) in a body → 413 "
                "too_many_json_values; a token-id prompt "
                "counts one per token"
            ),
        ),
    ] = 128 * 1024
    max_string_chars: Annotated[
        int,
        Field(
            gt=0,
            description=("characters in any one JSON string or key → 400 string_above_max_length (OpenAI's own limit)"),
        ),
    ] = 1024 * 1024
    max_messages: Annotated[
        int, Field(gt=0, description=("chat messages in a request → 400 array_above_max_length"))
    ] = 2048
    max_tools: Annotated[
        int,
        Field(
            gt=0,
            description=(
                "tool (or function) definitions in a request → 400 array_above_max_length (OpenAI's own limit)"
            ),
        ),
    ] = 128
    # Parsing, the WAF and tokenizing cost milliseconds per big body: above these sizes they leave the event loop.
    offload_min_bytes: Annotated[
        int,
        Field(
            ge=0,
            description=(
                "bodies this large are parsed, WAF-checked and tokenized on worker threads, not the event loop"
            ),
        ),
    ] = 16 * 1024
    offload_min_values: Annotated[
        int, Field(ge=0, description=("so are bodies with this many JSON values (the WAF's cost grows with them)"))
    ] = 256
    offload_workers: Annotated[
        int, Field(gt=0, description=("worker threads for that work: more big bodies at once wait in a queue"))
    ] = 2
    gate_min_commas: Annotated[
        int,
        Field(
            ge=0,
            description=(
                "bodies with more commas than this (a body holds about as many JSON values) are "
                "checked against these limits "
                "in a worker process before this one decodes them: decoding holds the interpreter "
                "lock, so a thread cannot "
                "spare the event loop from a flood of bodies with 100k values each"
            ),
        ),
    ] = 4096


class TimeoutsConfig(_Strict):
    connect: Annotated[float, Field(gt=0)] = 3.0
    read: Annotated[float, Field(gt=0)] = 120.0
    pool: Annotated[float, Field(gt=0)] = 5.0
    keepalive: Annotated[
        float,
        Field(
            gt=0,
            description=(
                "seconds an idle upstream connection is kept; below the upstream's own idle timeout (uvicorn: 5 s), so "
                "the gateway never reuses a connection the upstream already closed"
            ),
        ),
    ] = 4.0
    total: Annotated[
        float,
        Field(
            gt=0,
            description=(
                "seconds from a request's arrival to its last byte out; beyond it: 504 before the "
                "answer started, an SSE "
                "error event after"
            ),
        ),
    ] = 600.0
    stream_idle: Annotated[
        float,
        Field(
            gt=0,
            description=(
                "seconds an upstream answer may go without a byte once its body has begun (between stream chunks); "
                "beyond it: 504, or an SSE error event once the stream started. The wait for the first byte is `read`'s"
            ),
        ),
    ] = 60.0


_ZMQ_SCHEMES = ("tcp://", "ipc://", "inproc://")


class ReplicaConfig(_Strict):
    url: str
    kv_events: str | None = Field(
        default=None, description="a vLLM replica's KV-event PUB endpoint (e.g. tcp://host:5557), for source 'vllm'"
    )
    kv_events_replay: str | None = Field(
        default=None, description="its replay ROUTER endpoint (e.g. tcp://host:5558): missed batches are asked for"
    )

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        return value.rstrip("/")

    @field_validator("kv_events", "kv_events_replay")
    @classmethod
    def _zmq_endpoint(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(_ZMQ_SCHEMES):
            raise ValueError("a ZMQ endpoint: tcp://host:port, ipc://path or inproc://name")
        return value

    @model_validator(mode="after")
    def _replay_needs_events(self) -> ReplicaConfig:
        if self.kv_events_replay and not self.kv_events:
            raise ValueError("kv_events_replay is set without kv_events")
        return self


class HealthConfig(_Strict):
    """Passive ejection counts failed upstream attempts. Active checks come with each metrics scrape where the
    routing policy scrapes; other pools probe `path` (e.g. /health, /v1/models) every `interval` when it is set."""

    failures_to_eject: Annotated[int, Field(gt=0)] = 3
    eject_seconds: Annotated[float, Field(gt=0)] = 10.0
    path: Annotated[str, Field(pattern=r"^/")] | None = None
    interval: Annotated[float, Field(gt=0)] = 5.0


class AffinityConfig(_Strict):
    """Cache-aware routing (see gateway/routing/policies.py). `scorer: expected_ttft` (default): the replica with the
    least prefill work ahead of the request's first token, in prompt tokens (uncached part of the prompt + this
    gateway's queued prefill there + other senders' waiting requests + `decode_weight` per decoding sequence).

    `scorer: rules`, the earlier policy: the replica holding the longest cached prefix wins when
    that prefix covers at least `match_threshold` of the prompt and the replica has room for the rest; otherwise the
    replica with the least work and KV in use. When in-flight load is imbalanced beyond both thresholds
    (max > min + abs and max > rel x min), the least-loaded replica wins, so a hot prefix cannot pile onto one.
    Over time, a replica that already took more than `max_share` x its fair share of the last `share_window`
    routing decisions is passed over while others are not (bounded loads): a hot prefix is copied to a second
    replica instead of making its holder the pool's hot spot.
    """

    match_threshold: Annotated[float, Field(ge=0, le=1)] = 0.5
    balance_abs_threshold: Annotated[int, Field(ge=0)] = 4
    balance_rel_threshold: Annotated[float, Field(ge=1)] = 1.5
    max_share: Annotated[float, Field(ge=1)] = 1.25
    share_window: Annotated[int, Field(gt=0)] = 256
    index_capacity: Annotated[int, Field(gt=0)] = 200_000
    scorer: Literal["expected_ttft", "rules"] = "expected_ttft"
    decode_weight: Annotated[float, Field(ge=0)] = Field(
        default=80.0, description="prompt tokens of prefill one decoding sequence is worth (docs/benchmarks.md)"
    )


class AdmissionConfig(_Strict):
    """KV-budget admission: a request enters only where its blocks fit, otherwise it waits in a fair queue."""

    enabled: bool = False
    max_queue: Annotated[int, Field(gt=0)] = 256
    queue_timeout: Annotated[float, Field(gt=0)] = 30.0


class KvEventsConfig(_Strict):
    """Where a `kv_events` pool learns its replicas' prefix-cache contents.

    'engine': the bundled engine's NDJSON stream (GET /v1/kv_events). 'vllm': each replica's vLLM ZMQ publisher
    (`ReplicaConfig.kv_events`), with prompts hashed the way vLLM hashes them: `hash_algo` is vLLM's
    --prefix-caching-hash-algo, and `hash_seed_env` names the env var holding the PYTHONHASHSEED the replicas run
    with (without a fixed seed vLLM's hashes are random per process and cannot be predicted). docs/fleets.md.
    """

    source: Literal["engine", "vllm"] = "engine"
    topic: str = Field(default="", description="the vLLM publisher's topic (--kv-events-config 'topic')")
    hash_algo: Literal["sha256", "sha256_cbor"] = "sha256"
    hash_seed_env: str | None = Field(default=None, description="env var holding the replicas' PYTHONHASHSEED")
    data_parallel_size: Annotated[int, Field(ge=1, le=64)] = Field(
        default=1,
        description="data-parallel ranks per replica: rank r publishes on the endpoint's port + r (vLLM's rule)",
    )


class PoolConfig(_Strict):
    """A set of interchangeable replicas serving the same models."""

    name: str
    replicas: Annotated[list[ReplicaConfig], Field(min_length=1)]
    models: list[ModelName] = Field(default_factory=list, description="models routed here; empty means any")
    routing: Literal["round_robin", "least_outstanding", "least_load", "prefix_affinity", "kv_events"] = (
        "least_outstanding"
    )
    block_size: Annotated[int, Field(gt=0)] = Field(default=16, description="the engines' KV block size")
    cache_isolation: Literal["shared", "tenant"] = Field(
        default="shared",
        description=(
            "prefix-cache sharing between tenants: 'shared' strips any client-sent cache_salt; 'tenant' sets a "
            "per-tenant cache_salt, so one tenant can never hit (or time) another's cached prefixes"
        ),
    )
    scrape_interval: Annotated[float, Field(gt=0)] = Field(
        default=0.5, description="seconds between /metrics scrapes (load, KV usage, health)"
    )
    health: HealthConfig = HealthConfig()
    affinity: AffinityConfig = AffinityConfig()
    admission: AdmissionConfig = AdmissionConfig()
    kv_events: KvEventsConfig = KvEventsConfig()
    api: Literal["openai", "anthropic"] = Field(
        default="openai",
        description=(
            "what the replicas speak: 'openai' (the bundled engine, vLLM, SGLang, OpenAI) gets Anthropic Messages "
            "requests translated to chat completions; 'anthropic' gets them as sent, with x-api-key and "
            "anthropic-version"
        ),
    )
    api_key_env: str | None = Field(default=None, description="env var holding the upstream API key")
    tenant_api_key_env: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "tenant -> env var holding that tenant's own upstream API key: every request of the tenant to this pool "
            "carries it instead of api_key_env's, so the provider keeps its objects apart from other tenants', and "
            "the tenant may use passthrough routes the gateway does not keep apart by tenant. Other tenants use "
            "api_key_env's key"
        ),
    )
    anthropic_version: str = Field(
        default="2023-06-01", description="the anthropic-version header an 'anthropic' pool is sent"
    )
    passthrough: list[str] = Field(
        default_factory=list,
        description=(
            "other /v1/ routes this pool serves as they are (e.g. '/v1/files*', '/v1/audio/speech'): the WAF on "
            "the request line and headers, auth and request-rate limits apply, the content stages do not. Only "
            "paths known to be stateless, or collections of objects the gateway keeps apart by tenant "
            "(gateway/tenancy/catalog.py), unless tenants have their own upstream keys (tenant_api_key_env)"
        ),
    )
    timeouts: TimeoutsConfig = TimeoutsConfig()
    max_attempts: Annotated[int, Field(ge=1, le=10)] = 2
    retry_on_status: list[int] = Field(default_factory=lambda: [502, 503, 504])
    include_usage: bool = Field(default=True, description="ask streams for stream_options.include_usage")
    max_connections: Annotated[int, Field(gt=0)] = 256
    max_response_bytes: Annotated[
        int,
        Field(
            gt=0,
            description=(
                "largest non-streaming (or error) answer read from an upstream; a larger one is dropped and the client "
                "gets 502 upstream_response_too_large"
            ),
        ),
    ] = 32 * 1024 * 1024
    max_event_bytes: Annotated[
        int,
        Field(
            gt=0,
            description=(
                "largest single SSE event in an upstream stream; a larger one ends the client's "
                "stream with an SSE error "
                "event (upstream_event_too_large)"
            ),
        ),
    ] = 1024 * 1024

    @field_validator("passthrough")
    @classmethod
    def _passthrough_under_v1(cls, routes: list[str]) -> list[str]:
        for route in routes:
            if not route.startswith("/v1/") or "*" in route.rstrip("*"):
                raise ValueError(f"{route!r}: a passthrough route is a path under /v1/, optionally ending in '*'")
        return routes

    @field_validator("passthrough")
    @classmethod
    def _passthrough_known(cls, routes: list[str], info: ValidationInfo) -> list[str]:
        """Fail closed: a route whose paths are not known to be stateless, or objects kept apart by tenant, would
        share one tenant's upstream objects with every other through the pool's one key. With tenants' own keys the
        provider keeps theirs apart, and a tenant without one is refused such paths per request."""
        if info.data.get("tenant_api_key_env") or "api" not in info.data:
            return routes
        for route in routes:
            if (why := uncovered(info.data["api"], route)) is not None:
                raise ValueError(
                    f"{why}. Pass through those only, or give each tenant its own key (tenant_api_key_env)"
                )
        return routes

    @model_validator(mode="after")
    def _vllm_events_complete(self) -> PoolConfig:
        if self.kv_events.source != "vllm":
            return self
        if self.routing != "kv_events":
            raise ValueError("kv_events.source 'vllm' is for routing: kv_events")
        if not self.kv_events.hash_seed_env:
            raise ValueError("kv_events.hash_seed_env: needed for source 'vllm' (the replicas' PYTHONHASHSEED)")
        missing = [f"replicas[{i}].kv_events" for i, r in enumerate(self.replicas) if not r.kv_events]
        if missing:
            raise ValueError(f"{', '.join(missing)}: a ZMQ endpoint is needed for kv_events.source 'vllm'")
        return self

    def api_key(self) -> str | None:
        return os.environ.get(self.api_key_env) if self.api_key_env else None

    def tenant_api_keys(self) -> dict[str, str]:
        """Each tenant's own upstream key, read at start; a variable that is not set stops the start."""
        keys = {}
        for tenant, env in self.tenant_api_key_env.items():
            if not (key := os.environ.get(env)):
                raise ConfigError(
                    f"pool {self.name!r}: tenant_api_key_env.{tenant}: environment variable {env} is not set"
                )
            keys[tenant] = key
        return keys

    def vllm_hash_seed(self) -> str:
        """The replicas' PYTHONHASHSEED, read at start like API keys; the file never holds it."""
        seed = os.environ.get(self.kv_events.hash_seed_env or "")
        if seed is None:
            raise ConfigError(
                f"pool {self.name!r}: kv_events.hash_seed_env: environment variable {self.kv_events.hash_seed_env} "
                "is not set"
            )
        return seed


class McpServerConfig(_Strict):
    """An upstream MCP server (streamable HTTP), served to the gateway's callers at `/mcp/{name}` (docs/mcp.md)."""

    name: Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9_-]{0,63}$")]
    url: str = Field(description="the server's MCP endpoint, e.g. https://mcp.example.com/mcp")
    api_key_env: str | None = Field(
        default=None, description="env var holding the server's credential, sent as 'Authorization: Bearer'"
    )
    connect_timeout: Annotated[float, Field(gt=0)] = 3.0
    idle_timeout: Annotated[
        float, Field(gt=0, description="seconds an answer (or a stream, between events) may go without a byte")
    ] = 60.0
    total_timeout: Annotated[
        float, Field(gt=0, description="seconds one POST's answer may take in all; a GET stream is not bounded")
    ] = 300.0
    max_message_bytes: Annotated[
        int, Field(gt=0, description="bytes of one JSON-RPC message the server sends (an answer or an SSE event)")
    ] = 4 * 1024 * 1024

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        return value  # as given: an MCP endpoint's path is the server's, trailing slash included

    def credential(self) -> str | None:
        """The server's credential from the environment; a named variable that is unset stops the start."""
        if self.api_key_env is None:
            return None
        value = os.environ.get(self.api_key_env)
        if not value:
            raise ConfigError(
                f"mcp_servers[{self.name}].api_key_env: environment variable {self.api_key_env} is not set"
            )
        return value


class ApiKeyConfig(_Strict):
    """One client key. Give its SHA-256 hex digest, or the name of an env var holding the key itself."""

    tenant: TenantName
    label: str = ""
    sha256: str | None = None
    key_env: str | None = None

    @model_validator(mode="after")
    def _one_source(self) -> ApiKeyConfig:
        if (self.sha256 is None) == (self.key_env is None):
            raise ValueError("give exactly one of 'sha256' or 'key_env'")
        if self.sha256 is not None and not _is_sha256_hex(self.sha256):
            raise ValueError("'sha256' must be 64 lowercase hex characters")
        return self

    def digest(self) -> bytes:
        if self.sha256 is not None:
            return bytes.fromhex(self.sha256)
        key = os.environ.get(self.key_env or "")
        if not key:
            raise ConfigError(f"auth key for tenant {self.tenant!r}: environment variable {self.key_env} is not set")
        return hashlib.sha256(key.encode()).digest()


def _is_sha256_hex(value: str) -> bool:
    return len(value) == 64 and all(c in "0123456789abcdef" for c in value)


class AuthConfig(_Strict):
    """With no keys configured, requests are served as tenant 'anonymous' (a warning is logged at start), unless
    `anonymous` is off; a key store that has held a key (revoked ones count) keeps the gateway closed."""

    keys: list[ApiKeyConfig] = Field(default_factory=list)
    anonymous: bool = Field(
        default=True,
        description="serve requests as tenant 'anonymous' while no key exists anywhere; off: refuse them (401)",
    )


class OtlpConfig(_Strict):
    enabled: bool = False
    endpoint: str = "http://localhost:4318"
    protocol: Literal["http/protobuf", "grpc"] = "http/protobuf"
    headers_env: str | None = Field(default=None, description="env var with 'k=v,k2=v2' exporter headers")


class TelemetryConfig(_Strict):
    """Traces, metrics and logs. A key the file leaves out takes the standard OpenTelemetry variable's value where one
    is set (OTEL_SERVICE_NAME, OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_TRACES_SAMPLER[_ARG]...:
    gateway/observability/otel_env.py)."""

    service_name: str = "portcullis-gateway"
    otlp: OtlpConfig = OtlpConfig()
    sampling_ratio: Annotated[
        float,
        Field(
            ge=0,
            le=1,
            description="share of traces exported (by trace id; a trusted parent's choice is followed); a request "
            "that ends in an error or is refused is exported whatever the ratio",
        ),
    ] = 1.0
    access_log: bool = True
    replica_header: bool = Field(
        default=False,
        description="tell clients which replica served them "
        "(x-portcullis-replica), for load tests; leaks upstream addresses",
    )
    per_key_metrics: bool = Field(
        default=False, description="label billed tokens, requests and spend by API key id too"
    )
    max_metric_keys: Annotated[
        int, Field(gt=0, description="key ids given their own label; later keys count under 'other'")
    ] = 1000
    trust_client_trace: bool = Field(
        default=False,
        description=(
            "continue a client's traceparent; off: each request starts its own root trace and links the client's "
            "context, so a client can neither unsample a request nor choose its trace id"
        ),
    )


class RedisConfig(_Strict):
    """Shared state across gateway instances. Without a URL, limits are kept in this process's memory and budgets in
    the SQLite file (`store.sqlite_path`) every process on the host shares."""

    url: str | None = Field(default=None, description="redis://host:port/db or rediss://…")
    timeout: Annotated[float, Field(gt=0)] = 0.25
    on_failure: Literal["fail_open", "fail_closed"] = Field(
        default="fail_open", description="fail_open: fall back to per-instance limits; fail_closed: refuse (503)"
    )
    breaker_failures: Annotated[int, Field(gt=0)] = 3
    breaker_cooldown: Annotated[float, Field(gt=0)] = 5.0
    max_pending_settlements: Annotated[
        int,
        Field(
            gt=0,
            description=(
                "settlements (slot releases, token corrections) kept for Redis while it is "
                "unreachable, up to ~600 bytes "
                "each; beyond it the oldest is dropped and its slot frees when its lease runs out"
            ),
        ),
    ] = 100_000

    @field_validator("url")
    @classmethod
    def _redis_url(cls, value: str | None) -> str | None:
        """Read the URL now, with redis-py's own parser, so a mistake is a config error at start and not a
        traceback from the first part that connects."""
        from redis.asyncio.connection import parse_url

        if value is not None:
            parse_url(value)  # its ValueError names the problem
        return value


class ModelConfig(_Strict):
    """What the gateway must know of a model to count its tokens and bound its requests."""

    name: ModelName
    tokenizer: str | None = Field(
        default=None,
        description=(
            "'bundled' (the engine's SmolLM2 GGUF), 'gguf:PATH', 'hf:DIR' (tokenizer.json + tokenizer_config.json), "
            "'tiktoken:o200k_base' or 'tiktoken:cl100k_base'; None estimates"
        ),
    )
    context_window: Annotated[int | None, Field(gt=0)] = None

    @field_validator("tokenizer")
    @classmethod
    def _known_tokenizer(cls, value: str | None) -> str | None:
        kind = (value or "").partition(":")[0]
        if value is not None and value != "bundled" and kind not in ("gguf", "hf", "tiktoken"):
            raise ValueError("use 'bundled', 'gguf:PATH', 'hf:DIR' or 'tiktoken:ENCODING'")
        return value


def _default_models() -> list[ModelConfig]:
    return [ModelConfig(name="SmolLM2-135M-Instruct", tokenizer="bundled", context_window=8192)]


def _default_pools() -> list[PoolConfig]:
    return [
        PoolConfig(
            name="engine",
            routing="kv_events",
            replicas=[ReplicaConfig(url="http://127.0.0.1:8001"), ReplicaConfig(url="http://127.0.0.1:8002")],
        )
    ]


class TenantObjectsConfig(_Strict):
    """Objects tenants make upstream through the gateway (files, batches, stored responses: the collections of
    gateway/tenancy/catalog.py) are recorded with their tenant in the key store's backend, and only that tenant may
    reach them; docs/keys-and-spend.md."""

    ttl: Annotated[
        float,
        Field(
            gt=0,
            description=(
                "seconds a record of who made an object is kept from its making; after it the object is unreachable "
                "through the gateway (404), as if made outside it. Match what the upstream keeps (OpenAI keeps "
                "stored responses 30 days, files until deleted)"
            ),
        ),
    ] = 90 * 86400.0
    unrecorded: Literal["hidden", "readable"] = Field(
        default="hidden",
        description=(
            "objects the gateway has no record of (made outside it, or before their record expired): 'hidden', 404 "
            "to every tenant; 'readable', every tenant may read, list and refer to them (call such a fine-tuned "
            "model), none may change or delete them"
        ),
    )


class AdminConfig(_Strict):
    """The admin plane: /metrics, detailed /readyz and /admin/* answer only on this listener, never on the public one.

    Every request needs `Authorization: Bearer <token>`: the token in `token_env`'s variable, else one the gateway
    generates on its first start and keeps in `token_file` (gateway/admin/token.py). A generated token serves one
    machine's operator, so the listener may bind beyond loopback (e.g. for a Prometheus scrape in Kubernetes) only
    with `token_env` set, and only on a network the public cannot reach.
    """

    enabled: bool = True
    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 9901
    token_env: str | None = Field(default=None, description="env var holding the bearer token the admin plane requires")
    token_file: Path | None = Field(
        default=None,
        description=(
            "without token_env: the file the generated admin token is kept in (mode 0600), made on first start; "
            "unset: $XDG_STATE_HOME/portcullis/admin-token, else ~/.local/state/portcullis/admin-token"
        ),
    )
    allowed_hosts: list[Annotated[str, Field(pattern=_HOST_NAME)]] = Field(
        default_factory=list,
        description=(
            "Host header values the admin plane answers besides its own address (a DNS name a proxy forwards); "
            "'name' matches on any port, 'name:port' on that port only"
        ),
    )
    max_connections: Annotated[int, Field(gt=0)] = 64
    audit_log: Path | None = Field(
        default=None,
        description="file the admin API appends one JSON line per action to; unset: the 'portcullis.audit' logger",
    )

    @field_validator("allowed_hosts")
    @classmethod
    def _lower_case(cls, hosts: list[str]) -> list[str]:
        return [host.lower() for host in hosts]

    @model_validator(mode="after")
    def _token_beyond_loopback(self) -> AdminConfig:
        if self.token_env and self.token_file:
            raise ValueError(
                "admin.token_file is where a generated token is kept, and with admin.token_env set none is "
                "generated: set one of them"
            )
        if self.enabled and not self.token_env and not is_loopback(self.host):
            raise ValueError(
                f"admin.host {self.host!r} binds the admin plane beyond loopback, and admin.token_env is not set: "
                "set admin.token_env to an environment variable holding the admin token (a generated token file "
                "is for one machine's operator, on loopback), or bind admin.host to 127.0.0.1"
            )
        return self


def is_loopback(host: str) -> bool:
    """Whether a listener bound to `host` is reachable from this machine only: 'localhost', 127.0.0.0/8 or ::1."""
    if host.lower() == "localhost":
        return True
    try:
        return ip_address(host).is_loopback
    except ValueError:  # another name: it may resolve to anything
        return False


class StoreConfig(_Strict):
    """Where API keys made through the admin API and the spend ledger are kept. 'sqlite': one file (WAL), enough for
    the instances of one host; 'redis': `redis.url`, shared by every instance. Keys from `auth.keys` work as well."""

    backend: Literal["sqlite", "redis"] = "sqlite"
    sqlite_path: Path = Field(default=Path("portcullis.db"), description="relative paths are to the working directory")
    poll_interval: Annotated[
        float, Field(gt=0, le=1, description="seconds between an instance's looks for changed keys")
    ] = 0.25
    max_key_staleness: Annotated[
        float | None,
        Field(
            gt=0,
            description=(
                "seconds an instance that cannot read the key store keeps accepting stored keys from its last copy "
                "(a key revoked meanwhile among them); past it they get 503 key_store_unavailable until the store "
                "answers. null (the default): no bound, a store outage stops no one"
            ),
        ),
    ] = None
    flush_interval: Annotated[
        float, Field(gt=0, le=60, description="seconds the spend ledger gathers costs before writing them")
    ] = 1.0


class ResponseCacheConfig(_Strict):
    """Where the response cache keeps answers (which requests it serves is policy: `spec.cache`). 'memory': this
    process's own, least recently used first out past `max_bytes`; 'redis': `redis.url`, shared by every instance."""

    store: Literal["memory", "redis"] = "memory"
    max_bytes: Annotated[
        int, Field(gt=0, description="memory store: the answers it keeps, in bytes, before the oldest used go")
    ] = 64 * 1024 * 1024
    max_entry_bytes: Annotated[
        int, Field(gt=0, description="an answer bigger than this is never stored (either store)")
    ] = 1024 * 1024
    key_prefix: Annotated[str, Field(min_length=1, max_length=64)] = Field(
        default="portcullis:cache:", description="redis store: the prefix of its keys"
    )
    max_embeddings: Annotated[
        int,
        Field(
            gt=0,
            description=(
                "the semantic match (policy spec.cache.semantic): embeddings this process keeps, every tenant's "
                "together, the least recently used out first"
            ),
        ),
    ] = 10_000


FallbackTrigger = Literal["429", "5xx", "timeout", "connection_error", "context_length_exceeded"]
_ALL_TRIGGERS: list[FallbackTrigger] = ["429", "5xx", "timeout", "connection_error", "context_length_exceeded"]


class FallbackTarget(_Strict):
    """Where a failed request goes next: another model (served by whichever pool serves it), or the same model on
    another pool."""

    model: ModelName | None = None
    pool: str | None = None

    @model_validator(mode="after")
    def _one_target(self) -> FallbackTarget:
        if (self.model is None) == (self.pool is None):
            raise ValueError("give exactly one of 'model' or 'pool'")
        return self


class FallbackConfig(_Strict):
    """For requests naming `model`: the targets to try in order when its pool fails before the client got a byte."""

    model: ModelName
    to: Annotated[list[FallbackTarget], Field(min_length=1, max_length=8)]
    on: Annotated[list[FallbackTrigger], Field(min_length=1)] = Field(default_factory=lambda: list(_ALL_TRIGGERS))
    cooldown: Annotated[
        float, Field(ge=0, description="seconds a pool that failed is passed over for this model's requests")
    ] = 30.0


class GatewayConfig(_Strict):
    listen: ListenConfig = ListenConfig()
    admin: AdminConfig = AdminConfig()
    trusted_proxies: list[IPvAnyNetwork] = Field(
        default_factory=list,
        description=(
            "proxies whose X-Forwarded-For is believed when finding the client IP; empty: the socket peer is the "
            "client, whatever headers say"
        ),
    )
    limits: LimitsConfig = LimitsConfig()
    pools: Annotated[list[PoolConfig], Field(min_length=1)] = Field(default_factory=_default_pools)
    models: list[ModelConfig] = Field(default_factory=_default_models)
    auth: AuthConfig = AuthConfig()
    policy_dir: Path = Path("policies")
    redis: RedisConfig = RedisConfig()
    store: StoreConfig = StoreConfig()
    fallbacks: list[FallbackConfig] = Field(default_factory=list)
    mcp_servers: list[McpServerConfig] = Field(default_factory=list, description="served at /mcp/{name}")
    tenant_objects: TenantObjectsConfig = TenantObjectsConfig()
    response_cache: ResponseCacheConfig = ResponseCacheConfig()
    telemetry: TelemetryConfig = TelemetryConfig()

    @model_validator(mode="after")
    def _admin_apart(self) -> GatewayConfig:
        if self.admin.enabled and self.admin.port and self.admin.port == self.listen.port:
            raise ValueError("admin.port must differ from listen.port: the admin plane is a listener of its own")
        return self

    @model_validator(mode="after")
    def _store_has_redis(self) -> GatewayConfig:
        if self.store.backend == "redis" and not self.redis.url:
            raise ValueError("store.backend 'redis' needs redis.url")
        return self

    @model_validator(mode="after")
    def _cache_has_redis(self) -> GatewayConfig:
        if self.response_cache.store == "redis" and not self.redis.url:
            raise ValueError("response_cache.store 'redis' needs redis.url")
        return self

    @model_validator(mode="after")
    def _fallbacks_name_pools(self) -> GatewayConfig:
        """Every target is somewhere: a pool that exists, a model some pool serves; one list per model."""
        names = {pool.name for pool in self.pools}
        catch_all = any(not pool.models for pool in self.pools)
        served = {model for pool in self.pools for model in pool.models}
        seen: set[str] = set()
        for i, fallback in enumerate(self.fallbacks):
            if fallback.model in seen:
                raise ValueError(f"fallbacks[{i}].model: {fallback.model!r} has fallbacks listed already")
            seen.add(fallback.model)
            for j, target in enumerate(fallback.to):
                if target.pool is not None and target.pool not in names:
                    raise ValueError(f"fallbacks[{i}].to[{j}].pool: no pool named {target.pool!r}")
                if target.model is not None and not catch_all and target.model not in served:
                    raise ValueError(f"fallbacks[{i}].to[{j}].model: no pool serves {target.model!r}")
        return self

    @field_validator("mcp_servers")
    @classmethod
    def _unique_mcp_names(cls, servers: list[McpServerConfig]) -> list[McpServerConfig]:
        _refuse_repeated([server.name for server in servers], "MCP server names")
        return servers

    @field_validator("pools")
    @classmethod
    def _unique_pool_names(cls, pools: list[PoolConfig]) -> list[PoolConfig]:
        _refuse_repeated([pool.name for pool in pools], "pool names")
        return pools


def _refuse_repeated(names: list[str], what: str) -> None:
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"{what} must be unique, repeated: {', '.join(duplicates)}")


def load_config(path: str | os.PathLike[str] | None = None) -> GatewayConfig:
    """Load and validate the config from `path`, else $PORTCULLIS_CONFIG, else the embedded defaults."""
    path = path or os.environ.get(CONFIG_ENV)
    if not path:
        return GatewayConfig()
    source = Path(path)
    try:
        data = yaml.safe_load(source.read_text()) or {}
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: invalid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: top level must be a mapping, got {type(data).__name__}")
    try:
        return GatewayConfig.model_validate(data)
    except ValidationError as exc:
        problems = "\n".join(f"  {source}: {format_key_path(err['loc'])}: {err['msg']}" for err in exc.errors())
        raise ConfigError(f"invalid configuration:\n{problems}") from None


def format_key_path(loc: tuple[int | str, ...]) -> str:
    """Render a pydantic error location as `pools[0].replicas[1].url`."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"
