"""The policy model: loading, overlays, errors that point at file, line and rule, and the published schema."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from gateway.policy.loader import PolicyError, load_policy_dir
from gateway.policy.model import json_schema
from tests.conftest import ROOT, policy_dir

RPM = {"id": "rpm", "key": ["tenant"], "requests": {"limit": 10, "per": "1m"}}
TPM = {"id": "tpm", "tokens": {"limit": 1000, "per": "1h", "count": "input"}}
SLOTS = {"id": "slots", "concurrency": {"limit": 2}}


def test_overlays_replace_add_and_disable_rules(tmp_path):
    overlay = [{"id": "rpm", "requests": {"limit": 99, "per": 60}}, {"id": "extra", "concurrency": {"limit": 1}}]
    path = Path(policy_dir(tmp_path, [RPM, TPM, SLOTS], {"team-a": overlay}))
    text = (path / "tenants" / "team-a.yaml").read_text().replace("spec:\n", "spec:\n  disable: [slots]\n")
    (path / "tenants" / "team-a.yaml").write_text(text)
    policies = load_policy_dir(path)
    assert [r.id for r in policies.rate_limits_for("someone")] == ["rpm", "tpm", "slots"]
    team_a = policies.rate_limits_for("team-a")
    assert [r.id for r in team_a] == ["rpm", "tpm", "extra"]
    assert team_a[0].requests.limit == 99 and policies.rate_limits_for(None)[0].requests.limit == 10
    assert policies.base.spec.rate_limits[1].tokens.per == 3600.0


def test_version_is_a_content_hash(tmp_path):
    path = Path(policy_dir(tmp_path, [RPM]))
    first = load_policy_dir(path).version
    assert first.startswith("sha256:") and load_policy_dir(path).version == first
    policy_dir(tmp_path, [{**RPM, "description": "changed"}])
    assert load_policy_dir(path).version != first


def _write(tmp_path: Path, text: str) -> Path:
    directory = tmp_path / "p"
    directory.mkdir(exist_ok=True)
    (directory / "base.yaml").write_text(text)
    return directory


def test_errors_name_file_line_key_path_and_rule_id(tmp_path):
    text = """apiVersion: portcullis.dev/v1
kind: Policy
metadata: {name: base}
spec:
  rate_limits:
    - id: fine
      requests: {limit: 1, per: 1s}
    - id: both-kinds
      requests: {limit: 1, per: 1s}
      tokens: {limit: 1, per: 1s}
    - id: bad-window
      requests:
        limit: 5
        per: one fortnight
"""
    directory = _write(tmp_path, text)
    with pytest.raises(PolicyError) as info:
        load_policy_dir(directory)
    message = str(info.value)
    base = directory / "base.yaml"
    assert f"{base}:8: spec.rate_limits[1] (rule id both-kinds): Value error, give exactly one of" in message
    assert f"{base}:14: spec.rate_limits[2].requests.per (rule id bad-window): Value error, invalid duration" in message


@pytest.mark.parametrize(
    "text, problem",
    [
        ("apiVersion: portcullis.dev/v2\nkind: Policy\nmetadata: {name: x}\n", "apiVersion"),
        ("kind: Policy\nmetadata: {name: x}\n", "apiVersion: Field required"),
        ("apiVersion: portcullis.dev/v1\nkind: Nonsense\nmetadata: {name: x}\n", "does not match any of the expected"),
        ("a: [1\n", "invalid YAML"),
        (
            "apiVersion: portcullis.dev/v1\nkind: TenantPolicy\nmetadata: {name: x}\ntenant: t\n",
            "exactly one 'kind: Policy'",
        ),
        (
            "apiVersion: portcullis.dev/v1\nkind: Policy\nmetadata: {name: x}\nspec:\n  rate_limits:\n"
            "    - {id: a, concurrency: {limit: 1}}\n    - {id: a, concurrency: {limit: 2}}\n",
            "unique, repeated: a",
        ),
        (
            "apiVersion: portcullis.dev/v1\nkind: Policy\nmetadata: {name: x}\nspec:\n  rate_limits:\n"
            "    - {id: Bad Id, concurrency: {limit: 1}}\n",
            "rate_limits[0].id",
        ),
        ("apiVersion: portcullis.dev/v1\nkind: Policy\nmetadata: {name: x}\nspec: {waf_rulez: []}\n", "Extra inputs"),
    ],
)
def test_invalid_documents_are_refused(tmp_path, text, problem):
    with pytest.raises(PolicyError, match="invalid policy") as info:
        load_policy_dir(_write(tmp_path, text))
    assert problem in str(info.value)


def test_overlay_problems_are_refused(tmp_path):
    path = Path(policy_dir(tmp_path, [RPM], {"t": [SLOTS]}))
    overlay = yaml.safe_load((path / "tenants" / "t.yaml").read_text())
    overlay["spec"]["disable"] = ["no-such-rule"]
    (path / "tenants" / "t.yaml").write_text(yaml.safe_dump(overlay))
    (path / "tenants" / "t-again.yaml").write_text(yaml.safe_dump(overlay))
    with pytest.raises(PolicyError) as info:
        load_policy_dir(path)
    assert "disables unknown rule id 'no-such-rule'" in str(info.value)
    assert "tenant 't' already has an overlay" in str(info.value)


def test_prices_belong_to_the_base_policy(tmp_path):
    path = Path(policy_dir(tmp_path, [RPM], {"t": []}))
    overlay = yaml.safe_load((path / "tenants" / "t.yaml").read_text())
    overlay["spec"]["prices"] = {"default": {"input": 0.0}}
    (path / "tenants" / "t.yaml").write_text(yaml.safe_dump(overlay))
    with pytest.raises(PolicyError, match="'prices' belong to the base policy"):
        load_policy_dir(path)


def test_a_price_table_prices_cached_prompt_tokens_and_unknown_models() -> None:
    from gateway.policy.model import PriceTable

    table = PriceTable.model_validate(
        {"models": {"m": {"input": 3.0, "cached_input": 0.3, "output": 15.0}}, "default": {"input": 1.0, "output": 2.0}}
    )
    assert table.cost_nanos("m", 1_000_000, 400_000, 100_000) == 3_420_000_000  # 0.6 x 3 + 0.4 x 0.3 + 0.1 x 15
    assert table.cost_nanos("unknown", 1_000_000, 400_000, 0) == 1_000_000_000, "cached input defaults to input"
    assert table.cost_nanos("m", 1, 0, 0) == 3_000, "one token at 3 per million is 3,000 nanos, exactly"


def test_published_schema_is_current():
    committed = json.loads((ROOT / "policies" / "schema.json").read_text())
    assert committed == json_schema(), "regenerate: portcullis policy schema > policies/schema.json"


def test_shipped_policies_and_examples_load(tmp_path):
    assert load_policy_dir(ROOT / "policies").base.metadata.name == "base"
    examples = tmp_path / "examples"
    (examples / "tenants").mkdir(parents=True)
    shutil.copy(ROOT / "policies" / "examples" / "rate-limits.yaml", examples)
    shutil.copy(ROOT / "policies" / "examples" / "tenant-team-a.yaml", examples / "tenants")
    policies = load_policy_dir(examples)
    assert {r.id for r in policies.rate_limits_for("team-a")} == {"key-rpm", "tenant-tpm", "tenant-concurrency"}
