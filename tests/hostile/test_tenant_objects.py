"""Tenants attacking each other's upstream objects through a pool's one key: files, stored responses and the
conversations built on them, through a real gateway in front of tests/fake_providers.py (OpenAI's Files and stored
Responses, kept per key as OpenAI keeps them per organization), called with the official `openai` SDK.

Each tenant makes objects of its own and keeps to them, so the module's gateway and fake serve every test that reads
only its own tenants' objects; the fleet (two gateways on one Redis), anonymous access and start refusals take their
own. "Never reached the upstream" is read from the fake's record of what it received, by the gateway's request id.
"""

from __future__ import annotations

import base64
import hashlib
import json
import sys
import time
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import ROOT, Launcher, Process, RedisServer, pool
from tests.hostile.raw_http import connect, read_answer

GPT = "gpt-4.1-mini"
UPSTREAM_KEY = "sk-upstream-tenancy-5e1d"
KEYS = {tenant: f"sk-portcullis-{tenant}-0c4f" for tenant in ("ann", "bob", "cat", "dan", "eve", "fay", "gus", "hal")}
PASSTHROUGH = ["/v1/files*", "/v1/responses/*", "/v1/batches*", "/v1/containers*", "/v1/images/edits"]


def fake_provider(launcher: Launcher, *other_keys: str) -> Process:
    """The fake OpenAI, taking the pool's key and `other_keys`, each an organization with objects of its own."""

    def cmd(port: int) -> list[str]:
        keys = [arg for key in (UPSTREAM_KEY, *other_keys) for arg in ("--api-key", key)]
        return [sys.executable, str(ROOT / "tests" / "fake_providers.py"), "--port", str(port), *keys]

    return launcher.spawn(cmd, "fake-providers", ready_path="/_received")


def gateway_config(fake: Process, keys: bool = True, **extra: Any) -> dict[str, Any]:
    auth = {"keys": [{"tenant": t, "sha256": hashlib.sha256(k.encode()).hexdigest()} for t, k in KEYS.items()]}
    return {
        "pools": [pool("openai", fake.url, models=[GPT], api_key_env="TENANCY_UPSTREAM_KEY", passthrough=PASSTHROUGH)],
        **({"auth": auth} if keys else {}),
        **extra,
    }


def start_gateway(launcher: Launcher, fake: Process, keys: bool = True, **extra: Any) -> Process:
    return launcher.gateway(gateway_config(fake, keys, **extra), env={"TENANCY_UPSTREAM_KEY": UPSTREAM_KEY})


@pytest.fixture(scope="module")
def fake(module_launcher: Launcher) -> Process:
    return fake_provider(module_launcher)


@pytest.fixture(scope="module")
def gw(module_launcher: Launcher, fake: Process) -> Process:
    return start_gateway(module_launcher, fake)


def client(gw: Process, tenant: str | None) -> openai.OpenAI:
    key = KEYS[tenant] if tenant else "no-key-needed"
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=30)


def received(fake: Process, request_id: str) -> list[dict[str, Any]]:
    """What the fake received for one gateway request (the gateway sends its request id upstream)."""
    return [r for r in httpx.get(fake.url + "/_received").json() if r["headers"].get("x-request-id") == request_id]


def refused(call: Any, fake: Process, code: str) -> openai.NotFoundError:
    """`call()` answered with the gateway's own 404 (`code`), and nothing of it reached the upstream."""
    with pytest.raises(openai.NotFoundError) as caught:
        call()
    error = caught.value
    assert error.code == code, error.body
    assert received(fake, error.response.headers["x-request-id"]) == [], "a refused request reached the upstream"
    return error


def upload(gw: Process, tenant: str, text: str = "one line\n") -> str:
    return client(gw, tenant).files.create(file=("data.jsonl", text.encode()), purpose="batch").id


def upload_outside(fake: Process) -> str:
    """A file made at the upstream with its key, not through the gateway."""
    files = {"file": ("outside.jsonl", b"made elsewhere\n"), "purpose": (None, "batch")}
    answer = httpx.post(fake.url + "/v1/files", files=files, headers={"authorization": f"Bearer {UPSTREAM_KEY}"})
    assert answer.status_code == 200, answer.text
    return answer.json()["id"]


# ---- files ----------------------------------------------------------------------------------------------------------


def test_another_tenants_file_is_not_found_to_read_download_or_delete(gw, fake) -> None:
    file_id = upload(gw, "ann", "ann's secret rows\n")
    bob = client(gw, "bob")
    refused(lambda: bob.files.retrieve(file_id), fake, "file_not_found")
    refused(lambda: bob.files.content(file_id), fake, "file_not_found")
    refused(lambda: bob.files.delete(file_id), fake, "file_not_found")

    ann = client(gw, "ann")
    assert ann.files.retrieve(file_id).id == file_id
    assert ann.files.content(file_id).content == b"ann's secret rows\n", "bob's delete must not have gone upstream"
    assert ann.files.delete(file_id).deleted
    # the record went with the file: asking again is the gateway's 404, not a trip upstream
    refused(lambda: ann.files.retrieve(file_id), fake, "file_not_found")


def test_a_file_list_holds_only_the_tenants_own_and_pages_through_them(gw, fake) -> None:
    cats, dans = [], []
    for turn in "cddcddcdd":  # the other tenant's files between each of cat's
        (cats if turn == "c" else dans).append(upload(gw, "cat" if turn == "c" else "dan"))
    outside = upload_outside(fake)

    for limit in (1, 2, 100):
        listed = [f.id for f in client(gw, "cat").files.list(limit=limit)]  # the SDK pages with `after`
        assert listed == cats[::-1], f"limit {limit}"  # newest first, as the upstream orders them
    assert [f.id for f in client(gw, "dan").files.list()] == dans[::-1]

    first = client(gw, "cat").files.list(limit=2)
    assert [f.id for f in first.data] == cats[:0:-1] and first.has_more
    last = client(gw, "cat").files.list(limit=2, after=cats[1])
    assert [f.id for f in last.data] == [cats[0]] and not last.has_more
    assert outside not in [f.id for f in client(gw, "dan").files.list()]


def test_a_list_limit_of_other_digits_is_a_400(gw, fake) -> None:
    """`"²".isdigit()` holds but `int("²")` raises: such a limit is a bad value, never a 500."""
    for limit in ("²", "١٠", "0", "10001"):
        response = httpx.get(
            gw.url + "/v1/files", params={"limit": limit}, headers={"authorization": f"Bearer {KEYS['cat']}"}
        )
        assert response.status_code == 400 and response.json()["error"]["param"] == "limit", (limit, response.text)


def test_a_list_cursor_must_be_the_tenants_own(gw, fake) -> None:
    anns = upload(gw, "ann")
    refused(lambda: client(gw, "eve").files.list(after=anns), fake, "file_not_found")


def test_a_file_made_outside_the_gateway_is_hidden_from_every_tenant(gw, fake) -> None:
    outside = upload_outside(fake)
    for tenant in ("ann", "bob"):
        refused(lambda t=tenant: client(gw, t).files.retrieve(outside), fake, "file_not_found")
        assert outside not in [f.id for f in client(gw, tenant).files.list()]


def test_a_batch_may_not_read_another_tenants_file(gw, fake) -> None:
    file_id = upload(gw, "fay")
    error = refused(
        lambda: client(gw, "gus").batches.create(
            input_file_id=file_id, endpoint="/v1/responses", completion_window="24h"
        ),
        fake,
        "file_not_found",
    )
    assert error.body["param"] == "input_file_id"


def test_a_batchs_requests_may_not_name_another_tenants_objects(gw, fake) -> None:
    """The upstream makes each line of a batch's input file later, with the pool's key: a line continuing another
    tenant's stored response, or showing the model another tenant's file, would read it."""
    anns = client(gw, "ann").responses.create(model=GPT, input="ann's draft").id
    ann_file = upload(gw, "ann", "ann's appendix\n")
    cat = client(gw, "cat")
    cats = cat.responses.create(model=GPT, input="cat's draft").id

    def line(number: int, body: dict[str, Any]) -> str:
        return json.dumps({"custom_id": f"r{number}", "method": "POST", "url": "/v1/responses", "body": body}) + "\n"

    def batch(*bodies: dict[str, Any]) -> Any:
        text = "".join(line(n, {"model": GPT, "input": "go on", **b}) for n, b in enumerate(bodies))
        input_file = upload(gw, "cat", text)
        return cat.batches.with_raw_response.create(
            input_file_id=input_file, endpoint="/v1/responses", completion_window="24h"
        )

    def batches_sent(request_id: str) -> list[dict[str, Any]]:
        return [r for r in received(fake, request_id) if r["path"] == "/v1/batches"]

    for bodies, code, param in [
        (({"previous_response_id": cats}, {"previous_response_id": anns}), "previous_response_not_found", "line 2"),
        (
            ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": ann_file}]}]},),
            "file_not_found",
            "line 1",
        ),
    ]:
        with pytest.raises(openai.NotFoundError) as caught:
            batch(*bodies)
        assert caught.value.code == code and caught.value.body["param"].startswith(f"input_file_id {param}: body.")
        assert batches_sent(caught.value.response.headers["x-request-id"]) == [], "the batch reached the upstream"

    made = batch({"previous_response_id": cats})
    assert made.parse().status == "validating" and batches_sent(made.headers["x-request-id"])


def test_a_form_field_may_not_copy_another_tenants_file(gw, fake) -> None:
    """A container file is made from raw bytes or from a file id, and the SDK sends both as one multipart form:
    its `file_id` field is a reference like a JSON body's."""
    secret = upload(gw, "ann", "ann's payroll\n")
    bob = client(gw, "bob")
    container = bob.containers.create(name="bob's sandbox").id
    refused(
        lambda: bob.containers.files.create(container, file=("mine.txt", b"bob's own\n"), file_id=secret),
        fake,
        "file_not_found",
    )
    own = upload(gw, "bob", "bob's rows\n")
    copied = bob.containers.files.create(container, file=("mine.txt", b"bob's own\n"), file_id=own)
    assert bob.containers.files.content.retrieve(copied.id, container_id=container).read() == b"bob's rows\n"


@pytest.mark.parametrize(
    ("content_type", "part"),
    [
        (
            "multipart/form-data; boundary=XX",
            b'Content-Disposition: form-data; name="file_id"\r\nContent-Transfer-Encoding: base64\r\n\r\n%s',
        ),
        ("multipart/form-data; boundary=XX", b"Content-Disposition: form-data\r\n\r\n%s"),
        ("multipart/form-data; boundary=XX", b'Content-Disposition: form-data; name="file_id"; %s'),
        ("multipart/form-data", b'Content-Disposition: form-data; name="file_id"\r\n\r\n%s'),
    ],
    ids=["transfer-encoded", "no-name", "no-blank-line", "no-boundary"],
)
def test_a_form_the_gateway_cannot_read_is_refused(gw, fake, content_type, part) -> None:
    """A part another parser may read differently (decoding its bytes, naming it otherwise) could carry any id."""
    secret = upload(gw, "ann", "ann's form\n")
    container = client(gw, "bob").containers.create(name="bob's").id
    body = b"--XX\r\n" + part % base64.b64encode(secret.encode()) + b"\r\n--XX--\r\n"
    headers = {"authorization": f"Bearer {KEYS['bob']}", "content-type": content_type}
    answer = httpx.post(gw.url + f"/v1/containers/{container}/files", content=body, headers=headers)
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "invalid_multipart", answer.text
    assert received(fake, answer.headers["x-request-id"]) == []


def test_a_stateless_route_may_not_read_another_tenants_file(gw, fake) -> None:
    """An image edit makes nothing, but reads the images it names by file id with the pool's key."""
    secret = upload(gw, "cat", "cat's photo\n")
    answer = httpx.post(
        gw.url + "/v1/images/edits",
        json={"model": "gpt-image-1", "prompt": "add a hat", "images": [{"file_id": secret}]},
        headers={"authorization": f"Bearer {KEYS['dan']}"},
    )
    assert answer.status_code == 404 and answer.json()["error"]["code"] == "file_not_found", answer.text
    assert answer.json()["error"]["param"] == "images[0].file_id"
    assert received(fake, answer.headers["x-request-id"]) == []


def test_a_query_parameter_may_not_name_another_tenants_object(gw, fake) -> None:
    secret = upload(gw, "eve", "eve's notes\n")
    answer = httpx.post(
        gw.url + "/v1/images/edits",
        params={"file_id": secret},
        json={"model": "gpt-image-1", "prompt": "add a hat"},
        headers={"authorization": f"Bearer {KEYS['fay']}"},
    )
    assert answer.status_code == 404 and answer.json()["error"]["param"] == "file_id", answer.text
    assert received(fake, answer.headers["x-request-id"]) == []


@pytest.mark.parametrize(
    ("content_type", "body", "status"),
    [
        ("application/json", b'{"endpoint": "/v1/responses", "score": NaN, "input_file_id": "%s"}', 400),
        ("application/json", b'[{"input_file_id": "%s"}]', 400),
        ("text/plain", b'{"input_file_id": "%s"}', 415),
        ("", b'{"input_file_id": "%s"}', 415),
    ],
    ids=["json-only-some-decoders-read", "json-not-an-object", "json-as-text", "no-content-type"],
)
def test_a_body_the_gateway_cannot_read_for_references_is_refused(gw, fake, content_type, body, status) -> None:
    """An upstream may read a body the gateway did not: JSON its decoder refuses and others take (Python's reads
    NaN), JSON that is not an object, or JSON sent under another media type could name any tenant's file, so none of
    them goes upstream."""
    secret = upload(gw, "gus", "gus's ledger\n")
    headers = {"authorization": f"Bearer {KEYS['hal']}", "content-type": content_type}
    answer = httpx.post(gw.url + "/v1/batches", content=body % secret.encode(), headers=headers)
    assert answer.status_code == status, answer.text
    assert received(fake, answer.headers["x-request-id"]) == []


def test_json_under_a_media_type_in_capitals_is_read_for_references(gw, fake) -> None:
    """Media types are case-insensitive: `Application/JSON` is JSON to the upstream, so it is to the gateway."""
    secret = upload(gw, "gus", "gus's capitals\n")
    headers = {"authorization": f"Bearer {KEYS['hal']}", "content-type": "Application/JSON"}
    body = json.dumps({"input_file_id": secret, "endpoint": "/v1/responses", "completion_window": "24h"})
    answer = httpx.post(gw.url + "/v1/batches", content=body, headers=headers)
    assert answer.status_code == 404 and answer.json()["error"]["param"] == "input_file_id", answer.text
    assert received(fake, answer.headers["x-request-id"]) == []


def test_dot_segments_cannot_lead_a_passthrough_route_elsewhere(gw, fake) -> None:
    """`/v1/files/x/../../vector_stores` would reach /v1/vector_stores upstream (the client library resolves dot
    segments), a route this pool does not pass through, and lists every tenant's."""
    sock = connect(gw.url)
    sock.sendall(
        b"GET /v1/files/file-x/%2e%2e/%2e%2e/vector_stores HTTP/1.1\r\nhost: gw\r\n"
        b"authorization: Bearer " + KEYS["ann"].encode() + b"\r\nconnection: close\r\n\r\n"
    )
    answer = read_answer(sock)
    assert answer is not None and answer.status == 404, answer
    assert answer.error()["code"] == "not_found"
    assert received(fake, answer.headers["x-request-id"]) == []


# ---- stored responses -----------------------------------------------------------------------------------------------


def test_another_tenants_stored_response_is_not_found_to_read_continue_or_delete(gw, fake) -> None:
    ann, bob = client(gw, "ann"), client(gw, "bob")
    made = ann.responses.create(model=GPT, input="ann's plans for the merger")
    refused(lambda: bob.responses.retrieve(made.id), fake, "response_not_found")
    refused(
        lambda: bob.responses.create(model=GPT, input="go on", previous_response_id=made.id),
        fake,
        "previous_response_not_found",
    )
    refused(lambda: bob.responses.delete(made.id), fake, "response_not_found")

    assert ann.responses.retrieve(made.id).output_text == "ann's plans for the merger"
    continued = ann.responses.with_raw_response.create(model=GPT, input="go on", previous_response_id=made.id)
    assert continued.parse().previous_response_id == made.id
    [sent] = received(fake, continued.headers["x-request-id"])
    assert sent["body"]["previous_response_id"] == made.id
    ann.responses.delete(made.id)
    refused(lambda: ann.responses.retrieve(made.id), fake, "response_not_found")


def test_a_streamed_response_is_its_tenants_from_its_first_event(gw, fake) -> None:
    with client(gw, "cat").responses.create(model=GPT, input="streamed for cat", stream=True) as stream:
        first = next(iter(stream))
        assert first.type == "response.created"
        made = first.response.id
        # while the stream is still open: its id is cat's already, on any request
        assert client(gw, "cat").responses.retrieve(made).id == made
        refused(lambda: client(gw, "dan").responses.retrieve(made), fake, "response_not_found")
        for _ in stream:
            pass
    refused(
        lambda: client(gw, "dan").responses.create(model=GPT, input="x", previous_response_id=made),
        fake,
        "previous_response_not_found",
    )


def test_an_unknown_previous_response_is_refused_before_the_upstream(gw, fake) -> None:
    refused(
        lambda: client(gw, "eve").responses.create(model=GPT, input="x", previous_response_id="resp_madeup"),
        fake,
        "previous_response_not_found",
    )


def test_a_request_may_not_show_the_model_another_tenants_file(gw, fake) -> None:
    file_id = upload(gw, "hal", "hal's contract\n")

    def asking(tenant: str) -> Any:
        content = [{"type": "input_text", "text": "summarise"}, {"type": "input_file", "file_id": file_id}]
        return client(gw, tenant).responses.create(model=GPT, input=[{"role": "user", "content": content}])

    error = refused(lambda: asking("fay"), fake, "file_not_found")
    assert error.body["param"] == "input[0].content[1].file_id"
    assert asking("hal").output_text == "summarise"


def test_an_item_of_another_tenants_response_may_not_be_referenced(gw, fake) -> None:
    made = client(gw, "gus").responses.create(model=GPT, input="gus's item")
    item = made.output[0].id
    items = [{"type": "item_reference", "id": item}, {"role": "user", "content": "and?"}]
    refused(lambda: client(gw, "fay").responses.create(model=GPT, input=items), fake, "item_not_found")
    assert client(gw, "gus").responses.create(model=GPT, input=items).output_text == "and?"


# ---- a fleet, anonymous access, refusals at start ----------------------------------------------------------------


def test_two_instances_sharing_redis_agree_on_who_owns_what(launcher, redis_server: RedisServer) -> None:
    fake = fake_provider(launcher)
    shared = {"redis": {"url": redis_server.url}, "store": {"backend": "redis"}}
    one, two = start_gateway(launcher, fake, **shared), start_gateway(launcher, fake, **shared)
    file_id = upload(one, "ann")
    made = client(one, "ann").responses.create(model=GPT, input="on instance one")

    assert client(two, "ann").files.retrieve(file_id).id == file_id
    assert [f.id for f in client(two, "ann").files.list()] == [file_id]
    assert client(two, "ann").responses.create(model=GPT, input="on two", previous_response_id=made.id).id
    refused(lambda: client(two, "bob").files.retrieve(file_id), fake, "file_not_found")
    refused(lambda: client(two, "bob").responses.retrieve(made.id), fake, "response_not_found")
    assert client(two, "bob").files.list().data == []

    client(two, "ann").files.delete(file_id)
    refused(lambda: client(one, "ann").files.retrieve(file_id), fake, "file_not_found")


def test_records_expire_with_their_ttl(launcher) -> None:
    fake = fake_provider(launcher)
    gw = start_gateway(launcher, fake, tenant_objects={"ttl": 2})
    file_id = upload(gw, "ann")
    assert client(gw, "ann").files.retrieve(file_id).id == file_id
    deadline = time.monotonic() + 10
    while True:
        try:
            client(gw, "ann").files.retrieve(file_id)
        except openai.NotFoundError:
            break
        assert time.monotonic() < deadline, "the record outlived its ttl"
        time.sleep(0.1)


def test_unrecorded_objects_readable_is_warned_of_and_passes_only_a_plain_id(launcher) -> None:
    """`unrecorded: readable` lets any tenant read an object the gateway has no record of, another tenant's too once
    its record expires, so the start warns; an id with a space or a dot added has no record either, and an upstream
    that trims or cuts it would read another tenant's object."""
    fake = fake_provider(launcher)
    gw = start_gateway(launcher, fake, tenant_objects={"unrecorded": "readable"})
    outside = upload_outside(fake)
    assert client(gw, "bob").files.retrieve(outside).id == outside  # what the setting is for
    # an expired record makes its object unrecorded too: the start says so
    assert "tenant_objects.unrecorded: readable: every tenant may read" in gw.output()
    assert "another tenant's too once its record expires (tenant_objects.ttl: 7776000s)" in gw.output()
    anns = client(gw, "ann").responses.create(model=GPT, input="ann's, recorded").id
    for variant in (f" {anns}", f"{anns}\n", f"{anns}.", f"{anns}/"):
        refused(
            lambda v=variant: client(gw, "bob").responses.create(model=GPT, input="go on", previous_response_id=v),
            fake,
            "previous_response_not_found",
        )


def test_anonymous_access_serves_every_object_as_before(launcher) -> None:
    """No key anywhere: one tenant, and what the upstream holds is all its own, made through the gateway or not."""
    fake = fake_provider(launcher)
    gw = start_gateway(launcher, fake, keys=False)
    outside = upload_outside(fake)
    anyone = client(gw, None)
    assert anyone.files.retrieve(outside).id == outside
    assert outside in [f.id for f in anyone.files.list()]
    with pytest.raises(openai.BadRequestError) as caught:  # the upstream's own answer: no record is asked for
        anyone.responses.create(model=GPT, input="x", previous_response_id="resp_madeup")
    assert received(fake, caught.value.response.headers["x-request-id"])


@pytest.mark.parametrize(
    ("route", "told"),
    [
        ("/v1/*", "known under '/v1/': /v1/assistants*"),
        ("/v1/audio/*", "known under '/v1/audio/': /v1/audio/speech, /v1/audio/transcriptions"),
        ("/v1/chat/completions/*", "not known to be stateless"),
    ],
)
def test_a_pool_passing_an_unknown_route_through_is_refused_at_start(launcher, route, told) -> None:
    config = {"pools": [pool("openai", "http://127.0.0.1:9", passthrough=["/v1/files*", route])]}
    with pytest.raises(RuntimeError) as failed:
        launcher.gateway(config)
    message = str(failed.value)
    assert f"pools[0].passthrough: Value error, '{route}' reaches paths" in message
    assert told in message and "tenant_api_key_env" in message
    assert ".yaml" in message and "Traceback" not in message


def test_tenants_with_their_own_upstream_keys_keep_their_objects_at_the_provider(launcher) -> None:
    """`tenant_api_key_env`: a listed tenant's requests carry its own key on every route, so the provider keeps its
    objects apart, and the pool may pass through a route the gateway does not know; a tenant without a key of its
    own reaches that route not at all, and the others with the pool's key."""
    own = {"ann": "sk-upstream-ann-77d2", "bob": "sk-upstream-bob-19ea"}
    fake = fake_provider(launcher, *own.values())
    pools = [
        pool(
            "openai",
            fake.url,
            models=[GPT],
            api_key_env="TENANCY_UPSTREAM_KEY",
            tenant_api_key_env={"ann": "TENANCY_ANN_KEY", "bob": "TENANCY_BOB_KEY"},
            passthrough=["/v1/files*", "/v1/evals*"],
        )
    ]
    auth = {"keys": [{"tenant": t, "sha256": hashlib.sha256(k.encode()).hexdigest()} for t, k in KEYS.items()]}
    env = {"TENANCY_UPSTREAM_KEY": UPSTREAM_KEY, "TENANCY_ANN_KEY": own["ann"], "TENANCY_BOB_KEY": own["bob"]}
    gw = launcher.gateway({"pools": pools, "auth": auth}, env=env)

    def sent_key(request_id: str) -> str:
        [sent] = received(fake, request_id)
        return sent["headers"]["authorization"]

    evals = {
        tenant: httpx.get(gw.url + "/v1/evals", headers={"authorization": f"Bearer {KEYS[tenant]}"})
        for tenant in ("ann", "cat")
    }
    assert evals["ann"].status_code == 404 and "Invalid URL" in evals["ann"].json()["error"]["message"]
    assert sent_key(evals["ann"].headers["x-request-id"]) == f"Bearer {own['ann']}"
    assert evals["cat"].status_code == 404 and evals["cat"].json()["error"]["code"] == "not_found"
    assert received(fake, evals["cat"].headers["x-request-id"]) == [], "a tenant on the pool's key reached it"

    made = client(gw, "ann").responses.with_raw_response.create(model=GPT, input="ann's, at the provider")
    assert sent_key(made.headers["x-request-id"]) == f"Bearer {own['ann']}"
    cats = client(gw, "cat").responses.with_raw_response.create(model=GPT, input="cat's, on the pool's key")
    assert sent_key(cats.headers["x-request-id"]) == f"Bearer {UPSTREAM_KEY}"

    file_id = upload(gw, "ann")
    in_pool_org = httpx.get(fake.url + "/v1/files", headers={"authorization": f"Bearer {UPSTREAM_KEY}"}).json()
    assert file_id not in [f["id"] for f in in_pool_org["data"]], "ann's file is in the pool's organization"
    assert client(gw, "ann").files.retrieve(file_id).id == file_id
    refused(lambda: client(gw, "bob").files.retrieve(file_id), fake, "file_not_found")

    # its own key reaches the routes the pool passes through, no other: a path the upstream URL would read as another
    # route (dot segments, a '?' or '#' decoded from %3F or %23, a space) is a 404 and reaches nothing
    for target in ("/v1/files/../batches", "/v1/evals/%2e%2e/organization/users", "/v1/evals/a%3Fb", "/v1/evals/a%23b"):
        sock = connect(gw.url)
        sock.sendall(f"GET {target} HTTP/1.1\r\nhost: gw\r\nauthorization: Bearer {KEYS['ann']}\r\n\r\n".encode())
        answer = read_answer(sock)
        assert answer is not None and answer.status == 404, (target, answer)
        assert received(fake, answer.headers["x-request-id"]) == [], f"{target} reached the upstream"
