"""Which passthrough paths the gateway keeps apart by tenant, and which ids a request's JSON body or flat fields refer
to (gateway/tenancy/catalog.py, gateway/tenancy/references.py): in process, no gateway."""

from __future__ import annotations

import pytest

from gateway.config import LimitsConfig, PoolConfig
from gateway.edge.json_bounds import decode_encoded
from gateway.tenancy.catalog import MODEL, STATELESS, ObjectRoute, classify, is_object_id, named_ids, uncovered
from gateway.tenancy.models import records_models
from gateway.tenancy.references import Reference, field_references, may_refer, model_reference, references


@pytest.mark.parametrize(
    "path",
    [
        "/v1/files/file-a/..",  # dot segments: the upstream URL would resolve them to another route
        "/v1/files/%2e%2e/vector_stores",
        "/v1/files/file-a/content/",  # an empty segment
        "/v1/filesX",  # a stray extension a '/v1/files*' prefix admits
        "/v1/chat/completions/chatcmpl-1",  # stored chat completions: not listed, so unknown
        "/v1/models/..",  # a model's name is no dot segment
        "/v1/models/.hidden",
        "/v1/models/ft:a?b",  # nothing the upstream URL would read as its query
        "/v1/fine_tuning/checkpoints/ft:a:b/permissions",  # shares a model with other organizations
    ],
)
def test_a_path_outside_the_catalog_is_unknown(path: str) -> None:
    assert classify("openai", path) is None


def test_a_path_is_a_collection_an_object_or_an_action() -> None:
    files = classify("openai", "/v1/files")
    assert isinstance(files, ObjectRoute) and files.collection.kind == "file" and files.object_id is None
    content = classify("openai", "/v1/files/file-a/content")
    assert isinstance(content, ObjectRoute) and (content.object_id, content.rest) == ("file-a", ("content",))
    counted = classify("openai", "/v1/responses/input_tokens")
    assert isinstance(counted, ObjectRoute) and (counted.action, counted.object_id) == ("input_tokens", None)
    assert classify("openai", "/v1/audio/speech") == STATELESS
    batch = classify("anthropic", "/v1/messages/batches/msgbatch_1/results")
    assert isinstance(batch, ObjectRoute) and batch.collection.kind == "message_batch"


@pytest.mark.parametrize("pattern", ["/v1/files*", "/v1/files/*", "/v1/responses/*", "/v1/audio/speech"])
def test_known_patterns_may_be_passed_through(pattern: str) -> None:
    assert uncovered("openai", pattern) is None


@pytest.mark.parametrize("pattern", ["/v1/*", "/v1/audio/*", "/v1/chat/completions/*", "/v1/evals*"])
def test_patterns_reaching_unknown_paths_are_refused(pattern: str) -> None:
    why = uncovered("openai", pattern)
    assert why is not None and why.startswith(f"{pattern!r} reaches paths not known to be stateless")


def test_references_are_found_wherever_the_body_holds_them() -> None:
    body = {
        "previous_response_id": "resp_1",
        "metadata": {"file_id": "a label, not a reference"},
        "input": [
            {"type": "item_reference", "id": "msg_1"},
            {"role": "user", "content": [{"type": "input_file", "file_id": "file-1"}]},
        ],
        "tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}],
    }
    assert references(body) == [
        Reference("response", "resp_1", "previous_response_id"),
        Reference("item", "msg_1", "input[0].id"),
        Reference("file", "file-1", "input[1].content[0].file_id"),
        Reference("vector_store", "vs_1", "tools[0].vector_store_ids[0]"),
    ]


def test_a_tool_calls_own_arguments_are_no_reference() -> None:
    """A Messages tool call's `input` is what the model passed the client's tool, not an upstream object."""
    body = {
        "messages": [
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "t1", "name": "open", "input": {"file_id": "r7"}}],
            },
            {"role": "user", "content": [{"type": "document", "source": {"type": "file", "file_id": "file-9"}}]},
        ]
    }
    assert references(body) == [Reference("file", "file-9", "messages[1].content[0].source.file_id")]


def test_a_body_naming_no_reference_is_not_walked() -> None:
    assert not may_refer(b'{"model": "m", "input": "hello"}')
    assert may_refer(b'{"previous_response_id": "resp_1"}')
    assert may_refer(b'{"\\u0066ile_id": "file-1"}')  # an escape could spell a name


@pytest.mark.parametrize(
    ("body", "refers"),
    [
        (b'{"model": "m", "input": [{"type": "input_file", "\\u0066ile_id": "file-1"}]}', True),
        (b'{"model": "m", "conversation" : {"id": "conv_1"}}', True),  # a space before the colon
        (b'{"model": "m", "input": [{"type": "item\\u005freference", "id": "msg_1"}]}', True),  # a name as a value
        (b'{"model": "m", "input": "caf\\u00e9, the file"}', False),  # an escape alone
    ],
)
def test_the_payload_encoded_again_finds_every_reference_however_the_body_spells_it(body: bytes, refers: bool) -> None:
    payload, encoded = decode_encoded(body, LimitsConfig())
    assert may_refer(body, encoded) is refers
    assert bool(references(payload)) is refers


def test_a_flat_fields_reference_is_found_by_the_member_it_stands_for() -> None:
    """Client libraries flatten a nested body into form fields and queries by these conventions."""
    fields = [
        ("file_id", "file-a"),
        ("file_ids[]", "file-b"),
        ("images[0][file_id]", "file-c"),
        ("conversation[id]", "conv-d"),
        ("container.file_ids.0", "file-e"),
        ("metadata[file_id]", "the client's own label"),
        ("purpose", "batch"),
        ("id", "file-f"),
    ]
    assert field_references(fields) == [
        Reference("file", "file-a", "file_id"),
        Reference("file", "file-b", "file_ids[]"),
        Reference("file", "file-c", "images[0][file_id]"),
        Reference("conversation", "conv-d", "conversation[id]"),
        Reference("file", "file-e", "container.file_ids.0"),
    ]


def test_a_fine_tunes_name_is_a_model_id_and_no_other_kinds() -> None:
    """A model is named by the request model rule (colons and all), every other object by the path segment rule."""
    name = "ft:gpt-4o-mini-2024-07-18:org:suffix:AbC123"
    assert is_object_id(name, MODEL) and not is_object_id(name, "file")
    assert not is_object_id("ft:a b", MODEL) and not is_object_id("x" * 257, MODEL)
    one = classify("openai", f"/v1/models/{name}")
    assert isinstance(one, ObjectRoute) and (one.collection.kind, one.object_id) == (MODEL, name)


def test_a_fine_tuning_jobs_answers_name_its_models() -> None:
    jobs = classify("openai", "/v1/fine_tuning/jobs")
    assert isinstance(jobs, ObjectRoute)
    job = {"id": "ftjob-1", "fine_tuned_model": "ft:gpt-4o-mini:org:s:1", "result_files": ["file-r"]}
    assert sorted(named_ids(job, jobs.collection.names)) == [("file-r", "file"), ("ft:gpt-4o-mini:org:s:1", MODEL)]
    checkpoint = {"id": "ftckpt_1", "fine_tuned_model_checkpoint": "ft:gpt-4o-mini:org:s:1:ckpt-step-8"}
    assert named_ids(checkpoint, jobs.collection.sub_lists["checkpoints"]) == [
        ("ft:gpt-4o-mini:org:s:1:ckpt-step-8", MODEL)
    ]


def test_the_model_a_body_or_form_names_at_its_top_level_is_a_model_reference() -> None:
    assert model_reference({"model": "ft:m:o:s:1", "tools": [{"model": "gpt-image-1"}]}) == [
        Reference(MODEL, "ft:m:o:s:1", "model")
    ]
    assert model_reference({"model": "ft:m:o:s:1"}, "body") == [Reference(MODEL, "ft:m:o:s:1", "body.model")]
    assert model_reference(["not", "an", "object"]) == []
    assert field_references([("model", "ft:m:o:s:1"), ("images[0][model]", "x")]) == [
        Reference(MODEL, "ft:m:o:s:1", "model")
    ]


@pytest.mark.parametrize(
    ("passthrough", "recorded"),
    [
        (["/v1/fine_tuning/jobs*"], True),
        (["/v1/fine_tuning/jobs/*"], True),  # a job's read names its model
        (["/v1/files*", "/v1/models/*"], False),
    ],
)
def test_models_are_looked_up_only_where_a_pool_can_record_them(passthrough: list[str], recorded: bool) -> None:
    pool = PoolConfig(name="p", replicas=[{"url": "http://p:1"}], api="openai", passthrough=passthrough)
    assert records_models([pool]) is recorded
