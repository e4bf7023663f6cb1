"""Stored keys through the admin API: create, list, read, update, rotate and revoke.

A secret is shown twice only: in the answer that created it and in the one that rotated it. Everything else (the
answers, the audit log) shows a key's public view. Writes are read-modify-write on the store, so this app makes one
at a time: two updates of one key never interleave within an instance.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import TYPE_CHECKING, Annotated

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.admin.audit import AuditLog, actor_of
from gateway.admin.bodies import read_object, validated
from gateway.errors import GatewayError
from gateway.keystore.records import KeyRecord, KeySettings, digest_of, new_key_id, new_secret, now
from gateway.tenancy.tenant_name import tenant_param

if TYPE_CHECKING:
    from gateway.app import Gateway
    from gateway.keystore.store import KeyStoreBackend

DAY = 86400
MAX_GRACE = 30 * DAY
_KEY_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789")


class RotateBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    grace: Annotated[float, Field(ge=0, le=MAX_GRACE)] = Field(
        default=DAY, description="seconds the rotated-out secret keeps working; 0: it stops now"
    )


class KeysApi:
    """The key routes of the admin app, over the gateway's key store."""

    def __init__(self, gateway: Gateway, audit: AuditLog) -> None:
        self.gateway = gateway
        self.audit = audit
        self.writes = asyncio.Lock()

    def routes(self) -> list[Route]:
        return [
            Route("/admin/keys", self.create, methods=["POST"]),
            Route("/admin/keys", self.list_keys, methods=["GET"]),
            Route("/admin/keys/{key_id}", self.get, methods=["GET"]),
            Route("/admin/keys/{key_id}", self.update, methods=["PATCH"]),
            Route("/admin/keys/{key_id}/rotate", self.rotate, methods=["POST"]),
            Route("/admin/keys/{key_id}/revoke", self.revoke, methods=["POST"]),
        ]

    @property
    def store(self) -> KeyStoreBackend:
        return self.gateway.key_store

    async def create(self, request: Request) -> Response:
        settings = validated(KeySettings, await read_object(request))
        key_id = new_key_id()
        secret = new_secret(key_id)
        at = now()
        record = KeyRecord(**settings.model_dump(), id=key_id, digest=digest_of(secret), created_at=at, updated_at=at)
        async with self.writes:
            await self._put(record)
        return self._changed(request, "create", None, record, status=201, secret=secret)

    async def list_keys(self, request: Request) -> Response:
        tenant = tenant_param(request.query_params.get("tenant"))
        records = await self.store.records(tenant)
        return JSONResponse({"object": "list", "data": [record.public() for record in records]})

    async def get(self, request: Request) -> Response:
        return JSONResponse((await self._record(request)).public())

    async def update(self, request: Request) -> Response:
        changes = await read_object(request)
        async with self.writes:
            before = await self._record(request)
            current = before.model_dump(include=set(KeySettings.model_fields))
            settings = validated(KeySettings, {**current, **changes})
            after = before.model_copy(update={**dict(settings), "updated_at": now()})
            await self._put(after)
        return self._changed(request, "update", before, after)

    async def rotate(self, request: Request) -> Response:
        grace = validated(RotateBody, await read_object(request)).grace
        async with self.writes:
            before = await self._record(request)
            if before.revoked_at is not None:
                raise GatewayError(409, f"key {before.id} is revoked: create a new one", code="key_revoked")
            secret = new_secret(before.id)
            at = now()
            after = before.model_copy(
                update={
                    "digest": digest_of(secret),
                    "previous_digest": before.digest if grace else None,
                    "previous_valid_until": at + grace if grace else None,
                    "updated_at": at,
                }
            )
            await self._put(after)
        return self._changed(request, "rotate", before, after, secret=secret)

    async def revoke(self, request: Request) -> Response:
        async with self.writes:
            before = await self._record(request)
            if before.revoked_at is not None:  # idempotent: revoking again changes (and audits) nothing
                return JSONResponse(before.public())
            at = now()
            after = before.model_copy(update={"revoked_at": at, "updated_at": at})
            await self._put(after)
        return self._changed(request, "revoke", before, after)

    async def _put(self, record: KeyRecord) -> None:
        """Store a change and apply it to this instance's key ring at once: the instance that answered a revoke
        refuses the key from its next request on; the others see it at their next poll."""
        await self.store.put(record)
        await self.gateway.keys.refresh()

    async def _record(self, request: Request) -> KeyRecord:
        key_id = request.path_params["key_id"]
        record = await self.store.get(key_id) if len(key_id) == 12 and _KEY_ID_CHARS.issuperset(key_id) else None
        if record is None:
            raise GatewayError(404, f"no key with id '{key_id[:64]}'", code="key_not_found", param="key_id")
        return record

    def _changed(
        self,
        request: Request,
        action: str,
        before: KeyRecord | None,
        after: KeyRecord,
        status: int = 200,
        secret: str | None = None,
    ) -> Response:
        """Audit a change that was stored, and answer with the key's public view (and its new secret, once)."""
        request_id = uuid.uuid4().hex
        view = after.public()
        self.audit.record(
            action,
            actor_of(request),
            after.id,
            after.tenant,
            before.public() if before else None,
            view,
            request_id,
        )
        body = {**view, "secret": secret} if secret else view
        return JSONResponse(body, status_code=status, headers={"x-request-id": request_id})
