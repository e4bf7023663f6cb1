"""Tenants reaching each other's fine-tuned models through a pool's one key: a model one tenant makes through the
gateway (a fine-tuning job's `fine_tuned_model`, its checkpoints' models) is callable, listable and deletable by that
tenant alone, on every model route and every upstream attempt; a fine-tune the gateway has no record of is hidden
unless the operator names it.

Real parts: gateway processes in front of tests/fake_providers.py (OpenAI's fine-tuning jobs, which succeed and name
a model callable by their organization, kept per key as OpenAI keeps them per organization), called with the official
`openai` SDK; the pool routes any model (`models: []`). Every test runs once with the records in the SQLite store and
once in a real redis-server. "Never reached the upstream" is read from the fake's record of what it received, by the
gateway's request id.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.conftest import Launcher, Process, RedisServer, pool
from tests.hostile.test_tenant_objects import KEYS, UPSTREAM_KEY, client, fake_provider, received, upload

GPT = "gpt-4.1-mini"
PASSTHROUGH = ["/v1/files*", "/v1/fine_tuning/jobs*", "/v1/models/*", "/v1/batches*"]
AUTH = {"keys": [{"tenant": t, "sha256": hashlib.sha256(k.encode()).hexdigest()} for t, k in KEYS.items()]}


@pytest.fixture(scope="module", params=["sqlite", "redis"])
def store(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Where the records are kept: the config every gateway of the module shares."""
    if request.param == "sqlite":
        return {"store": {"sqlite_path": str(tmp_path_factory.mktemp("store") / "shared.db")}}
    server: RedisServer = request.getfixturevalue("module_redis_server")
    # a command's bound well above a loaded test machine's stalls: a store that did not answer is not the point here
    return {"redis": {"url": server.url, "timeout": 2.0}, "store": {"backend": "redis"}}


@pytest.fixture(scope="module")
def fake(module_launcher: Launcher, store: dict[str, Any]) -> Process:
    """One fake provider per store: each run of the module starts from an upstream that holds nothing."""
    return fake_provider(module_launcher)


def start(
    launcher: Launcher, fake: Process, store: dict[str, Any], served: list[str] | None = None, **extra: Any
) -> Process:
    """A gateway keeping its records in `store`, its one pool routing `served` (any model by default)."""
    config = {
        "pools": [
            pool("openai", fake.url, models=served or [], api_key_env="TENANCY_UPSTREAM_KEY", passthrough=PASSTHROUGH)
        ],
        "auth": AUTH,
        **store,
        **extra,
    }
    return launcher.gateway(config, env={"TENANCY_UPSTREAM_KEY": UPSTREAM_KEY})


@pytest.fixture(scope="module")
def gw(module_launcher: Launcher, fake: Process, store: dict[str, Any]) -> Process:
    return start(module_launcher, fake, store)


def fine_tune(gw: Process, tenant: str, suffix: str) -> str:
    """The model a fine-tuning job the tenant makes through the gateway names once it succeeded (the fake's jobs
    succeed by their first read)."""
    ft = client(gw, tenant).fine_tuning.jobs
    job = ft.create(model=GPT, training_file=upload(gw, tenant, '{"messages": []}\n'), suffix=suffix)
    assert job.fine_tuned_model is None and job.status == "validating_files"
    model = ft.retrieve(job.id).fine_tuned_model
    assert model is not None and model.startswith(f"ft:{GPT}:")
    return model


def outside_job(fake: Process, suffix: str, key: str = UPSTREAM_KEY) -> str:
    """A fine-tuning job made at the upstream with `key` (the pool's), not through the gateway: its id."""
    headers = {"authorization": f"Bearer {key}"}
    files = {"file": ("train.jsonl", b'{"messages": []}\n'), "purpose": (None, "fine-tune")}
    training = httpx.post(fake.url + "/v1/files", files=files, headers=headers).json()["id"]
    body = {"model": GPT, "training_file": training, "suffix": suffix}
    return httpx.post(fake.url + "/v1/fine_tuning/jobs", json=body, headers=headers).json()["id"]


def outside_fine_tune(fake: Process, suffix: str, key: str = UPSTREAM_KEY) -> str:
    """The model of a fine-tune made outside the gateway with `key`, read at the upstream."""
    job = outside_job(fake, suffix, key)
    answer = httpx.get(fake.url + f"/v1/fine_tuning/jobs/{job}", headers={"authorization": f"Bearer {key}"})
    return answer.json()["fine_tuned_model"]


def model_calls(gw: Process, tenant: str, model: str) -> dict[str, Callable[[], Any]]:
    """Each model route called with `model`, through the official SDK (raw: the answer's request id is read)."""
    sdk = client(gw, tenant)
    chat = [{"role": "user", "content": "hello"}]

    def streamed() -> Any:
        with sdk.chat.completions.with_streaming_response.create(model=model, messages=chat, stream=True) as answer:
            answer.read()
            return answer

    return {
        "chat": lambda: sdk.chat.completions.with_raw_response.create(model=model, messages=chat),
        "chat streamed": streamed,
        "responses": lambda: sdk.responses.with_raw_response.create(model=model, input="hello"),
        "embeddings": lambda: sdk.embeddings.with_raw_response.create(model=model, input="hello"),
    }


def hidden(call: Callable[[], Any], fake: Process, model: str) -> None:
    """`call()` answered with the gateway's 404 for `model`, in OpenAI's words, and nothing of it went upstream."""
    with pytest.raises(openai.NotFoundError) as caught:
        call()
    error = caught.value
    assert error.code == "model_not_found", error.body
    assert error.body["message"] == f"The model `{model}` does not exist or you do not have access to it."
    assert received(fake, error.response.headers["x-request-id"]) == [], "a refused request reached the upstream"


def served(call: Callable[[], Any], fake: Process, model: str) -> None:
    """`call()` was served, by the upstream, with `model`."""
    answer = call()
    assert answer.status_code == 200
    [sent] = received(fake, answer.headers["x-request-id"])
    assert sent["body"]["model"] == model


# ---- the model routes ----------------------------------------------------------------------------------------------


def test_a_fine_tune_is_callable_by_its_maker_alone_on_every_model_route(gw, fake) -> None:
    model = fine_tune(gw, "ann", "anns")
    for call in model_calls(gw, "bob", model).values():
        hidden(call, fake, model)
    for call in model_calls(gw, "ann", model).values():
        served(call, fake, model)


def test_a_messages_request_for_another_tenants_model_is_anthropics_404(gw, fake) -> None:
    """Anthropic's Messages, translated to chat for this OpenAI pool: the refusal is in Anthropic's shape."""
    model = fine_tune(gw, "ann", "anns-messages")

    def asking(tenant: str) -> Any:
        claude = anthropic.Anthropic(base_url=gw.url, api_key=KEYS[tenant], max_retries=0, timeout=30)
        return claude.messages.with_raw_response.create(
            model=model, max_tokens=16, messages=[{"role": "user", "content": "hello"}]
        )

    with pytest.raises(anthropic.NotFoundError) as caught:
        asking("bob")
    message = f"The model `{model}` does not exist or you do not have access to it."
    assert caught.value.body == {"type": "error", "error": {"type": "not_found_error", "message": message}}
    assert received(fake, caught.value.response.headers["x-request-id"]) == []
    served(lambda: asking("ann"), fake, model)


def test_a_model_named_by_a_job_list_or_its_checkpoints_is_its_makers(gw, fake) -> None:
    """The model is recorded from whichever answer names it first: here a page of jobs, and a page of checkpoints
    (each checkpoint is a model of its own)."""
    ft = client(gw, "cat").fine_tuning.jobs
    job = ft.create(model=GPT, training_file=upload(gw, "cat", '{"messages": []}\n'), suffix="cats")
    [listed] = [j for j in ft.list() if j.id == job.id]
    model = listed.fine_tuned_model
    assert model is not None
    [checkpoint] = [c.fine_tuned_model_checkpoint for c in ft.checkpoints.list(job.id)]
    for name in (model, checkpoint):
        hidden(model_calls(gw, "dan", name)["chat"], fake, name)
        served(model_calls(gw, "cat", name)["chat"], fake, name)


def test_a_job_may_not_build_on_another_tenants_model(gw, fake) -> None:
    model = fine_tune(gw, "eve", "eves")
    fays = client(gw, "fay").fine_tuning.jobs
    training = upload(gw, "fay", '{"messages": []}\n')
    with pytest.raises(openai.NotFoundError) as caught:
        fays.create(model=model, training_file=training)
    assert caught.value.code == "model_not_found" and caught.value.body["param"] == "model"
    assert received(fake, caught.value.response.headers["x-request-id"]) == []
    eves = client(gw, "eve").fine_tuning.jobs
    assert eves.create(model=model, training_file=upload(gw, "eve", '{"messages": []}\n')).model == model


def test_a_batch_may_not_call_another_tenants_model(gw, fake) -> None:
    """The upstream makes a batch's requests later with the pool's key: a line naming another tenant's model would
    call it."""
    model = fine_tune(gw, "gus", "guss")
    line = {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": {"model": model}}
    hal = client(gw, "hal")
    input_file = upload(gw, "hal", json.dumps(line) + "\n")
    with pytest.raises(openai.NotFoundError) as caught:
        hal.batches.create(input_file_id=input_file, endpoint="/v1/chat/completions", completion_window="24h")
    assert caught.value.code == "model_not_found"
    assert caught.value.body["param"] == "input_file_id line 1: body.model"
    batches = [r for r in received(fake, caught.value.response.headers["x-request-id"]) if r["path"] == "/v1/batches"]
    assert batches == [], "the batch reached the upstream"


def test_a_batch_or_a_job_may_not_call_a_model_the_key_is_not_allowed(gw, fake) -> None:
    """A key allowed one model: a batch line naming another, or a fine-tuning job on another, is refused as that
    request would be if sent itself (403 model_not_allowed), and nothing of it reaches the upstream; the allowed model
    still is."""
    made = gw.admin.post("/admin/keys", json={"tenant": "ivy", "models": [GPT]})
    assert made.status_code in (200, 201), made.text
    ivy = openai.OpenAI(base_url=gw.url + "/v1", api_key=made.json()["secret"], max_retries=0, timeout=30)
    line = {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "gpt-4o"}}
    lines = ivy.files.create(file=("data.jsonl", (json.dumps(line) + "\n").encode()), purpose="batch").id
    with pytest.raises(openai.PermissionDeniedError) as batch:
        ivy.batches.create(input_file_id=lines, endpoint="/v1/chat/completions", completion_window="24h")
    assert batch.value.code == "model_not_allowed"
    assert batch.value.body["param"] == "input_file_id line 1: body.model"
    assert not [r for r in received(fake, batch.value.response.headers["x-request-id"]) if r["path"] == "/v1/batches"]
    with pytest.raises(openai.PermissionDeniedError) as job:
        ivy.fine_tuning.jobs.create(model="gpt-4o", training_file=lines)
    assert job.value.code == "model_not_allowed"
    assert received(fake, job.value.response.headers["x-request-id"]) == []
    assert ivy.fine_tuning.jobs.create(model=GPT, training_file=lines).model == GPT


def test_a_model_named_by_anything_but_a_string_is_refused_on_passthrough_and_in_a_batch(gw, fake) -> None:
    """An upstream that took a list or an object for `model` would call a model no allow-list or ownership check
    saw: a job's or a batch line's model that is not a string is a 400, and nothing reaches the upstream."""
    training = upload(gw, "hal", '{"messages": []}\n')
    for named in (["gpt-4o"], {"id": "gpt-4o"}, 5):
        body = {"model": named, "training_file": training}
        job = httpx.post(f"{gw.url}/v1/fine_tuning/jobs", json=body, headers={"authorization": f"Bearer {KEYS['hal']}"})
        assert (job.status_code, job.json()["error"]["param"]) == (400, "model"), (named, job.text)
        assert received(fake, job.headers["x-request-id"]) == []
        line = {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": {"model": named}}
        lines = upload(gw, "hal", json.dumps(line) + "\n")
        with pytest.raises(openai.BadRequestError) as batch:
            client(gw, "hal").batches.create(
                input_file_id=lines, endpoint="/v1/chat/completions", completion_window="24h"
            )
        assert batch.value.body["param"] == "input_file_id line 1: body.model", named
        assert not [
            r for r in received(fake, batch.value.response.headers["x-request-id"]) if r["path"] == "/v1/batches"
        ]


# ---- the model list and a model's own routes -------------------------------------------------------------------


def test_the_model_list_shows_each_tenant_its_own_fine_tunes_only(gw, fake) -> None:
    anns = fine_tune(gw, "ann", "listed")
    outside = outside_fine_tune(fake, "outside")
    listed = {tenant: {m.id for m in client(gw, tenant).models.list()} for tenant in ("ann", "bob")}
    assert anns in listed["ann"] and GPT in listed["ann"]
    assert anns not in listed["bob"] and GPT in listed["bob"]
    assert outside not in listed["ann"] | listed["bob"]


def test_only_the_maker_may_read_or_delete_its_model(gw, fake) -> None:
    model = fine_tune(gw, "cat", "deleted")
    dan = client(gw, "dan")
    for call in (lambda: dan.models.retrieve(model), lambda: dan.models.delete(model)):
        hidden(call, fake, model)
    cat = client(gw, "cat")
    assert cat.models.retrieve(model).id == model
    assert cat.models.delete(model).deleted
    # the record went with the model: it is the gateway's 404 now, the maker's too, and no trip upstream
    hidden(model_calls(gw, "cat", model)["chat"], fake, model)


# ---- what the operator allows, fallbacks ---------------------------------------------------------------------------


def test_an_unrecorded_fine_tune_is_hidden_unless_the_pool_names_it(launcher, gw, fake, store) -> None:
    """Naming a fine-tune in the pool's `models:` lets every tenant call it where the gateway has no record of it; a
    recorded one stays its maker's."""
    outside = outside_fine_tune(fake, "unrecorded")
    for tenant in ("eve", "fay"):
        hidden(model_calls(gw, tenant, outside)["chat"], fake, outside)
    fays = fine_tune(gw, "fay", "named")
    named = start(launcher, fake, store, served=[GPT, outside, fays])
    served(model_calls(named, "eve", outside)["chat"], fake, outside)
    hidden(model_calls(named, "eve", fays)["chat"], fake, fays)
    served(model_calls(named, "fay", fays)["chat"], fake, fays)


def test_a_fallback_never_reaches_another_tenants_model(launcher, gw, fake, store) -> None:
    """A request too long for its own model falls back to a tenant's fine-tune, which has no window configured: the
    maker's request is served there, another tenant's is passed over it and gets its own model's refusal."""
    model = fine_tune(gw, "gus", "fallback")
    fallback = [{"model": GPT, "to": [{"model": model}], "on": ["context_length_exceeded"]}]
    falling = start(launcher, fake, store, models=[{"name": GPT, "context_window": 20}], fallbacks=fallback)
    long = " ".join(["word"] * 200)

    def asking(tenant: str) -> Any:
        return client(falling, tenant).chat.completions.with_raw_response.create(
            model=GPT, messages=[{"role": "user", "content": long}]
        )

    with pytest.raises(openai.BadRequestError) as caught:
        asking("hal")
    assert caught.value.code == "context_length_exceeded", caught.value.body
    assert received(fake, caught.value.response.headers["x-request-id"]) == []
    served(lambda: asking("gus"), fake, model)


def test_unrecorded_readable_lets_every_tenant_call_an_unrecorded_fine_tune_but_none_own_it(
    launcher, fake, store
) -> None:
    """`tenant_objects.unrecorded: readable`: every tenant may use what the gateway has no record of, and none may
    delete it; reading a job made outside the gateway does not make its model the reader's."""
    readable = start(launcher, fake, store, tenant_objects={"unrecorded": "readable"})
    job = outside_job(fake, "readable")
    model = client(readable, "eve").fine_tuning.jobs.retrieve(job).fine_tuned_model  # an unrecorded job: readable
    assert model is not None
    for tenant in ("eve", "fay"):
        served(model_calls(readable, tenant, model)["chat"], fake, model)
    hidden(lambda: client(readable, "eve").models.delete(model), fake, model)


def test_a_tenant_with_its_own_upstream_key_calls_its_own_unrecorded_fine_tunes(launcher, store) -> None:
    """`tenant_api_key_env`: the provider keeps that tenant's models apart, so a fine-tune it made at the provider
    is its to call through the gateway; a tenant on the pool's key still meets the gateway's 404 for it."""
    own_key = "sk-upstream-ann-models-3c1e"
    fake = fake_provider(launcher, own_key)
    config_pool = pool(
        "openai",
        fake.url,
        api_key_env="TENANCY_UPSTREAM_KEY",
        tenant_api_key_env={"ann": "TENANCY_ANN_KEY"},
        passthrough=PASSTHROUGH,
    )
    env = {"TENANCY_UPSTREAM_KEY": UPSTREAM_KEY, "TENANCY_ANN_KEY": own_key}
    gw = launcher.gateway({"pools": [config_pool], "auth": AUTH, **store}, env=env)
    model = outside_fine_tune(fake, "anns-own", key=own_key)
    served(model_calls(gw, "ann", model)["chat"], fake, model)
    hidden(model_calls(gw, "bob", model)["chat"], fake, model)


def test_a_message_batch_may_not_run_a_model_the_key_is_not_allowed(launcher: Launcher) -> None:
    """Anthropic's Message Batches hold their requests inline (`requests[].params`), which the upstream runs later
    with the pool's key: each one's model is held to the calling key's allow-list before anything goes upstream."""
    upstream = launcher.fake_upstream()
    gw = launcher.gateway(
        {"pools": [pool("claude", upstream.url, api="anthropic", passthrough=["/v1/messages/batches*"])]}
    )
    made = gw.admin.post("/admin/keys", json={"tenant": "kim", "models": ["claude-cheap"]})
    assert made.status_code in (200, 201), made.text
    headers = {"x-api-key": made.json()["secret"], "anthropic-version": "2023-06-01"}

    def batch(model: str) -> httpx.Response:
        params = {"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
        body = {
            "requests": [
                {"custom_id": "a", "params": {**params, "model": "claude-cheap"}},
                {"custom_id": "b", "params": params},
            ]
        }
        return httpx.post(gw.url + "/v1/messages/batches", json=body, headers=headers, timeout=30)

    def seen() -> int:
        return httpx.get(upstream.url + "/_stats").json()["passed_through"]

    before = seen()
    refused = batch("claude-premium")
    assert refused.status_code == 403, refused.text
    assert refused.json()["error"]["type"] == "permission_error"
    assert "requests[1].params.model" in refused.text
    assert seen() == before, "the batch reached the upstream"
    allowed = batch("claude-cheap")  # it goes on to the upstream, whatever that answers
    assert allowed.status_code == 201, allowed.text
    assert seen() == before + 1
