"""The objects stage (after auth, on every model route): a request may build only on the tenant's own upstream
objects (a Responses request's `previous_response_id`, a file part's `file_id`: gateway/tenancy/references.py), and
the stored response a Responses request makes is recorded as the tenant's, with its output items, before the client
hears its id.

Anonymous access (no key exists anywhere) has one tenant, so there is nothing to keep apart: such requests are
served as before, and what they make is not recorded.
"""

from __future__ import annotations

import logging
from typing import Any

from gateway.context import RequestContext
from gateway.errors import GatewayError
from gateway.tenancy.ownership import TenantObjects, anonymous
from gateway.tenancy.references import may_refer, references

log = logging.getLogger(__name__)

# Responses stream events that carry the response: the first (its id), and the last (its output items)
_CREATED = "response.created"
_ENDED = frozenset({"response.completed", "response.incomplete", "response.failed"})


class ObjectsStage:
    name = "objects"

    def __init__(self, objects: TenantObjects) -> None:
        self._objects = objects

    async def __call__(self, ctx: RequestContext) -> None:
        if anonymous(ctx) or ctx.tenant is None:
            return
        if may_refer(ctx.body, ctx.encoded_payload) and (wanted := references(ctx.payload)):
            await self._objects.require(ctx.tenant, wanted)
        if ctx.route == "responses":
            ctx.made_objects = MadeObjects(self._objects, ctx.tenant)


class MadeObjects:
    """What a Responses request makes upstream for its tenant: the stored response (unless `store` is false) and its
    output items (which a later request may name in an item reference)."""

    def __init__(self, objects: TenantObjects, tenant: str) -> None:
        self._objects = objects
        self._tenant = tenant

    async def answer(self, answer: dict[str, Any]) -> None:
        """A whole (non-streamed) answer."""
        await self._record(answer, items=True)

    async def event(self, event: dict[str, Any]) -> None:
        """One streamed event: the first carries the response's id, the last its output items."""
        kind = event.get("type")
        if kind == _CREATED or kind in _ENDED:
            response = event.get("response")
            if isinstance(response, dict):
                await self._record(response, items=kind in _ENDED)

    async def _record(self, response: dict[str, Any], items: bool) -> None:
        if response.get("object") != "response" or response.get("store") is False:
            return
        made = [(response.get("id"), "response")]
        if items and isinstance(output := response.get("output"), list):
            made += [(item.get("id"), "item") for item in output if isinstance(item, dict)]
        try:
            await self._objects.record(self._tenant, [(i, kind) for i, kind in made if isinstance(i, str)])
        except GatewayError:  # the answer is the client's still; the response stays unreachable to everyone
            log.error("stored response %s could not be recorded for tenant %r", response.get("id"), self._tenant)
