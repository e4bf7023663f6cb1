"""Request fixtures with expected verdicts, go-ftw style: the format of `portcullis policy test --cases`, and the
reader the corpus harness uses for the OWASP CRS regression tests.

A case file is YAML with `tests:`, each with `test_id` and `stages`; a stage has an `input` (method, uri, headers,
data — the raw request, as in go-ftw — plus our extensions: `json` for a JSON body, `prompt` for a chat request with
that user message, `tenant` and `key_label`) and an `output`:
  verdict: block | allow | monitor | log     (optional)
  log: {expect_ids: [...], no_expect_ids: [...]}   (go-ftw; `expect_ids`/`no_expect_ids` also accepted directly)
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gateway.apis.routes import BY_PATH
from gateway.waf.engine import CompiledWaf
from gateway.waf.parts import RequestView, from_raw_http
from gateway.waf.verdict import Verdict

DEFAULT_HEADERS = {"Host": "localhost", "User-Agent": "portcullis-policy-test", "Accept": "*/*"}


@dataclass
class Case:
    file: str
    test_id: str
    stage: int
    desc: str
    view: RequestView
    verdict: str | None = None
    expect_ids: list[str] = field(default_factory=list)
    no_expect_ids: list[str] = field(default_factory=list)
    given: dict[str, Any] = field(default_factory=dict)  # the stage's `input` as written

    @property
    def name(self) -> str:
        return f"{self.file}#{self.test_id}" + (f".{self.stage}" if self.stage else "")


def load_cases(path: Path) -> list[Case]:
    """Every stage of every test in a file (or every *.yaml/*.yml below a directory)."""
    files = sorted(p for p in path.rglob("*.y*ml")) if path.is_dir() else [path]
    out: list[Case] = []
    for file in files:
        data = yaml.safe_load(file.read_text()) or {}
        for test in data.get("tests") or []:
            for i, stage in enumerate(test.get("stages") or []):
                stage = stage.get("stage", stage)
                out.append(_case(str(file), test, i, stage))
    return out


def _case(file: str, test: dict[str, Any], index: int, stage: dict[str, Any]) -> Case:
    given = stage.get("input") or {}
    output = stage.get("output") or {}
    log = output.get("log") or {}
    return Case(
        file=file,
        test_id=str(test.get("test_id", "?")),
        stage=index,
        desc=str(test.get("desc", "")),
        view=request_of(given),
        verdict=output.get("verdict"),
        expect_ids=[str(i) for i in (log.get("expect_ids") or output.get("expect_ids") or [])],
        no_expect_ids=[str(i) for i in (log.get("no_expect_ids") or output.get("no_expect_ids") or [])],
        given=given,
    )


def request_of(given: dict[str, Any]) -> RequestView:
    if given.get("encoded_request"):
        return _parse_raw(base64.b64decode(given["encoded_request"]))
    headers = dict(DEFAULT_HEADERS) if "headers" not in given else {}
    headers.update({str(k): str(v) for k, v in (given.get("headers") or {}).items()})
    body: bytes = b""
    payload = None
    uri = str(given.get("uri", "/"))
    if "prompt" in given:
        payload = {
            "model": given.get("model", "test-model"),
            "messages": [{"role": "user", "content": str(given["prompt"])}],
        }
        uri = given.get("uri", "/v1/chat/completions")
    if "json" in given:
        payload = given["json"]
    if payload is not None:
        body = json.dumps(payload).encode()
        headers.setdefault("Content-Type", "application/json")
    elif given.get("data") is not None:
        data = given["data"]
        body = data.encode("utf-8", errors="surrogateescape") if isinstance(data, str) else bytes(data)
    known = {k: given[k] for k in ("tenant", "key_label", "client_ip") if k in given}
    view = from_raw_http(str(given.get("method", "POST" if body else "GET")), uri, list(headers.items()), body, **known)
    if payload is not None:
        view.payload = payload
        api = BY_PATH.get(view.path)
        view.route = api.name if api else ""
        if isinstance(payload, dict) and isinstance(payload.get("model"), str):
            view.model = payload["model"]
    return view


def _parse_raw(raw: bytes) -> RequestView:
    head, _, body = raw.replace(b"\r\n", b"\n").partition(b"\n\n")
    lines = head.decode("latin-1").split("\n")
    method, _, rest = lines[0].partition(" ")
    uri = rest.rpartition(" ")[0] or rest
    fields = [line.partition(":") for line in lines[1:] if ":" in line]
    headers = [(name.strip(), value.strip()) for name, _, value in fields]
    return from_raw_http(method or "GET", uri or "/", headers, body)


def check(case: Case, verdict: Verdict) -> list[str]:
    """What differs from the expectation; empty when the case passes."""
    problems = []
    fired = set(verdict.rule_ids)
    if case.verdict and verdict.action != case.verdict:
        problems.append(f"verdict {verdict.action}, expected {case.verdict}")
    for rule_id in case.expect_ids:
        if rule_id not in fired:
            problems.append(f"rule {rule_id} did not fire")
    for rule_id in case.no_expect_ids:
        if rule_id in fired:
            problems.append(f"rule {rule_id} fired")
    return problems


def run_cases(cases: list[Case], waf_for: Callable[[str | None], CompiledWaf]) -> list[tuple[Case, Verdict, list[str]]]:
    """waf_for(tenant) -> CompiledWaf; each case is decided with all matches collected."""
    results = []
    for case in cases:
        waf: CompiledWaf = waf_for(case.view.tenant)
        verdict = waf.evaluate(case.view, all_matches=True)
        results.append((case, verdict, check(case, verdict)))
    return results
