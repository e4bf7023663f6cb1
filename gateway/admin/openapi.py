"""The admin plane's OpenAPI 3.1 document, its schemas generated from the pydantic models the routes validate with.

OpenAPI 3.1 schemas are JSON Schema 2020-12, which is what pydantic writes, so the models' schemas go in as they
are; the views a route answers with (a key without its digests, a new key with its secret) are derived from them.
"""

from __future__ import annotations

import copy
from typing import Any

from pydantic.json_schema import models_json_schema

from gateway.admin.bodies import MAX_BODY_BYTES
from gateway.admin.keys import RotateBody
from gateway.admin.spend import GROUPS, MAX_WINDOW, SpendReport
from gateway.keystore.records import KeyRecord, KeySettings
from gateway.tenancy.tenant_name import TENANT_NAME_PATTERN

REF = "#/components/schemas/{model}"
HIDDEN = ("digest", "previous_digest")  # stored, never shown


def openapi_document() -> dict[str, Any]:
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Portcullis admin API",
            "version": "1",
            "description": (
                "The admin plane of a Portcullis gateway, on its own listener: health, metrics, policy status, "
                f"stored API keys and spend. Request bodies are JSON objects of at most {MAX_BODY_BYTES} bytes; "
                'errors are `{"error": {message, type, code, param}}`.'
            ),
        },
        "components": {
            "schemas": _schemas(),
            "securitySchemes": {"adminToken": {"type": "http", "scheme": "bearer"}},
            "responses": {
                "BadRequest": _error("a body or query the route refuses; `param` names the field"),
                "Unauthorized": _error("the admin token is missing or wrong (when `admin.token_env` is set)"),
                "NotFound": _error("no key with this id"),
                "TooLarge": _error(f"a body over {MAX_BODY_BYTES} bytes"),
            },
        },
        "security": [{"adminToken": []}],
        "paths": _paths(),
    }


def _schemas() -> dict[str, Any]:
    _, defs = models_json_schema(
        [
            (KeySettings, "validation"),
            (KeyRecord, "serialization"),
            (RotateBody, "validation"),
            (SpendReport, "serialization"),
        ],
        ref_template=REF,
    )
    schemas = defs["$defs"]
    view = copy.deepcopy(schemas.pop("KeyRecord"))
    for name in HIDDEN:
        del view["properties"][name]
    view["required"] = [name for name in view["required"] if name not in HIDDEN]
    view.update(title="KeyView", description="A stored key as the admin API shows it: everything but its digests.")
    created = copy.deepcopy(view)
    created["properties"]["secret"] = {"type": "string", "description": "the key's secret: shown this once only"}
    created["required"].append("secret")
    created.update(title="KeyWithSecret", description="A key just created or rotated, with its new secret.")
    update = copy.deepcopy(schemas["KeySettings"])
    update.pop("required", None)
    update.update(title="KeyUpdate", description="The settings to change: each field given replaces the key's own.")
    return {
        **schemas,
        "KeyView": view,
        "KeyWithSecret": created,
        "KeyUpdate": update,
        "KeyList": {
            "type": "object",
            "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": _ref("KeyView")}},
            "required": ["object", "data"],
        },
        "Error": {
            "type": "object",
            "properties": {
                "error": {
                    "type": "object",
                    "properties": {
                        "message": {"type": "string"},
                        "type": {"type": "string"},
                        "code": {"type": ["string", "null"]},
                        "param": {"type": ["string", "null"]},
                    },
                    "required": ["message", "type", "code", "param"],
                }
            },
            "required": ["error"],
        },
    }


def _paths() -> dict[str, Any]:
    key_id = {
        "name": "key_id",
        "in": "path",
        "required": True,
        "schema": {"type": "string", "pattern": "^[a-z0-9]{12}$"},
    }
    one_key = {"parameters": [key_id]}
    return {
        "/healthz": {"get": _op("Liveness", _json({"type": "object"}))},
        "/readyz": {
            "get": _op(
                "Readiness, with each pool's replicas and whether they are up (503 when no pool can serve)",
                _json({"type": "object"}),
            )
        },
        "/metrics": {"get": _op("Prometheus metrics", {"content": {"text/plain": {"schema": {"type": "string"}}}})},
        "/admin/policy": {
            "get": _op(
                "The policy set in force: version, reload status, tenants, WAF summary", _json({"type": "object"})
            )
        },
        "/admin/config": {
            "get": _op(
                "The portcullis.yaml served: its version and file, and the reload status (the last refusal's error)",
                _json({"type": "object"}),
            )
        },
        "/admin/openapi.json": {"get": _op("This document", _json({"type": "object"}))},
        "/admin/keys": {
            "post": _op(
                "Create a key; its secret is in this answer only",
                _json(_ref("KeyWithSecret")),
                status="201",
                body="KeySettings",
            ),
            "get": _op(
                "Every key (revoked ones included), oldest first",
                _json(_ref("KeyList")),
                params=[
                    _query("tenant", "only this tenant's keys", {"type": "string", "pattern": TENANT_NAME_PATTERN})
                ],
            ),
        },
        "/admin/keys/{key_id}": {
            **one_key,
            "get": _op("One key", _json(_ref("KeyView")), missing=True),
            "patch": _op("Change a key's settings", _json(_ref("KeyView")), body="KeyUpdate", missing=True),
        },
        "/admin/keys/{key_id}/rotate": {
            **one_key,
            "post": _op(
                "A new secret, shown once; the old one keeps working for `grace` seconds (409 if the key is revoked)",
                _json(_ref("KeyWithSecret")),
                body="RotateBody",
                missing=True,
            ),
        },
        "/admin/keys/{key_id}/revoke": {
            **one_key,
            "post": _op("Revoke a key for good (revoking again changes nothing)", _json(_ref("KeyView")), missing=True),
        },
        "/admin/spend": {
            "get": _op(
                "Spend, grouped; as CSV with `format=csv` or `Accept: text/csv`",
                {
                    "content": {
                        "application/json": {"schema": _ref("SpendReport")},
                        "text/csv": {"schema": {"type": "string"}},
                    }
                },
                params=[
                    _query(
                        "group_by",
                        f"comma-separated, of {', '.join(GROUPS)}; at most one of hour, day and month",
                        {"type": "string", "examples": ["key,model,day"]},
                    ),
                    _query(
                        "start",
                        "Unix seconds, ISO-8601 date or datetime (UTC unless it has an offset); default: this month's "
                        "first day",
                        {"type": "string"},
                    ),
                    _query(
                        "end",
                        "excluded; a date covers its whole day; default: next month's first day; at most "
                        f"{MAX_WINDOW.days} days after start",
                        {"type": "string"},
                    ),
                    _query("tenant", "only this tenant's spend", {"type": "string", "pattern": TENANT_NAME_PATTERN}),
                    _query("key", "only this key's spend", {"type": "string", "pattern": "^[a-z0-9]{12}$"}),
                    _query("format", "json (default) or csv", {"enum": ["json", "csv"]}),
                ],
            )
        },
    }


def _op(
    summary: str,
    ok: dict,
    *,
    status: str = "200",
    body: str | None = None,
    params: list[dict] | None = None,
    missing: bool = False,
) -> dict[str, Any]:
    """One operation: its answer, and the errors it can give (400 for a body or query, 413 for a body)."""
    responses: dict[str, Any] = {
        status: {"description": "OK", **ok},
        "401": {"$ref": "#/components/responses/Unauthorized"},
    }
    if body or params:
        responses["400"] = {"$ref": "#/components/responses/BadRequest"}
    if body:
        responses["413"] = {"$ref": "#/components/responses/TooLarge"}
    if missing:
        responses["404"] = {"$ref": "#/components/responses/NotFound"}
    operation: dict[str, Any] = {"summary": summary, "responses": responses}
    if body:
        operation["requestBody"] = {"required": body != "RotateBody", **_json(_ref(body))}
    if params:
        operation["parameters"] = params
    return operation


def _json(schema: dict) -> dict:
    return {"content": {"application/json": {"schema": schema}}}


def _ref(name: str) -> dict:
    return {"$ref": REF.format(model=name)}


def _query(name: str, description: str, schema: dict) -> dict:
    return {"name": name, "in": "query", "required": False, "description": description, "schema": schema}


def _error(description: str) -> dict:
    return {"description": description, **_json(_ref("Error"))}
