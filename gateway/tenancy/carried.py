"""The references a passthrough request carries, wherever an upstream reads one: its query's parameters, and its
body as a JSON object or as form fields (a container file made from a `file_id`, which the SDK sends as a multipart
field beside the file's bytes), the model it names at its top level among them.

A body the gateway cannot read is refused before it goes anywhere, since the upstream may read what the gateway did
not and find another tenant's id there: JSON that the gateway's decoder refuses but others take (Python's reads
`NaN`), JSON that is not an object, JSON sent under another media type, a form part without a name or in a transfer
encoding. On a passthrough route a tenant's body is a JSON object, a form, or nothing.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qsl

import orjson
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

from gateway.context import RequestContext
from gateway.errors import GatewayError, invalid_request
from gateway.tenancy.references import Reference, field_kind, field_references, model_reference, references

_PLAIN_ENCODINGS = frozenset({b"", b"7bit", b"8bit", b"binary"})  # a part whose bytes are its value


def carried_references(ctx: RequestContext, inline: tuple[str, str] | None = None) -> list[Reference]:
    """Every reference in the request's query and body (`inline`: where a create's JSON body holds requests the
    upstream runs later, whose models are references too); a 400 or 415 for a body the gateway cannot read."""
    query = (ctx.request.scope.get("query_string") or b"").decode("latin-1")
    return [*field_references(parse_qsl(query, keep_blank_values=True)), *_body_references(ctx, inline)]


def inline_request_models(payload: Any, inline: tuple[str, str]) -> list[Reference]:
    """The model each request a create's body holds inline names (Anthropic's Message Batches: `requests[i].params`),
    which the upstream runs later with the pool's key."""
    listed, member = inline
    requests = payload.get(listed) if isinstance(payload, dict) else None
    found: list[Reference] = []
    for i, request in enumerate(requests if isinstance(requests, list) else ()):
        if isinstance(request, dict):
            found += model_reference(request.get(member), f"{listed}[{i}].{member}")
    return found


def _body_references(ctx: RequestContext, inline: tuple[str, str] | None) -> list[Reference]:
    if not ctx.body:
        return []
    content_type = ctx.request.headers.get("content-type", "")
    media = content_type.partition(";")[0].strip().lower()
    if "json" in media:
        payload = ctx.payload or _json_object(ctx.body)
        models = inline_request_models(payload, inline) if inline else []
        return [*model_reference(payload), *models, *references(payload)]
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
    """A multipart/form-data body's fields that name objects (name, value as text), parsed by python-multipart (the
    parser Starlette's forms use): every part must name its field and carry its bytes as they are, else a 400 (a
    part another parser may read differently could carry any id). Only the parts' heads and the referring fields'
    values are kept; the rest of the body (the file) is streamed past."""
    _, options = parse_options_header(content_type)
    boundary = options.get(b"boundary", b"")
    if not boundary or not boundary.isascii():
        raise _bad_form("its Content-Type names no plain boundary")
    fields: list[tuple[str, str]] = []
    head: list[tuple[bytes, bytes]] = []
    field, value = [b""], [b""]  # the header being read
    kept: list[bytes] | None = None  # the value of a field that names objects, as it arrives

    def header_field(data: bytes, start: int, end: int) -> None:
        field[0] += data[start:end]

    def header_value(data: bytes, start: int, end: int) -> None:
        value[0] += data[start:end]

    def header_end() -> None:
        head.append((field[0].lower(), value[0]))
        field[0] = value[0] = b""

    def headers_finished() -> None:
        nonlocal kept
        headers = dict(head)
        _, disposition = parse_options_header(headers.get(b"content-disposition", b""))
        name = disposition.get(b"name")
        encoding = headers.get(b"content-transfer-encoding", b"").strip().lower()
        if name is None or encoding not in _PLAIN_ENCODINGS:
            raise _bad_form("a part names no field, or its bytes are transfer-encoded")
        text = name.decode("utf-8", errors="replace")
        kept = [] if field_kind(text) is not None else None
        if kept is not None:
            fields.append((text, ""))

    def part_data(data: bytes, start: int, end: int) -> None:
        if kept is not None:
            kept.append(data[start:end])

    def part_end() -> None:
        nonlocal kept
        if kept is not None:
            fields[-1] = (fields[-1][0], b"".join(kept).decode("utf-8", errors="replace"))
        kept = None
        head.clear()

    callbacks: Any = {
        "on_header_field": header_field,
        "on_header_value": header_value,
        "on_header_end": header_end,
        "on_headers_finished": headers_finished,
        "on_part_data": part_data,
        "on_part_end": part_end,
    }
    parser = MultipartParser(boundary, callbacks)
    try:
        parser.write(body)
        parser.finalize()
    except MultipartParseError as exc:
        raise _bad_form(str(exc) or "it is not multipart/form-data") from None
    return fields


def _bad_form(why: str) -> GatewayError:
    return invalid_request(f"multipart/form-data body the gateway cannot read: {why}", code="invalid_multipart")
