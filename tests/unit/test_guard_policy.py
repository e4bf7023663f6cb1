"""The policy model's guard section: defaults, validation errors with file:line, per-tenant overlays."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from gateway.policy.loader import PolicyError, load_policy_dir

ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, guard: dict | None, overlays: dict[str, dict] | None = None) -> Path:
    (tmp_path / "tenants").mkdir(parents=True, exist_ok=True)
    spec = {"guard": guard} if guard is not None else {}
    (tmp_path / "base.yaml").write_text(
        yaml.safe_dump({"apiVersion": "portcullis.dev/v1", "kind": "Policy", "metadata": {"name": "t"}, "spec": spec})
    )
    for tenant, g in (overlays or {}).items():
        (tmp_path / "tenants" / f"{tenant}.yaml").write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "portcullis.dev/v1",
                    "kind": "TenantPolicy",
                    "metadata": {"name": tenant},
                    "tenant": tenant,
                    "spec": {"guard": g},
                }
            )
        )
    return tmp_path


def test_defaults_are_off_and_cheap(tmp_path: Path) -> None:
    guard = load_policy_dir(write(tmp_path, None)).guard_for(None)
    assert guard.enabled is False
    assert guard.injection.action == "block" and guard.unknown_content == "scan"
    assert set(guard.injection.roles) >= {"system", "user", "assistant", "tool_result", "document", "tool_arguments"}
    assert {k: v.action for k, v in guard.injection.provenances.items()} == {
        "system": "monitor",
        "developer": "monitor",
        "tool_definitions": "monitor",
        "tool_result": "monitor",
        "document": "monitor",
    }, "ordinary prompts, tools and documents are written as instructions: by default it only records them"
    assert guard.output.enabled is False


def test_overlay_replaces_only_the_fields_it_gives(tmp_path: Path) -> None:
    base = {
        "enabled": True,
        "injection": {"threshold": 0.7, "action": "block", "roles": ["user", "tool", "system"]},
        "pii": {"secrets": "redact"},
        "runtime": {"max_batch": 16},
    }
    policies = load_policy_dir(
        write(
            tmp_path,
            base,
            {
                "acme": {"injection": {"action": "flag"}, "output": {"enabled": True, "hold_back": 32}},
                "quiet": {"enabled": False},
                "sneaky": {"runtime": {"max_batch": 1}},
            },
        )
    )
    acme = policies.guard_for("acme")
    assert acme.injection.action == "flag"
    assert acme.injection.threshold == 0.7 and acme.injection.roles == ["user", "tool", "system"]
    assert acme.pii.secrets == "redact"
    assert acme.output.enabled and acme.output.hold_back == 32
    assert policies.guard_for("quiet").enabled is False
    assert policies.guard_for("sneaky").runtime.max_batch == 16, "runtime comes from the base only"
    assert policies.guard_for("nobody") == policies.guard_for(None)
    assert policies.guard_for("acme") is acme, "computed once per tenant"


@pytest.mark.parametrize(
    "guard, needle",
    [
        ({"injection": {"action": "drop"}}, "spec.guard.injection.action"),
        ({"injection": {"threshold": 1.5}}, "spec.guard.injection.threshold"),
        ({"pii": {"secrets": "shred"}}, "spec.guard.pii.secrets"),
        ({"output": {"hold_back": -1}}, "spec.guard.output.hold_back"),
        ({"injection": {"roles": ["robot"]}}, "spec.guard.injection.roles"),
        ({"pii": {"types": ["email", "emial"]}}, "spec.guard.pii.types: Value error, unknown detector types ['emial']"),
        ({"thresholds": {}}, "spec.guard.thresholds"),
        ({"injection": {"cpu_budget": 0}}, "spec.guard.injection.cpu_budget: Input should be greater than 0"),
        ({"injection": {"max_windows": 64}}, "max_windows is no longer read: the guard scans up to max_tokens"),
    ],
)
def test_invalid_guard_sections_name_file_line_and_key(tmp_path: Path, guard: dict, needle: str) -> None:
    with pytest.raises(PolicyError) as caught:
        load_policy_dir(write(tmp_path, guard))
    message = str(caught.value)
    assert needle in message and "base.yaml:" in message


def test_repository_policies_and_schema_agree() -> None:
    import json

    from gateway.policy.model import json_schema

    policies = load_policy_dir(ROOT / "policies")
    assert policies.guard_for(None) is not None
    published = json.loads((ROOT / "policies" / "schema.json").read_text())
    assert published == json.loads(json.dumps(json_schema())), (
        "regenerate: portcullis policy schema > policies/schema.json"
    )
