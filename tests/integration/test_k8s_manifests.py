"""The Kubernetes deployment as each overlay renders it (`kubectl kustomize`): every object valid for the Kubernetes
version stated below, the Prometheus Operator objects carrying what the operator needs, every metric an alert or the
dashboard asks for one the gateway really exports, pods that run as non-root on a read-only root filesystem, and the
policies mounted so that the gateway's hot reload sees their updates.

The metric names come from a real gateway's /metrics, scraped the way the ServiceMonitor scrapes it (a bearer token
from the variable admin.token_env names); tests/integration/test_k8s_gateway.py runs the rendered config itself.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import GatewayConfig, load_config
from gateway.policy.loader import load_policy_dir
from tests.conftest import Launcher, RedisServer, pool
from tests.kustomize import BASE, OVERLAYS, render

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES_VERSION = "1.30"  # the oldest minor still in upstream or managed-cluster support the manifests target
OPERATOR_KINDS = {"ServiceMonitor", "PrometheusRule"}  # monitoring.coreos.com/v1: no schema in kubernetes-validate
DASHBOARD = BASE / "dashboards" / "portcullis-gateway.json"
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet")

# Metrics the alerts may use that other exporters provide: Prometheus's own scrape health, and kube-state-metrics
# (installed with kube-prometheus-stack) for pods' readiness.
EXTERNAL_METRICS = {
    "up": "Prometheus",
    "kube_deployment_status_replicas_available": "kube-state-metrics",
    "kube_deployment_spec_replicas": "kube-state-metrics",
    "kube_statefulset_status_replicas_ready": "kube-state-metrics",
    "kube_statefulset_replicas": "kube-state-metrics",
}
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset"}
PROMQL_WORDS |= {"inf", "nan"}


@pytest.fixture(scope="module", params=OVERLAYS)
def objects(request) -> list[dict]:
    return render(request.param)


def _of_kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def _named(objects: list[dict], kind: str, name: str) -> dict:
    found = [o for o in _of_kind(objects, kind) if o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def _pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def _gateway(objects: list[dict]) -> tuple[dict, dict]:
    found = [
        (w, c)
        for w in objects
        if w["kind"] in WORKLOAD_KINDS
        for c in _pod_spec(w)["containers"]
        if c.get("command", [])[:2] == ["portcullis", "serve"]
    ]
    assert len(found) == 1, "expected one container running `portcullis serve`"
    return found[0]


def _selects(selector: dict, labels: dict) -> bool:
    return bool(selector) and selector.items() <= labels.items()


def gateway_config_text(objects: list[dict]) -> str:
    """The config file the gateway container reads (the ConfigMap key mounted at $PORTCULLIS_CONFIG)."""
    workload, container = _gateway(objects)
    path = next(e["value"] for e in container["env"] if e["name"] == "PORTCULLIS_CONFIG")
    mount = next(m for m in container["volumeMounts"] if Path(path).parent == Path(m["mountPath"]))
    volume = next(v for v in _pod_spec(workload)["volumes"] if v["name"] == mount["name"])
    return _named(objects, "ConfigMap", volume["configMap"]["name"])["data"][Path(path).name]


@pytest.fixture(scope="module")
def config(objects, tmp_path_factory) -> GatewayConfig:
    """The gateway's config as the overlay mounts it, read by the real loader."""
    file = tmp_path_factory.mktemp("config") / "portcullis.yaml"
    file.write_text(gateway_config_text(objects))
    return load_config(file)


# ---- schemas ---------------------------------------------------------------------------------------------------


def test_every_core_object_validates_against_the_kubernetes_schema(objects):
    kinds = set()
    for obj in objects:
        kinds.add(obj["kind"])
        if obj["kind"] in OPERATOR_KINDS:
            assert obj["apiVersion"] == "monitoring.coreos.com/v1", obj["metadata"]["name"]
            continue
        try:  # strict: an unknown or misplaced field is an error, not silently dropped by the API server
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']}: {path}: {exc.message}")
    expected = {"Deployment", "StatefulSet", "Service", "ConfigMap", "HorizontalPodAutoscaler"}
    expected |= {"PodDisruptionBudget", "NetworkPolicy", "ServiceMonitor", "PrometheusRule"}
    assert expected <= kinds, f"missing from the render: {expected - kinds}"


def test_every_configmap_and_secret_a_pod_names_exists(objects):
    examples = [doc for path in BASE.glob("*.example.yaml") for doc in yaml.safe_load_all(path.read_text())]
    configmaps = {o["metadata"]["name"] for o in _of_kind(objects, "ConfigMap")}
    secrets = {o["metadata"]["name"] for o in examples if o["kind"] == "Secret"}
    for workload in (o for o in objects if o["kind"] in WORKLOAD_KINDS):
        spec = _pod_spec(workload)
        for volume in spec.get("volumes", []):
            if "configMap" in volume:
                assert volume["configMap"]["name"] in configmaps, volume
        for container in spec["containers"]:
            for ref in container.get("envFrom", []):
                assert ref["secretRef"]["name"] in secrets, ref


# ---- the gateway pods share Redis, and the autoscaler owns their count ------------------------------------------


def test_gateway_replicas_keep_keys_budgets_and_limits_in_redis(objects, config):
    assert config.redis.url, "rate limits and budgets need redis.url to be shared by the replicas"
    assert config.store.backend == "redis", (
        "keys and spend in a SQLite file per pod: a key made on one pod fails on another"
    )
    workload, _ = _gateway(objects)
    assert "replicas" not in workload["spec"], "the autoscaler owns the count: an apply would reset it"
    hpa = [
        h
        for h in _of_kind(objects, "HorizontalPodAutoscaler")
        if h["spec"]["scaleTargetRef"]["name"] == workload["metadata"]["name"]
    ]
    assert len(hpa) == 1 and hpa[0]["spec"]["scaleTargetRef"]["kind"] == workload["kind"]
    assert hpa[0]["spec"]["minReplicas"] >= 2, "one gateway pod is a single point of failure"
    budgets = [
        p
        for p in _of_kind(objects, "PodDisruptionBudget")
        if _selects(p["spec"]["selector"]["matchLabels"], workload["spec"]["template"]["metadata"]["labels"])
    ]
    assert len(budgets) == 1
    spec = budgets[0]["spec"]
    allowed = (
        spec["maxUnavailable"] if "maxUnavailable" in spec else hpa[0]["spec"]["minReplicas"] - spec["minAvailable"]
    )
    assert 0 < allowed < hpa[0]["spec"]["minReplicas"], "a drain must be possible and never take every pod"


# ---- security ----------------------------------------------------------------------------------------------------


def test_every_container_is_non_root_read_only_and_without_capabilities(objects):
    for workload in (o for o in objects if o["kind"] in WORKLOAD_KINDS):
        spec = _pod_spec(workload)
        assert spec.get("automountServiceAccountToken") is False, workload["metadata"]["name"]
        for container in spec["containers"]:
            where = f"{workload['metadata']['name']}/{container['name']}"
            ctx = {**spec.get("securityContext", {}), **container.get("securityContext", {})}
            assert ctx.get("runAsNonRoot") is True, where
            assert ctx.get("runAsUser", 0) != 0, where
            assert ctx.get("readOnlyRootFilesystem") is True, where
            assert ctx.get("allowPrivilegeEscalation") is False, where
            assert ctx.get("capabilities", {}).get("drop") == ["ALL"] and not ctx["capabilities"].get("add"), where
            assert ctx.get("seccompProfile", {}).get("type") == "RuntimeDefault", where


def test_every_path_the_gateway_writes_is_an_emptydir(objects, config):
    workload, container = _gateway(objects)
    volumes = {v["name"]: v for v in _pod_spec(workload)["volumes"]}
    writable = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"] if not m.get("readOnly")}
    assert all("emptyDir" in v for v in writable.values()), f"writable mounts that are not emptyDir: {writable}"
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    temporary = env.get("TMPDIR", "/tmp")  # the workers' metric files (PROMETHEUS_MULTIPROC_DIR) live here
    assert any(Path(temporary).is_relative_to(path) for path in writable), f"TMPDIR {temporary} is not writable"
    # What else the gateway could write, and why it does not here:
    assert config.store.backend == "redis", f"store.sqlite_path {config.store.sqlite_path} is on the read-only root"
    assert config.admin.token_env, "without admin.token_env the gateway writes a generated token file"
    assert config.admin.audit_log is None or any(config.admin.audit_log.is_relative_to(p) for p in writable)


def test_network_policies_admit_only_what_each_pod_serves(objects, config):
    policies = _of_kind(objects, "NetworkPolicy")
    workload, container = _gateway(objects)
    gateway_labels = workload["spec"]["template"]["metadata"]["labels"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}

    def ingress_rules(labels: dict) -> list[dict]:
        selecting = [p for p in policies if _selects(p["spec"]["podSelector"]["matchLabels"], labels)]
        assert selecting and all("Ingress" in p["spec"]["policyTypes"] for p in selecting), labels
        return [rule for p in selecting for rule in p["spec"].get("ingress", [])]

    def port_of(rule_port: dict) -> int:
        return ports.get(rule_port["port"], rule_port["port"])

    gateway_rules = ingress_rules(gateway_labels)
    for rule in gateway_rules:
        admitted = {port_of(p) for p in rule.get("ports", [])}
        assert admitted, "a rule without ports opens every port"
        if config.admin.port in admitted:
            sources = rule.get("from", [])
            assert sources and all("namespaceSelector" in s or "podSelector" in s for s in sources), (
                "the admin port must admit Prometheus alone"
            )
    assert any(config.listen.port in {port_of(p) for p in r.get("ports", [])} for r in gateway_rules)
    # Redis and the engines: the gateway's pods alone
    for kind, name in (("StatefulSet", "portcullis-redis"), ("StatefulSet", "portcullis-engine")):
        labels = _named(objects, kind, name)["spec"]["template"]["metadata"]["labels"]
        for rule in ingress_rules(labels):
            assert rule.get("from") and all(
                _selects(s["podSelector"]["matchLabels"], gateway_labels) for s in rule["from"]
            )
    gateway_policy = [p for p in policies if _selects(p["spec"]["podSelector"]["matchLabels"], gateway_labels)]
    egress_ports = {
        p["port"] for pol in gateway_policy for rule in pol["spec"].get("egress", []) for p in rule.get("ports", [])
    }
    reached = {urlsplit(config.redis.url).port, urlsplit(config.telemetry.otlp.endpoint).port, 53}
    reached |= {urlsplit(r.url).port for p in config.pools for r in p.replicas}
    assert reached <= egress_ports, f"the gateway could not reach {reached - egress_ports}"


# ---- policies from a ConfigMap, hot-reloaded --------------------------------------------------------------------


def reloadable_configmap(objects: list[dict], directory: str) -> str:
    """The name of the ConfigMap mounted at `directory` so that kubelet's updates reach the gateway's reload: whole
    (kubelet never updates a subPath mount) and under a fixed name (a hash suffix would roll pods instead)."""
    workload, container = _gateway(objects)
    mounts = [m for m in container["volumeMounts"] if m["mountPath"] == directory]
    assert len(mounts) == 1, f"nothing mounted at {directory}"
    assert "subPath" not in mounts[0], "kubelet never updates a subPath mount: hot reload would see no change"
    volume = next(v for v in _pod_spec(workload)["volumes"] if v["name"] == mounts[0]["name"])
    name = volume["configMap"]["name"]
    generators = yaml.safe_load((BASE / "kustomization.yaml").read_text())["configMapGenerator"]
    fixed = {g["name"] for g in generators if g.get("options", {}).get("disableNameSuffixHash")}
    assert name in fixed, f"{name}: a hash suffix would roll pods instead of reloading"
    return name


def test_the_config_is_a_configmap_mounted_whole_under_a_fixed_name(objects):
    _, container = _gateway(objects)
    path = Path(next(e["value"] for e in container["env"] if e["name"] == "PORTCULLIS_CONFIG"))
    assert container["command"][-1] == str(path), "the gateway reads another file than PORTCULLIS_CONFIG names"
    assert path.name in _named(objects, "ConfigMap", reloadable_configmap(objects, str(path.parent)))["data"]


def test_policies_are_a_configmap_mounted_whole_and_match_the_repository(objects, config, tmp_path):
    data = _named(objects, "ConfigMap", reloadable_configmap(objects, str(config.policy_dir)))["data"]
    repository = {p.name: p.read_text() for p in (ROOT / "policies").glob("*.yaml")}
    assert data == repository, "deploy/k8s/base/policies/ differs from policies/: copy the security team's files over"
    for key, text in data.items():
        (tmp_path / key).write_text(text)
    load_policy_dir(tmp_path)  # the gateway's own loader: a policy it would refuse fails here


# ---- Prometheus Operator objects and the dashboard ----------------------------------------------------------------


@pytest.fixture(scope="module")
def exported_metrics(module_launcher: Launcher, module_redis_server: RedisServer) -> set[str]:
    """Every series name a gateway's /metrics can carry (counters' _total, histograms' _bucket/_sum/_count), scraped
    from a real gateway with every optional family on (per-key billing, Redis settlements, the guard)."""
    upstream = module_launcher.fake_upstream()
    gw = module_launcher.gateway(
        {
            "pools": [pool("main", upstream.url)],
            "redis": {"url": module_redis_server.url},
            "store": {"backend": "redis"},
            "admin": {"token_env": "PORTCULLIS_ADMIN_TOKEN"},
            "telemetry": {"per_key_metrics": True},
        },
        env={"PORTCULLIS_ADMIN_TOKEN": "scrape-token"},
    )
    scrape = gw.admin.get("/metrics")
    assert scrape.status_code == 200, scrape.text
    names = set()
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    for family in text_string_to_metric_families(scrape.text):
        names |= {family.name + suffix for suffix in suffixes.get(family.type, ("",))}
        names |= {sample.name for sample in family.samples}
    return names


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers that are not functions, keywords, label names (in
    {} or after by/without/on/ignoring), durations, strings or Grafana's $variables."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings
    text = re.sub(r"\$\{?\w+\}?", "", text)  # Grafana variables
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # ranges
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        following = text[match.end() :].lstrip()
        if following.startswith("(") or match.group(0).lower() in PROMQL_WORDS:
            continue
        if match.start() > 0 and (text[match.start() - 1].isdigit() or text[match.start() - 1] == "."):
            continue  # part of a number such as 1e3
        names.add(match.group(0))
    return names


def test_metric_names_are_read_from_promql():
    """The reader the two tests below rely on, on the shapes they meet."""
    expr = 'sum by (pool) (rate(a_total{status=~"5..", x="y"}[5m])) / on (pool) b_count > 0.1 and time() - c > 60'
    assert metric_names(expr) == {"a_total", "b_count", "c"}
    assert metric_names("histogram_quantile(0.99, sum by (le) (rate(h_bucket[$__rate_interval])))") == {"h_bucket"}
    assert _balanced('sum(rate(a{b=")"}[5m]))') and not _balanced("sum(rate(a[5m])") and not _balanced("a[5m)]")


def _balanced(expr: str) -> bool:
    """Brackets outside strings close in order: the typo a metric-name check alone would let through."""
    stack, pairs = [], {")": "(", "]": "[", "}": "{"}
    for char in re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr):
        if char in "([{":
            stack.append(char)
        elif char in pairs and (not stack or stack.pop() != pairs[char]):
            return False
    return not stack


def _check_names(expressions: dict[str, str], exported: set[str]) -> None:
    assert expressions
    for where, expr in expressions.items():
        assert _balanced(expr), f"{where}: unbalanced brackets: {expr}"
        names = metric_names(expr)
        assert names, f"{where}: reads no metric: {expr}"
        unknown = names - exported - EXTERNAL_METRICS.keys()
        assert not unknown, (
            f"{where}: {sorted(unknown)} is exported by neither the gateway nor {set(EXTERNAL_METRICS.values())}"
        )


def test_alerts_are_well_formed_and_read_only_metrics_that_exist(objects, exported_metrics):
    (rule,) = _of_kind(objects, "PrometheusRule")
    expressions = {}
    for group in rule["spec"]["groups"]:
        assert group["name"] and group["rules"]
        for alert in group["rules"]:
            assert set(alert) <= {"alert", "expr", "for", "labels", "annotations"}, alert
            assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", alert["alert"])
            assert re.fullmatch(r"(\d+[smhd])+", alert.get("for", "0s")), alert["alert"]
            assert alert["labels"]["severity"] in {"critical", "warning", "info"}
            assert alert["annotations"]["summary"]
            expressions[alert["alert"]] = alert["expr"]
    assert len(expressions) == sum(len(g["rules"]) for g in rule["spec"]["groups"]), "an alert name is repeated"
    _check_names(expressions, exported_metrics)


def test_dashboard_queries_read_only_metrics_that_exist(objects, exported_metrics):
    dashboard = json.loads(DASHBOARD.read_text())
    configmaps = [c for c in _of_kind(objects, "ConfigMap") if c["metadata"].get("labels", {}).get("grafana_dashboard")]
    assert [c["data"] for c in configmaps] == [{DASHBOARD.name: DASHBOARD.read_text()}], "the ConfigMap is the file"
    variables = {v["name"] for v in dashboard["templating"]["list"] if v["type"] == "datasource"}
    expressions = {}
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            uid = target["datasource"]["uid"]
            assert uid.strip("${}") in variables, f"{panel['title']}: data source {uid} is not the dashboard's variable"
            expressions[f"{panel['title']} {target['refId']}"] = target["expr"]
    _check_names(expressions, exported_metrics)


def test_service_monitor_scrapes_every_gateway_pods_admin_port_with_the_admin_token(objects, config):
    (monitor,) = _of_kind(objects, "ServiceMonitor")
    workload, container = _gateway(objects)
    services = [
        s
        for s in _of_kind(objects, "Service")
        if _selects(monitor["spec"]["selector"]["matchLabels"], s["metadata"].get("labels", {}))
    ]
    assert len(services) == 1, "the ServiceMonitor should select the admin Service alone"
    service = services[0]
    assert _selects(service["spec"]["selector"], workload["spec"]["template"]["metadata"]["labels"])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    (endpoint,) = monitor["spec"]["endpoints"]
    service_port = next(p for p in service["spec"]["ports"] if p["name"] == endpoint["port"])
    target = service_port["targetPort"]
    assert ports.get(target, target) == config.admin.port, "the scrape must reach admin.port"
    assert endpoint.get("path", "/metrics") == "/metrics"
    auth = endpoint["authorization"]
    assert auth.get("type", "Bearer") == "Bearer"
    secret_ref = auth["credentials"]
    # the same Secret key the gateway's admin.token_env variable comes from, in the ServiceMonitor's namespace
    env_from = {ref["secretRef"]["name"] for ref in container.get("envFrom", [])}
    key_refs = {
        (e["valueFrom"]["secretKeyRef"]["name"], e["valueFrom"]["secretKeyRef"]["key"]): e["name"]
        for e in container.get("env", [])
        if "secretKeyRef" in e.get("valueFrom", {})
    }
    given = key_refs.get((secret_ref["name"], secret_ref["key"])) or (
        secret_ref["key"] if secret_ref["name"] in env_from else None
    )
    assert given == config.admin.token_env, (
        f"the scrape sends {secret_ref}, the gateway reads ${config.admin.token_env}"
    )
    assert monitor["metadata"]["namespace"] == workload["metadata"]["namespace"]
