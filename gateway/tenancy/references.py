"""The upstream objects a request body refers to by id: a Responses request's `previous_response_id` (continuing a
stored response), a file part's `file_id`, a batch's `input_file_id`, a run's `assistant_id`... Each is read, or
built on, upstream with the pool's one key, so each must be the requester's own (gateway/tenancy/ownership.py).

Found by member name anywhere in the JSON body (a reviewed list, the same in every request shape), not by each
shape's layout: a file part nested where a later API version puts it is still found. Left out: `metadata` (the
client's own labels), `annotations` (an answer's citations, sent back with its message, which the upstream does
not read as a reference) and a Messages tool call's `input` (the arguments the model gave the client's own tool,
which may name anything: `{"file_id": "report-7"}`). An item reference (`{"type": "item_reference", "id": ...}`)
names an item of a stored response.

A body's top-level `model` (a fine-tuning job's base model, an assistant's, a batch line's) names the model the
upstream serves it with: a reference of kind "model", held to gateway/tenancy/models.py's rule (a model no one made is
anyone's to call), not to an object's record. Only the top level: `model` members elsewhere (a tool's) name no model
a tenant makes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

from gateway.errors import invalid_request
from gateway.tenancy.catalog import MODEL

# a member's name → the kind of object its value (an id, or a list of ids) names
REFERENCES: dict[str, str] = {
    "previous_response_id": "response",
    "conversation": "conversation",  # an id, or {"id": ...}
    "file_id": "file",
    "file_ids": "file",
    "input_file_id": "file",
    "training_file": "file",
    "validation_file": "file",
    "vector_store_id": "vector_store",
    "vector_store_ids": "vector_store",
    "assistant_id": "assistant",
    "thread_id": "thread",
    "container": "container",  # a code interpreter's container: an id, or {"type": "auto", ...}
}
ITEM_REFERENCE = "item_reference"
_SKIPPED = frozenset({"metadata", "annotations"})
_FIELD_MEMBERS = re.compile(r"[^\[\].]+")  # a flat field name's members: `a[b][0]`, `a.b.0`
_TOOL_CALLS = frozenset({"tool_use", "server_tool_use", "mcp_tool_use"})  # content blocks whose `input` is left out


# A body holds a reference only if one of the names is in its bytes, quoted (or an escape, which could spell a name):
# most model requests are not walked at all. One search for all the names (a search per name cost three times as
# long); a match starts at a quote, and a quote whose next byte is no name's first is passed over at once, which halves
# the search (a name's first letter before another's rest matches too: the walk then decides). The escape apart, since
# a pattern with two first characters is tried at every byte of the body, not only at its quotes (twice the
# instructions). The payload encoded again spells every name as it decoded, whatever escapes the body used, so there
# the one search decides.
_NAMES = [name.encode() for name in (*REFERENCES, ITEM_REFERENCE)]
_NEEDLES = re.compile(
    b'"[' + bytes(sorted({name[0] for name in _NAMES})) + b"](?:" + b"|".join(re.escape(n[1:]) for n in _NAMES) + b')"'
)


class Reference(NamedTuple):
    kind: str
    object_id: str
    param: str  # where in the body, for the error: "previous_response_id", "input[0].content[2].file_id"


def may_refer(body: bytes, encoded: bytes | None = None) -> bool:
    """Whether a body could hold a reference: false for most model requests, which then need no walk. `encoded`: its
    payload encoded again, where the parse stage made it (gateway/edge/json_bounds.py), which one search decides."""
    if encoded is not None:
        return _NEEDLES.search(encoded) is not None
    return _NEEDLES.search(body) is not None or b"\\u" in body


def references(payload: Any) -> list[Reference]:
    """Every reference in a decoded JSON body (bounded by the parse limits), in document order."""
    return list(_walk(payload, ""))


def model_reference(payload: Any, at: str = "") -> list[Reference]:
    """The model a decoded JSON body names at its top level, if it names one (`at`: where the body is). A model
    named by anything but a string is refused: an upstream that took it would call a model no allow-list saw."""
    model = payload.get(MODEL) if isinstance(payload, dict) else None
    if model is None:
        return []
    if not isinstance(model, str):
        raise invalid_request(f"'{_join(at, MODEL)}' must be a model's name, a string", param=_join(at, MODEL))
    return [Reference(MODEL, model, _join(at, MODEL))]


def _walk(node: Any, at: str) -> Iterator[Reference]:
    if isinstance(node, list):
        for i, item in enumerate(node):
            yield from _walk(item, f"{at}[{i}]")
    elif isinstance(node, dict):
        if node.get("type") == ITEM_REFERENCE and isinstance(node.get("id"), str):
            yield Reference("item", node["id"], _join(at, "id"))
        node_type = node.get("type")
        tool_call = isinstance(node_type, str) and node_type in _TOOL_CALLS
        for key, value in node.items():
            where = _join(at, key)
            kind = REFERENCES.get(key)
            if kind is not None:
                yield from _ids(kind, value, where)
            elif key not in _SKIPPED and not (tool_call and key == "input"):
                yield from _walk(value, where)


def _ids(kind: str, value: Any, where: str) -> Iterator[Reference]:
    if isinstance(value, str):
        yield Reference(kind, value, where)
    elif isinstance(value, list):
        yield from (Reference(kind, v, f"{where}[{i}]") for i, v in enumerate(value) if isinstance(v, str))
    elif isinstance(value, dict):
        if isinstance(value.get("id"), str):  # {"id": ...}: a conversation named as an object
            yield Reference(kind, value["id"], _join(where, "id"))
        else:  # {"type": "auto", "file_ids": [...]}: a container made on the spot, with files of its own
            yield from _walk(value, where)


def _join(at: str, key: str) -> str:
    return f"{at}.{key}" if at else key


def field_references(fields: Iterable[tuple[str, str]]) -> list[Reference]:
    """The references among a form's or a query's fields, each named as a client library names a member of a
    nested body in a flat form (`file_id`, `file_ids[]`, `images[0][file_id]`, `conversation[id]`)."""
    found = []
    for name, value in fields:
        kind = field_kind(name)
        if kind is not None:
            found.append(Reference(kind, value, name))
    return found


def field_kind(name: str) -> str | None:
    """The kind of object a flat field names, or None: not a reference."""
    members = [m for m in _FIELD_MEMBERS.findall(name) if not m.isdigit()]
    if not members or _SKIPPED.intersection(members):
        return None
    if members == [MODEL]:  # the form's own model, at its top level
        return MODEL
    if members[-1] == "id" and len(members) > 1:  # `conversation[id]`: an object named by its id
        return REFERENCES.get(members[-2])
    return REFERENCES.get(members[-1])
