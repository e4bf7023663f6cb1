"""Which passthrough paths the gateway keeps apart by tenant, and which ids a request's JSON body or flat fields refer
to (gateway/tenancy/catalog.py, gateway/tenancy/references.py): in process, no gateway."""

from __future__ import annotations

import pytest

from gateway.tenancy.catalog import STATELESS, ObjectRoute, classify, uncovered
from gateway.tenancy.references import Reference, field_references, may_refer, references


@pytest.mark.parametrize(
    "path",
    [
        "/v1/files/file-a/..",  # dot segments: the upstream URL would resolve them to another route
        "/v1/files/%2e%2e/vector_stores",
        "/v1/files/file-a/content/",  # an empty segment
        "/v1/filesX",  # a stray extension a '/v1/files*' prefix admits
        "/v1/chat/completions/chatcmpl-1",  # stored chat completions: not listed, so unknown
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
