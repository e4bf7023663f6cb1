"""Who may reach which upstream object: the tenant that made it through the gateway, and no one else.

Every decision reads the records (gateway/tenancy/store.py) and answers the same way for an object another tenant
made and for one that does not exist: a 404 in the route's shape, never a 403, which would tell the asker that the
id is real. An object the gateway has no record of (made outside it, or its record expired) is hidden from every
tenant, unless `tenant_objects.unrecorded: readable` lets every tenant read it (never change or delete it). A store
that does not answer decides nothing: 503, and nothing goes upstream.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Iterable, Sequence
from typing import TYPE_CHECKING, TypeVar

from gateway.config import TenantObjectsConfig
from gateway.errors import GatewayError
from gateway.tenancy.catalog import is_object_id
from gateway.tenancy.records import Made, ObjectRecord, StoreUnavailable
from gateway.tenancy.references import Reference
from gateway.tenancy.store import ObjectStore

if TYPE_CHECKING:
    from gateway.context import RequestContext

log = logging.getLogger(__name__)

_ID_IN_MESSAGE = 128  # characters of an asked-for id echoed back

T = TypeVar("T")


def anonymous(ctx: RequestContext) -> bool:
    """Served without a key: one tenant, nothing to keep apart (auth leaves a key id for every static or stored key,
    none for anonymous access)."""
    return ctx.key_id is None


class TenantObjects:
    def __init__(self, store: ObjectStore, config: TenantObjectsConfig) -> None:
        self.store = store
        self._ttl = config.ttl
        self.unrecorded_readable = config.unrecorded == "readable"
        if self.unrecorded_readable:
            log.warning(
                "tenant_objects.unrecorded: readable: every tenant may read the objects the gateway has no record of "
                "and call such fine-tuned models, another tenant's too once its record expires (tenant_objects.ttl: "
                "%.0fs); keep the ttl at least as long as the upstream keeps objects (files, models: until deleted)",
                config.ttl,
            )

    async def require(self, tenant: str, wanted: Sequence[Reference], *, change: bool = False) -> None:
        """Pass if every object `wanted` names is the tenant's to read (to `change`: modify, delete, add to), else
        raise the 404 for the first that is not."""
        # an id the gateway does not record (a space, a dot) is no tenant's, not even an unrecorded object's
        found = await self.find(r.object_id for r in wanted if is_object_id(r.object_id, r.kind))
        for reference in wanted:
            if not is_object_id(reference.object_id, reference.kind) or not self._reaches(
                tenant, reference.kind, found.get(reference.object_id), change
            ):
                raise not_found(reference)

    async def visible(self, tenant: str, kind: str, object_ids: Sequence[str]) -> set[str]:
        """Those of a list page's ids the tenant may see."""
        ids = [i for i in object_ids if is_object_id(i, kind)]
        found = await self.find(ids)
        return {i for i in ids if self._reaches(tenant, kind, found.get(i), False)}

    async def owned(self, tenant: str, kind: str, object_ids: Sequence[str]) -> set[str]:
        """Those of these ids recorded as the tenant's: what the objects they are name is the tenant's too (an
        unrecorded object another tenant may read is no one's, nor is what it names)."""
        found = await self.find(i for i in object_ids if is_object_id(i, kind))
        return {i for i, record in found.items() if record.tenant == tenant and record.kind == kind}

    async def record(self, tenant: str, made: Iterable[tuple[str, str]]) -> None:
        """Record objects (id, kind) the upstream made for the tenant; an id recorded already keeps its record."""
        now = time.time()
        rows = [Made(i, ObjectRecord(tenant, kind, now)) for i, kind in made if is_object_id(i, kind)]
        if rows:
            await self._answered(self.store.add(rows, self._ttl))

    async def forget(self, object_id: str) -> None:
        """The object was deleted upstream: its record goes too."""
        await self._answered(self.store.remove(object_id))

    async def aclose(self) -> None:
        await self.store.aclose()

    def _reaches(self, tenant: str, kind: str, record: ObjectRecord | None, change: bool) -> bool:
        if record is None:
            return self.unrecorded_readable and not change
        return record.tenant == tenant and record.kind == kind

    async def find(self, object_ids: Iterable[str]) -> dict[str, ObjectRecord]:
        """The records of those of these ids that have one (each an id of its kind: checked by the caller)."""
        asked = list(dict.fromkeys(object_ids))
        return await self._answered(self.store.find(asked)) if asked else {}

    async def _answered(self, call: Awaitable[T]) -> T:
        try:
            return await call
        except StoreUnavailable as err:
            log.warning("tenant objects: the %s store did not answer (%s); refusing with 503", self.store.name, err)
            raise GatewayError(
                503,
                "who owns this object cannot be checked: the object store is unreachable; retry",
                type="server_error",
                code="object_store_unavailable",
                headers={"retry-after": "1"},
            ) from None


def not_found(reference: Reference) -> GatewayError:
    """The same answer whether the object is another tenant's or does not exist."""
    shown = reference.object_id[:_ID_IN_MESSAGE]
    if reference.kind == "response" and reference.param.endswith("previous_response_id"):  # a batch line's too
        message = f"Previous response with id '{shown}' not found."  # OpenAI's own wording
        return GatewayError(404, message, code="previous_response_not_found", param=reference.param)
    message = f"No {reference.kind.replace('_', ' ')} found with id '{shown}'."
    return GatewayError(404, message, code=f"{reference.kind}_not_found", param=reference.param)
