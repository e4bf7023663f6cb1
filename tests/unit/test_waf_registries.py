"""The WAF's registries are whole: every operator, transform, request part and built-in pack is defined once and
reaches the policy model, the compiler, the policy docs and a test of its own. Each test here fails when an entry is
only half added."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from gateway.waf import operators
from gateway.waf.model import OPERATORS, PARAM_TARGETS, PLAIN_TARGETS, Condition, Numeric, SqliOptions
from gateway.waf.operators import Operator
from gateway.waf.packs import builtin_packs
from gateway.waf.parts import PARAM_PARTS, PARTS, RequestView
from gateway.waf.transforms import TRANSFORMS

DOCS = Path(__file__).resolve().parents[2] / "docs" / "policies.md"
STRUCTURE = {"all", "any", "not_", "target", "transforms"}  # Condition's fields that are no operator

# Per operator: a value a policy gives it, a text it matches, a text it does not.
EXAMPLES: dict[str, tuple[object, str, str]] = {
    "regex": (r"ev[i1]l", "an ev1l plan", "a good plan"),
    "phrases": (["drop table", "rm -rf"], "then rm -rf /", "remove it"),
    "equals": (2.0, "2", "2.5"),
    "in": (["gpt-4o", 7.0], "7", "gpt-4"),
    "number": (Numeric(gt=10), "11", "10"),
    "length": (Numeric(ge=5), "hello", "hey"),
    "sqli": (SqliOptions(min_tokens=3), "1' OR '1'='1' --", "quarterly report"),
    "xss": (True, "<script>alert(1)</script>", "a < b and c > d"),
    "tautology": (True, "x' OR 1=1", "x' OR 11!=11"),
    "cidr": (["10.0.0.0/8"], "10.1.2.3", "192.168.0.1"),
}


def _policy_name(field: str) -> str:
    return Condition.model_fields[field].alias or field


def test_every_operator_defined_is_carried_by_a_condition_field():
    defined = {name for name, value in vars(operators).items() if isinstance(value, Operator)}
    carried = {name for name, value in vars(operators).items() if value in OPERATORS.values()}
    assert defined == carried, f"no Condition field carries {sorted(defined - carried)}"


def test_every_condition_field_is_structure_or_an_operator():
    unregistered = set(Condition.model_fields) - STRUCTURE - set(OPERATORS)
    assert not unregistered, f"Condition fields without an Operator: {sorted(unregistered)}"


def test_every_operator_has_an_example_here():
    assert {_policy_name(field) for field in OPERATORS} == set(EXAMPLES)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_an_operator_given_in_a_policy_matches_through_its_registered_test(name):
    value, matching, other = EXAMPLES[name]
    condition = Condition.model_validate({"target": "args", name: value})
    given = condition.given_operator()
    assert given is not None and given[0] == name == condition.operator
    find = given[1].build(given[2])
    assert find(matching) is not None
    assert find(other) is None


def test_a_zero_is_a_value_an_operator_is_given_and_false_is_none():
    assert Condition.model_validate({"target": "arg_count", "equals": 0}).operator == "equals"
    assert Condition.model_validate({"target": "args", "in": [0], "xss": False}).operator == "in"


@pytest.mark.parametrize(
    ("name", "value", "reason"),
    [
        ("regex", "(a)\\1", "does not compile under RE2"),
        ("phrases", ["ok", ""], "non-empty strings"),
        ("cidr", ["10.0.0.0/33"], "invalid network"),
    ],
)
def test_an_operator_refuses_at_load_a_value_it_cannot_run(name, value, reason):
    with pytest.raises(ValueError, match=reason):
        Condition.model_validate({"target": "args", name: value})


def _backticked(bullet: str) -> set[str]:
    """The `names` in the policy docs' bullet that starts with **bullet**."""
    text = DOCS.read_text()
    start = text.index(f"- **{bullet}**")
    end = text.index("\n- **", start + 1) if "\n- **" in text[start + 1 :] else len(text)
    single = re.sub(r"(`{2,}).+?\1", " ", text[start:end])  # code spans that quote backticks
    return set(re.findall(r"`([^`]+)`", single))


def test_the_policy_docs_list_every_operator():
    missing = {_policy_name(field) for field in OPERATORS} - _backticked("Operators")
    assert not missing, f"docs/policies.md's Operators list lacks {sorted(missing)}"


def test_the_policy_docs_list_every_transform():
    missing = set(TRANSFORMS) - _backticked("Transforms")
    assert not missing, f"docs/policies.md's Transforms list lacks {sorted(missing)}"


def test_the_policy_docs_describe_every_builtin_pack():
    text = DOCS.read_text()
    section = text[text.index("### Rule packs") :]
    described = set(re.findall(r"^\| `([a-z0-9-]+)` \|", section, re.MULTILINE))
    missing = set(builtin_packs()[0]) - described
    assert not missing, f"docs/policies.md's Rule packs table lacks {sorted(missing)}"


def test_the_policy_docs_list_every_request_part():
    listed = _backticked("Targets")
    missing = {name for name in PARTS if name not in listed}
    missing |= {f"{kind}:" for kind in PARAM_PARTS if not any(name.startswith(f"{kind}:") for name in listed)}
    assert not missing, f"docs/policies.md's Targets list lacks {sorted(missing)}"


def test_every_request_part_a_policy_may_name_is_read():
    view = RequestView(method="POST", path="/v1/chat/completions", headers=[("user-agent", "sdk")], route="chat")
    view.payload = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    view.body = json.dumps(view.payload).encode()
    for name in PLAIN_TARGETS:
        assert Condition.model_validate({"target": name, "regex": "x"}).target == [name]
        assert isinstance(view.values(name), list)
    for kind in PARAM_TARGETS:
        assert isinstance(view.values(f"{kind}:user"), list)
