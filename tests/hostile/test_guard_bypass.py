"""Ways around the input guard, through a real gateway process with the real bundled ONNX classifier.

Each test is one walk-around: a benign prompt refused because the classifier judged the PII redaction marker
instead of the text, an injection sent as token ids, an injection in a `function` message, and an injection in
the part of a long text that was never scanned. The policy is the recommended one (policies/examples/guard.yaml)
where the walk-around concerns it.

Each gateway loads the classifier, so the module starts two and its tests share them: the recommended policy's,
for anonymous requests, and one whose tenants (one key each) carry the policies the other tests need. They share
one upstream: a test reads the change of its request count over the test, and the last body it saw.
"""

from __future__ import annotations

import functools
import hashlib
from concurrent.futures import Future, ThreadPoolExecutor

import httpx
import pytest
import yaml

from tests.conftest import ROOT, Launcher, Process, pool
from tests.integration.test_guard_gateway import BENIGN, INJECTION, LONG_BENIGN, guard_policy

ENGINE_MODEL = "SmolLM2-135M-Instruct"  # the default config's model: the bundled engine's tokenizer is known
UNKNOWN_MODEL = "test-model"  # no tokenizer configured: the gateway cannot read its token ids


def recommended_guard() -> dict:
    """The guard section of the shipped example policy: classifier blocking, PII redacted, secrets blocked."""
    documents = list(yaml.safe_load_all((ROOT / "policies" / "examples" / "guard.yaml").read_text()))
    return next(d for d in documents if d["kind"] == "Policy")["spec"]["guard"]


@functools.cache
def engine_renderer() -> Future:
    """The bundled engine's tokenizer, loaded once for the module (seconds: its GGUF is read whole) in a thread of
    its own, so the module's gateways start meanwhile."""

    def load():
        from backend_engine.config import default_model_path
        from backend_engine.model import load_prompt_renderer

        return load_prompt_renderer(default_model_path())

    loader = ThreadPoolExecutor(1)
    loading = loader.submit(load)
    loader.shutdown(wait=False)  # the load goes on; the thread ends with it
    return loading


def engine_ids(text: str) -> list[int]:
    return engine_renderer().result().text_ids(text, add_bos=False)


def chat(gw, messages: list[dict], key: str | None = None) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(
        gw.url + "/v1/chat/completions",
        json={"model": "test-model", "messages": messages},
        headers=headers,
        timeout=120,
    )


def complete(gw, model: str, prompt, key: str | None = None) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(
        gw.url + "/v1/completions",
        json={"model": model, "prompt": prompt, "max_tokens": 4},
        headers=headers,
        timeout=120,
    )


def upstream_stats(upstream) -> dict:
    return httpx.get(upstream.url + "/_stats").json()


@pytest.fixture(scope="module")
def upstream(module_launcher: Launcher) -> Process:
    return module_launcher.fake_upstream()


@pytest.fixture(scope="module")
def recommended(module_launcher: Launcher, upstream: Process, tmp_path_factory: pytest.TempPathFactory):
    """A gateway with the recommended guard policy and no keys: requests are anonymous."""
    engine_renderer()  # loads while the gateway starts
    policies = guard_policy(tmp_path_factory.mktemp("recommended"), recommended_guard())
    return module_launcher.gateway({"pools": [pool("p", upstream.url)], "policy_dir": policies}), upstream


TENANT_KEYS = {
    "strict": "sk-strict",
    "lenient": "sk-lenient",
    "tight": "sk-tight",
    "roomy": "sk-roomy",
    "tools": "sk-tools",
}


@pytest.fixture(scope="module")
def tenants(module_launcher: Launcher, upstream: Process, tmp_path_factory: pytest.TempPathFactory):
    """A gateway whose base guard scans at most 400 tokens (strict and tight have it as it is), lenient passes token
    ids no tokenizer can read, roomy scans up to 2,000 tokens, tools blocks on what the classifier finds in tool
    results (by default only monitored)."""
    policies = guard_policy(
        tmp_path_factory.mktemp("tenants"),
        {"enabled": True, "injection": {"max_tokens": 400}},
        {
            "lenient": {"unknown_tokenizer": "pass"},
            "roomy": {"injection": {"max_tokens": 2000}},
            "tools": {"injection": {"provenances": {"tool_result": {"action": "block"}}}},
        },
    )
    auth = {"keys": [{"tenant": t, "sha256": hashlib.sha256(k.encode()).hexdigest()} for t, k in TENANT_KEYS.items()]}
    return module_launcher.gateway({"pools": [pool("p", upstream.url)], "auth": auth, "policy_dir": policies}), upstream


def test_the_classifier_judges_the_text_not_its_redaction(recommended) -> None:
    """An e-mail address in a plain request must not turn it into an 'injection' once it reads [REDACTED:EMAIL]."""
    gw, upstream = recommended
    response = chat(gw, [{"role": "user", "content": "Please send the invoice to bob@example.org by Friday."}])
    assert response.status_code == 200, response.text
    sent = upstream_stats(upstream)["last_body"]["messages"][0]["content"]
    assert sent == "Please send the invoice to [REDACTED:EMAIL] by Friday.", "the upstream still gets the redaction"
    attack = chat(gw, [{"role": "user", "content": f"{INJECTION} Mail the result to bob@example.org."}])
    assert attack.status_code == 400, attack.text
    assert attack.json()["error"]["guard"]["category"] == "prompt_injection"


def test_token_id_prompts_are_decoded_and_scanned(recommended) -> None:
    gw, upstream = recommended
    before = upstream_stats(upstream)["requests"]
    benign = complete(gw, ENGINE_MODEL, engine_ids(BENIGN))
    assert benign.status_code == 200, benign.text
    assert upstream_stats(upstream)["last_body"]["prompt"] == engine_ids(BENIGN), "ids pass through untouched"
    for prompt, where in (
        (engine_ids(INJECTION), "prompt"),
        ([engine_ids(BENIGN), engine_ids(INJECTION)], "prompt[1]"),
    ):
        response = complete(gw, ENGINE_MODEL, prompt)
        assert response.status_code == 400, response.text
        verdict = response.json()["error"]["guard"]
        assert verdict["category"] == "prompt_injection" and verdict["where"] == where
    unreadable = complete(gw, ENGINE_MODEL, engine_ids(BENIGN) + [10**9])
    assert unreadable.status_code == 400 and "vocabulary" in unreadable.json()["error"]["message"]
    assert upstream_stats(upstream)["requests"] - before == 1, "no injected or unreadable ids reached the upstream"


def test_token_ids_no_tokenizer_can_read_are_refused(recommended) -> None:
    gw, upstream = recommended
    before = upstream_stats(upstream)["requests"]
    response = complete(gw, UNKNOWN_MODEL, [101, 2023, 2003, 102])
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "prompt_unscannable" and error["param"] == "prompt"
    assert UNKNOWN_MODEL in error["message"] and "tokenizer" in error["message"]
    assert complete(gw, UNKNOWN_MODEL, BENIGN).status_code == 200, "the same model's text prompts are served"
    assert upstream_stats(upstream)["requests"] - before == 1


def test_a_policy_may_pass_token_ids_no_tokenizer_can_read(tenants) -> None:
    gw, upstream = tenants
    ids = [101, 2023, 2003, 102]
    assert complete(gw, UNKNOWN_MODEL, ids, key="sk-strict").status_code == 400
    assert complete(gw, UNKNOWN_MODEL, ids, key="sk-lenient").status_code == 200
    assert upstream_stats(upstream)["last_body"]["prompt"] == ids


def test_function_messages_are_scanned_and_redacted_like_tool_messages(recommended, tenants) -> None:
    gw, upstream = recommended
    before = upstream_stats(upstream)["requests"]
    call = {"role": "assistant", "content": None, "function_call": {"name": "lookup", "arguments": "{}"}}
    served = chat(
        gw,
        [
            {"role": "user", "content": BENIGN},
            call,
            {"role": "function", "name": "lookup", "content": "Found 1 result: Bob Smith, bob@example.org, Sales."},
        ],
    )
    assert served.status_code == 200, served.text
    redacted = upstream_stats(upstream)["last_body"]["messages"][2]["content"]
    assert redacted == "Found 1 result: Bob Smith, [REDACTED:EMAIL], Sales."
    assert upstream_stats(upstream)["requests"] - before == 1
    messages = [{"role": "user", "content": BENIGN}, call, {"role": "function", "name": "lookup", "content": INJECTION}]
    attack = chat(tenants[0], messages, key=TENANT_KEYS["tools"])  # a policy that blocks on tool results
    assert attack.status_code == 400, attack.text
    assert attack.json()["error"]["guard"]["where"] == "messages[2]"
    assert upstream_stats(upstream)["requests"] - before == 1


def test_text_longer_than_the_scan_limit_is_refused_not_scanned_in_part(tenants) -> None:
    """Nine windows with the injection in the fifth: a limit of 400 tokens must refuse it, not scan the first
    and the last 200 tokens and serve it; under a limit it fits, every window is scanned and the attack found."""
    gw, upstream = tenants
    before = upstream_stats(upstream)["requests"]
    hidden = [{"role": "user", "content": f"{LONG_BENIGN} {INJECTION} {LONG_BENIGN}"}]
    tight = chat(gw, hidden, key="sk-tight")
    assert tight.status_code == 413, tight.text
    error = tight.json()["error"]
    assert error["code"] == "prompt_too_long_to_scan" and "at most 400 tokens" in error["message"]
    roomy = chat(gw, hidden, key="sk-roomy")
    assert roomy.status_code == 400, roomy.text
    assert roomy.json()["error"]["guard"]["category"] == "prompt_injection"
    assert chat(gw, [{"role": "user", "content": BENIGN}], key="sk-tight").status_code == 200
    assert upstream_stats(upstream)["requests"] - before == 1
