"""The references a passthrough request carries, wherever an upstream reads one: its query's parameters, and its
body as a JSON object or as form fields (a container file made from a `file_id`, which the SDK sends as a multipart
field beside the file's bytes).

A body the gateway cannot read is refused before it goes anywhere, since the upstream may read what the gateway did
not and find another tenant's id there: JSON that the gateway's decoder refuses but others take (Python's reads
`NaN`), JSON that is not an object, JSON sent under another media type, a form part without a name or in a transfer
encoding. On a passthrough route a tenant's body is a JSON object, a form, or nothing.
"""

from __future__ import annotations

from email.message import Message
from email.parser import BytesHeaderParser
from email.policy import HTTP
from typing import Any
from urllib.parse import parse_qsl

import orjson

from gateway.context import RequestContext
from gateway.errors import GatewayError, invalid_request
from gateway.tenancy.references import Reference, field_kind, field_references, references

_PLAIN_ENCODINGS = frozenset({"", "7bit", "8bit", "binary"})  # a part whose bytes are its value


def carried_references(ctx: RequestContext) -> list[Reference]:
    """Every reference in the request's query and body; a 400 or 415 for a body the gateway cannot read."""
    query = (ctx.request.scope.get("query_string") or b"").decode("latin-1")
    return [*field_references(parse_qsl(query, keep_blank_values=True)), *_body_references(ctx)]


def _body_references(ctx: RequestContext) -> list[Reference]:
    if not ctx.body:
        return []
    content_type = ctx.request.headers.get("content-type", "")
    media = content_type.partition(";")[0].strip().lower()
    if "json" in media:
        return references(ctx.payload or _json_object(ctx.body))
    if media == "multipart/form-data":
        return field_references(_form_fields(ctx.body, content_type))
    if media == "application/x-www-form-urlencoded":
        return field_references(parse_qsl(ctx.body.decode("utf-8", errors="replace"), keep_blank_values=True))
    raise GatewayError(
        415,
        f"Content-Type {media or 'missing'!r} is not read on this route: send JSON or a form",
        code="unsupported_media_type",
    )


def _json_object(body: bytes) -> dict[str, Any]:
    """The body as a JSON object where the parse stage left none (`{}`, or a media type it did not take for JSON),
    else a 400."""
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError:
        payload = None
    if not isinstance(payload, dict):
        raise invalid_request(
            "request body must be a JSON object the gateway can read: standard JSON, no NaN or Infinity",
            code="invalid_json",
        )
    return payload


def _form_fields(body: bytes, content_type: str) -> list[tuple[str, str]]:
    """A multipart/form-data body's fields that name objects (name, value as text); every part is read for its
    name: one without a head, that names no field, or whose bytes are transfer-encoded, is a 400. Found by searching
    the body, not copying it: only the parts' heads and the referring fields' values are read out."""
    header = Message(policy=HTTP)
    header["content-type"] = content_type
    boundary = header.get_param("boundary")
    if not isinstance(boundary, str) or not boundary or not boundary.isascii():
        raise _bad_form("its Content-Type names no plain boundary")
    delimiter = b"--" + boundary.encode("ascii")
    fields = []
    at = body.find(delimiter)  # before the first delimiter: the preamble, which no parser reads
    while at != -1 and not body.startswith(b"--", at + len(delimiter)):  # "--" after one: the close delimiter
        start = at + len(delimiter)
        at = body.find(delimiter, start)
        end = len(body) if at == -1 else at
        head_end = body.find(b"\r\n\r\n", start, end)
        if head_end == -1:
            raise _bad_form("a part has no blank line after its head")
        part = BytesHeaderParser(policy=HTTP).parsebytes(body[start:head_end].removeprefix(b"\r\n") + b"\r\n\r\n")
        name = part.get_param("name", header="content-disposition")
        encoding = str(part.get("content-transfer-encoding", "")).strip().lower()
        if not isinstance(name, str) or encoding not in _PLAIN_ENCODINGS:
            raise _bad_form("a part names no field, or its bytes are transfer-encoded")
        if field_kind(name) is not None:
            value = body[head_end + 4 : end].removesuffix(b"\r\n")
            fields.append((name, value.decode("utf-8", errors="replace")))
    return fields


def _bad_form(why: str) -> GatewayError:
    return invalid_request(f"multipart/form-data body the gateway cannot read: {why}", code="invalid_multipart")
