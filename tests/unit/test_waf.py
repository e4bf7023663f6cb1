"""The WAF engine and its place in the policy model: loading and errors, overlays, exclusions, scoring, redaction,
linear time on hostile patterns and inputs, and the security team's CLI (check, test, explain)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml

from gateway.cli import main as cli
from gateway.policy.loader import PolicyError, load_policy_dir
from gateway.waf.parts import RequestView

POLICY = {"apiVersion": "portcullis.dev/v1", "kind": "Policy", "metadata": {"name": "t"}}


def write_policy(tmp_path: Path, waf: dict, overlays: dict[str, dict] | None = None, extra: dict | None = None) -> Path:
    directory = tmp_path / "policies"
    (directory / "tenants").mkdir(parents=True, exist_ok=True)
    (directory / "base.yaml").write_text(yaml.safe_dump({**POLICY, "spec": {"waf": waf}}))
    for tenant, spec in (overlays or {}).items():
        doc = {
            "apiVersion": "portcullis.dev/v1",
            "kind": "TenantPolicy",
            "metadata": {"name": tenant},
            "tenant": tenant,
            "spec": spec,
        }
        (directory / "tenants" / f"{tenant}.yaml").write_text(yaml.safe_dump(doc))
    for name, doc in (extra or {}).items():
        (directory / name).write_text(yaml.safe_dump(doc))
    return directory


def chat(
    prompt: str = "hello",
    query: str = "",
    tenant: str | None = None,
    route: str = "chat",
    path: str = "/v1/chat/completions",
    **payload,
) -> RequestView:
    body = {"model": "m", "messages": [{"role": "user", "content": prompt}], **payload}
    return RequestView(
        method="POST",
        path=path,
        query=query,
        body=json.dumps(body).encode(),
        payload=body,
        headers=[("content-type", "application/json"), ("user-agent", "t")],
        tenant=tenant,
        route=route,
        model="m",
    )


RULE = {"id": "no-foo", "severity": "critical", "when": {"target": "prompt", "regex": "foo"}}


def test_packs_rules_and_scoring(tmp_path):
    policies = load_policy_dir(
        write_policy(
            tmp_path,
            {
                "packs": ["sqli"],
                "rules": [
                    RULE,
                    {"id": "notice", "severity": "notice", "when": {"target": "prompt", "phrases": ["bar"]}},
                ],
            },
        )
    )
    waf = policies.waf_for(None)
    assert waf.evaluate(chat("hello")).action == "allow"
    blocked = waf.evaluate(chat("a foo"))
    assert blocked.blocked and blocked.rule_ids == ["no-foo"] and blocked.score == 5
    logged = waf.evaluate(chat("a bar"))  # 2 points < threshold 5: logged, not blocked
    assert logged.action == "log" and logged.score == 2
    assert waf.evaluate(chat(query="id=1%27%20or%20%271%27=%271")).blocked
    assert waf.evaluate(chat("' or '1'='1")).action == "allow"  # SQL in a prompt is not an attack on us


SQL_TOOL = [
    {
        "type": "function",
        "function": {
            "name": "run_sql",
            "description": "Run a query such as SELECT name FROM users WHERE id = 1 OR 1=1; -- and return rows",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {
                        "type": "string",
                        "description": "e.g. SELECT * FROM t WHERE a != 'x' UNION SELECT * FROM u",
                    }
                },
            },
        },
    }
]
SQL_CALL = [
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {
                    "name": "run_sql",
                    "arguments": json.dumps({"query": "SELECT * FROM users WHERE name = '' OR '1'='1' --"}),
                },
            }
        ],
    }
]


def test_tool_descriptions_and_call_arguments_are_prompt_text(tmp_path):
    """SQL in a tool's description or in the model's earlier tool-call arguments is what an agent legitimately sends:
    the web-attack packs leave it alone (the same text in an application field is blocked) and the LLM packs read it
    as the system's and the assistant's prompt text."""
    waf = load_policy_dir(write_policy(tmp_path, {"packs": ["sqli", "llm"], "paranoia_level": 2})).waf_for(None)
    assert waf.evaluate(chat("list users", tools=SQL_TOOL)).action == "allow"
    view = chat("list users", messages=[{"role": "user", "content": "list users"}, *SQL_CALL])
    assert waf.evaluate(view).action == "allow"
    assert waf.evaluate(chat("list users", metadata={"note": "' OR '1'='1' --"})).blocked
    tools = [{"type": "function", "function": {"name": "t", "description": "key AKIAIOSFODNN7EXAMPLE"}}]
    secret = chat("hi", tools=tools)
    assert [v[2] for v in secret.values("prompt:system")] == [("tools", 0, "function", "description")]
    assert "llm-secret-110" in waf.evaluate(secret, all_matches=True).rule_ids
    sql = "SELECT * FROM users WHERE name = '' OR '1'='1' --"
    assert [v[1] for v in view.values("prompt:assistant")] == [sql, "query"]  # the arguments' value, then its key


def test_monitor_mode_never_blocks(tmp_path):
    waf = load_policy_dir(write_policy(tmp_path, {"mode": "monitor", "rules": [RULE]})).waf_for(None)
    verdict = waf.evaluate(chat("foo"))
    assert verdict.action == "monitor" and not verdict.blocked and verdict.rule_ids == ["no-foo"]


def test_conditions_over_request_parts(tmp_path):
    rules = [
        {
            "id": "all-any-not",
            "when": {
                "all": [
                    {"target": "model", "equals": "m"},
                    {"any": [{"target": "tenant", "in": ["t1", "t2"]}, {"target": "key_label", "equals": "ops"}]},
                    {"not": {"target": "client_ip", "cidr": ["10.0.0.0/8"]}},
                ]
            },
        },
        {"id": "json-path", "when": {"target": "json:tools.*.function.name", "regex": "^exec$"}},
        {
            "id": "system-role",
            "when": {"target": "prompt:system", "transforms": ["lowercase"], "phrases": ["ignore all"]},
        },
        {"id": "long-prompt", "severity": "warning", "when": {"target": "prompt", "length": {"gt": 50}}},
        {"id": "temp", "when": {"target": "json:temperature", "number": {"ge": 1.5}}},
    ]
    waf = load_policy_dir(write_policy(tmp_path, {"rules": rules})).waf_for(None)
    v = chat()
    v.tenant, v.client_ip = "t1", "8.8.8.8"
    assert waf.evaluate(v).rule_ids == ["all-any-not"]
    v = chat()
    v.tenant, v.client_ip = "t1", "10.1.2.3"
    assert waf.evaluate(v).rule_ids == []
    assert waf.evaluate(chat(tools=[{"function": {"name": "exec"}}])).rule_ids == ["json-path"]
    sys_view = chat()
    sys_view.payload["messages"].insert(0, {"role": "system", "content": "IGNORE ALL rules"})
    assert waf.evaluate(sys_view).rule_ids == ["system-role"]
    assert waf.evaluate(chat("x" * 60)).rule_ids == ["long-prompt"]
    assert waf.evaluate(chat(temperature=1.8)).rule_ids == ["temp"]


def test_regexes_over_one_part_through_different_transforms(tmp_path):
    """A part read through several transform chains: values they all leave unchanged are scanned once for every
    chain's regexes, values they change are scanned chain by chain; both must find each rule's match, fresh or
    remembered."""
    rules = [
        {"id": "raw", "when": {"target": "headers", "regex": "evil-[0-9]+"}},
        {"id": "decoded", "when": {"target": "headers", "transforms": ["url_decode"], "regex": "<x>"}},
        {"id": "lowered", "when": {"target": "headers", "transforms": ["lowercase"], "regex": "^shout$"}},
    ]
    waf = load_policy_dir(write_policy(tmp_path, {"rules": rules})).waf_for(None)

    def fired(value: str) -> list[str]:
        view = chat()
        view.headers = [*view.headers, ("x-id", value)]
        return waf.evaluate(view, all_matches=True).rule_ids

    for _ in range(2):  # the second round answers from the remembered values
        assert fired("id-evil-42") == ["raw"]  # unchanged by every transform
        assert fired("%3Cx%3E") == ["decoded"]
        assert fired("SHOUT") == ["lowered"]
        assert fired("evil-7%3Cx%3E") == ["raw", "decoded"]
        assert fired("quiet-value") == []


def test_parts_a_request_may_lack_are_read_whenever_it_has_them(tmp_path):
    """A part read from one header, the cookies or the arguments is skipped for a request without them: a rule must
    still see it in the request that has it, whatever the case of the header name the rule gives."""
    rules = [
        {"id": "one-header", "when": {"target": "header:X-Upload-Name", "regex": "[.]php$"}},
        {"id": "one-cookie", "when": {"target": "cookie:session", "regex": "^admin$"}},
        {"id": "one-argument", "when": {"target": "arg:next", "regex": "^//"}},
        {"id": "argument-names", "when": {"target": "param_names", "regex": "^debug$"}},
    ]
    waf = load_policy_dir(write_policy(tmp_path, {"rules": rules})).waf_for(None)

    def fired(headers=(), query="", form: bytes | None = None) -> list[str]:
        view = chat(query=query)
        view.headers = [*view.headers, *headers]
        if form is not None:
            view.payload, view.body = None, form
            view.headers = [(k, v) for k, v in view.headers if k != "content-type"]
            view.headers.append(("content-type", "application/x-www-form-urlencoded"))
        return waf.evaluate(view, all_matches=True).rule_ids

    for _ in range(2):  # fresh and remembered
        assert fired() == []
        assert fired([("x-upload-name", "shell.php")]) == ["one-header"]
        assert fired([("cookie", "theme=dark; session=admin")]) == ["one-cookie"]
        assert fired(query="next=//evil.example") == ["one-argument"]
        assert fired(form=b"debug=1&next=//evil.example") == ["one-argument", "argument-names"]


def test_a_hit_among_values_some_of_which_are_new_names_its_own_value(tmp_path):
    """A non-regex leaf remembers each short value's outcome: when a request brings a new value next to ones seen
    before, the hit still names the value that matched, and its span, wherever it sits."""
    rules = [
        {"id": "agent", "when": {"target": "headers", "phrases": ["evilbot"]}},
        {"id": "huge", "when": {"target": ["header_names", "headers"], "length": {"gt": 300}}},
    ]
    waf = load_policy_dir(write_policy(tmp_path, {"rules": rules})).waf_for(None)

    def hits(*extra: tuple[str, str]) -> list[tuple[str, str, str]]:
        view = chat()
        view.headers = [*view.headers, *extra]
        return [(m.rule.id, m.hit.part, m.hit.matched) for m in waf.evaluate(view, all_matches=True).matches]

    assert hits(("x-request-id", "1"), ("x-note", "hello")) == []
    assert hits(("x-request-id", "2"), ("x-note", "an evilbot ran")) == [("agent", "header:x-note", "evilbot")]
    assert hits(("x-note", "an evilbot ran"), ("x-request-id", "3")) == [("agent", "header:x-note", "evilbot")]
    assert hits(("x-request-id", "4"), ("x-a", "evilbot"), ("x-note", "an evilbot ran")) == [
        ("agent", "header:x-a", "evilbot")
    ]
    assert hits(("x-request-id", "5"), ("x-big", "b" * 301)) == [("huge", "header:x-big", "b" * 64)]
    assert hits(("x-request-id", "6"), ("x-" + "n" * 300, "v")) == [("huge", "header_names", "x-" + "n" * 62)]


def test_a_reloaded_policy_remembers_nothing_of_the_old_one(tmp_path):
    """Transformed values are remembered by the compiled policy, not by the process: a reload compiles a new one,
    which starts empty and decides alike, and the old one's memories go with it."""
    rule = {"id": "lowered", "when": {"target": "headers", "transforms": ["lowercase"], "regex": "^shout$"}}
    directory = write_policy(tmp_path, {"rules": [rule]})

    def shouting() -> RequestView:
        view = chat()
        view.headers = [*view.headers, ("x-id", "SHOUT")]
        return view

    old = load_policy_dir(directory).waf_for(None)
    assert old.evaluate(shouting()).rule_ids == ["lowered"]
    assert old.transformed.for_chain(("lowercase",)).get("SHOUT") == "shout"
    new = load_policy_dir(directory).waf_for(None)
    assert new.transformed.for_chain(("lowercase",)) == {}
    assert new.evaluate(shouting()).rule_ids == ["lowered"]


def test_overlays_exclusions_and_disable(tmp_path):
    waf = {
        "paranoia_level": 1,
        "packs": ["sqli"],
        "rules": [RULE],
        "exclusions": [
            {"id": "legacy", "rules": ["no-foo"], "routes": ["completions"]},
            {"tags": ["attack-sqli"], "paths": ["/v1/sql-playground"]},
        ],
    }
    overlays = {
        "team-a": {"disable": ["no-foo"], "waf": {"paranoia_level": 2}},
        "team-b": {
            "waf": {
                "rules": [{**RULE, "when": {"target": "prompt", "regex": "baz"}}],
                "exclusions": [{"rules": ["sqli-1*"], "tenants": ["team-b"]}],
            }
        },
    }
    policies = load_policy_dir(write_policy(tmp_path, waf, overlays))
    base, a, b = (policies.waf_for(t) for t in (None, "team-a", "team-b"))
    assert policies.waf_for("someone-else") is base
    assert "sqli-184" not in base.rule_ids() and "sqli-184" in a.rule_ids()  # PL2 rules for team-a only
    assert "no-foo" not in a.rule_ids()
    assert base.evaluate(chat("foo")).blocked and not base.evaluate(chat("foo", route="completions")).blocked
    attack = "id=1%27%20or%20%271%27=%271"
    assert base.evaluate(chat(query=attack)).blocked
    assert not base.evaluate(chat(query=attack, path="/v1/sql-playground/run")).blocked
    assert b.evaluate(chat("baz")).blocked and not b.evaluate(chat("foo")).blocked  # replaced by id
    assert not b.evaluate(chat(query=attack, tenant="team-b")).blocked


def test_errors_name_file_line_and_rule_id(tmp_path):
    directory = tmp_path / "p"
    directory.mkdir()
    (directory / "base.yaml").write_text("""apiVersion: portcullis.dev/v1
kind: Policy
metadata: {name: base}
spec:
  waf:
    packs: [sqli, no-such-pack]
    rules:
      - id: fine
        when: {target: prompt, regex: ok}
      - id: bad-regex
        when:
          target: prompt
          regex: '(?<=lookbehind)x'
      - id: bad-target
        when: {target: bodyy, regex: x}
""")
    (directory / "pack.yaml").write_text("""apiVersion: portcullis.dev/v1
kind: RulePack
metadata: {name: mine}
rules:
  - id: two-ops
    when: {target: prompt, regex: a, phrases: [b]}
""")
    with pytest.raises(PolicyError) as err:
        load_policy_dir(directory)
    text = str(err.value)
    assert "base.yaml:13: spec.waf.rules[1].when.regex (rule id bad-regex)" in text and "RE2" in text
    assert "base.yaml:15: spec.waf.rules[2].when.target (rule id bad-target)" in text
    assert "pack.yaml:6: rules[0].when (rule id two-ops)" in text
    (directory / "base.yaml").write_text(
        "apiVersion: portcullis.dev/v1\nkind: Policy\nmetadata: {name: b}\nspec: {waf: {packs: [sqli, no-such-pack]}}\n"
    )
    (directory / "pack.yaml").unlink()
    with pytest.raises(PolicyError, match="names unknown rule pack 'no-such-pack'"):
        load_policy_dir(directory)


def test_custom_rule_pack_documents(tmp_path):
    pack = {
        "apiVersion": "portcullis.dev/v1",
        "kind": "RulePack",
        "metadata": {"name": "house"},
        "rules": [{"id": "house-1", "when": {"target": "prompt", "regex": "secret project"}}],
    }
    policies = load_policy_dir(write_policy(tmp_path, {"packs": ["house"]}, extra={"house.yaml": pack}))
    assert policies.waf_for(None).evaluate(chat("the secret project")).rule_ids == ["house-1"]


def test_catastrophic_pattern_loads_and_a_1mb_body_is_linear(tmp_path):
    """(a+)+$ backtracks exponentially in a backtracking engine; under RE2 it is linear in the input."""
    rules = [
        {"id": "redos", "when": {"target": ["prompt", "args", "headers"], "regex": "(a+)+$"}},
        {"id": "redos-2", "when": {"target": "prompt", "regex": "^(([a-z])+.)+[A-Z]([a-z])+$"}},
    ]
    waf = load_policy_dir(write_policy(tmp_path, {"packs": ["sqli", "xss", "llm"], "rules": rules})).waf_for(None)

    def timed(size: int) -> float:
        view = chat("a" * size + "!")
        started = time.perf_counter()
        verdict = waf.evaluate(view)
        elapsed = time.perf_counter() - started
        assert verdict.rule_ids == []
        return elapsed

    timed(1024)  # warm up the DFAs
    small, large = min(timed(256 * 1024) for _ in range(3)), min(timed(1000 * 1024) for _ in range(3))
    assert large < 1.0, f"1 MiB took {large:.3f}s"
    assert large < small * 4 * 2.5, f"not linear: 256 KiB {small * 1e3:.1f} ms, 1 MiB {large * 1e3:.1f} ms"
    assert waf.evaluate(chat("a" * 1000 * 1024)).rule_ids == ["redos"]


def test_redaction_rewrites_the_prompt(tmp_path):
    waf = load_policy_dir(write_policy(tmp_path, {"packs": ["llm"]})).waf_for(None)
    view = chat("keys: AKIAIOSFODNN7EXAMPLE and ghp_" + "x" * 36)
    verdict = waf.evaluate(view)
    assert not verdict.blocked and [m.rule.id for m in verdict.redactions] == ["llm-secret-110"]
    assert waf.redact(view, verdict, view.payload) == 2
    assert view.payload["messages"][0]["content"] == "keys: [REDACTED:secret] and [REDACTED:secret]"


def test_redaction_skips_empty_matches(tmp_path):
    rule = {"id": "digits", "action": "redact", "replacement": "#", "when": {"target": "prompt", "regex": "[0-9]*"}}
    policies = load_policy_dir(write_policy(tmp_path, {"rules": [rule]}))
    assert any("'digits'" in w and "matches any text" in w for w in policies.warnings)
    waf = policies.waf_for(None)
    view = chat("pin 1234 or 56")
    assert waf.redact(view, waf.evaluate(view), view.payload) == 2
    assert view.payload["messages"][0]["content"] == "pin # or #"


def test_no_builtin_pack_matches_every_ordinary_request(tmp_path):
    """Else every policy enabling the packs would be warned about, or at PL4 refused as a blanket block."""
    packs = ["protocol", "scanners", "protocol-attack", "sqli", "xss", "lfi", "rce", "llm"]
    assert load_policy_dir(write_policy(tmp_path, {"packs": packs, "paranoia_level": 4})).warnings == ()


def test_match_all_rules_warn_per_tenant_and_a_blanket_block_is_refused(tmp_path):
    everything = {"id": "everything", "severity": "notice", "when": {"target": "body", "length": {"ge": 0}}}
    policies = load_policy_dir(write_policy(tmp_path, {}, {"a": {"waf": {"rules": [everything]}}}))
    assert [w for w in policies.warnings if "matches every request" in w] == [
        "warning: tenant a: rule 'everything' (action score) matches every request: it fired on all 3 ordinary "
        "requests tried"
    ]
    with pytest.raises(PolicyError, match="tenant a: the WAF blocks every request"):
        load_policy_dir(write_policy(tmp_path, {}, {"a": {"waf": {"rules": [{**everything, "action": "block"}]}}}))


def test_version_covers_packs_and_files(tmp_path):
    first = load_policy_dir(write_policy(tmp_path, {"packs": ["sqli"]})).version
    assert load_policy_dir(write_policy(tmp_path, {"packs": ["sqli"]})).version == first
    assert load_policy_dir(write_policy(tmp_path, {"packs": ["xss"]})).version != first


def test_policy_check_reports_dead_and_shadowed_rules(tmp_path, capsys):
    rules = [RULE, {**RULE, "id": "copy"}, {**RULE, "id": "deep", "paranoia_level": 3}]
    directory = write_policy(tmp_path, {"packs": ["sqli"], "rules": rules, "exclusions": [{"rules": ["sqli-110"]}]})
    assert cli(["policy", "check", str(directory)]) == 0
    err = capsys.readouterr().err
    assert "shadowed: base: rule 'copy' has the same condition as 'no-foo'" in err
    assert "dead: base: rule 'deep' needs paranoia level 3" in err
    assert "dead: base: exclusion" in err


def test_policy_check_refuses_duplicate_ids_across_packs(tmp_path, capsys):
    pack = {
        "apiVersion": "portcullis.dev/v1",
        "kind": "RulePack",
        "metadata": {"name": "dup"},
        "rules": [{"id": "sqli-100", "when": {"target": "prompt", "regex": "x"}}],
    }
    directory = write_policy(tmp_path, {"packs": ["sqli", "dup"]}, extra={"dup.yaml": pack})
    assert cli(["policy", "check", str(directory)]) == 1
    assert "rule id 'sqli-100' is in 'sqli' and 'dup'" in capsys.readouterr().err


CASES = """
tests:
  - test_id: prompt-with-private-key
    stages:
      - input:
          prompt: "-----BEGIN RSA PRIVATE KEY-----"
        output: {verdict: block, expect_ids: [llm-secret-100]}
  - test_id: sqli-in-query
    stages:
      - input: {method: POST, uri: "/v1/chat/completions?id=1'%20or%20'1'='1", prompt: hi}
        output: {log: {expect_ids: [sqli-100]}}
  - test_id: benign
    stages:
      - input: {prompt: "How do I write a SQL join?"}
        output: {verdict: allow, log: {no_expect_ids: [sqli-100]}}
"""


def test_policy_test_runs_cases_and_fails_for_ci(tmp_path, capsys):
    directory = write_policy(tmp_path, {"packs": ["sqli", "llm"]})
    cases = tmp_path / "cases.yaml"
    cases.write_text(CASES)
    assert cli(["policy", "test", str(directory), "--cases", str(cases)]) == 0
    assert "3 passed, 0 failed" in capsys.readouterr().out
    cases.write_text(CASES.replace("verdict: allow", "verdict: block"))
    assert cli(["policy", "test", str(directory), "--cases", str(cases)]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_policy_explain_says_which_rules_fire_and_why(tmp_path, capsys):
    directory = write_policy(tmp_path, {"packs": ["sqli", "llm"]})
    assert (
        cli(
            [
                "policy",
                "explain",
                str(directory),
                "--uri",
                "/v1/chat/completions?q=1%27%20or%201=1--",
                "--prompt",
                "hi",
                "--format",
                "json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["verdict"] == "block" and out["blocking_rule"] == "sqli-100"
    first = out["rules"][0]
    assert first["part"] == "arg:q" and first["pack"] == "sqli" and first["points"] == 5


def test_shipped_example_policy_passes_the_shipped_cases(tmp_path, capsys):
    from tests.conftest import ROOT

    directory = tmp_path / "example"
    directory.mkdir()
    (directory / "base.yaml").write_text((ROOT / "policies" / "examples" / "waf.yaml").read_text())
    assert cli(["policy", "check", str(directory)]) == 0
    code = cli(["policy", "test", str(directory), "--cases", str(ROOT / "tests" / "waf_corpus" / "cases")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert " 0 failed" in out
