"""A pool's passthrough routes, served within what the requesting tenant owns (gateway/tenancy/catalog.py says what
each path is):

- a stateless path goes upstream as it came;
- creating an object (`POST /v1/files`) reads the answer and records the id it names as the tenant's before the
  client hears it, with the objects its answer says were made for it (an upload's file);
- one object (`/v1/files/{id}` and everything under it) is served only to the tenant that made it: anyone else gets
  a 404 and nothing goes upstream; a delete that succeeded removes the record; a read names the objects made for it
  since (a batch's output file, a fine-tuning job's model), as does a page of its sub-objects (a job's checkpoints);
  a model (`/v1/models/{model}`) is held to gateway/tenancy/models.py's rule;
- a list (`GET /v1/files`) is filtered to the tenant's objects, paging on with the upstream's cursor until the
  client's page is full or the upstream has no more (at most `LIST_PAGES` upstream pages per answer), and what its
  objects name is recorded as for a read;
- any other path a pattern admits is a 404, unless the tenant has its own upstream key on the pool
  (`tenant_api_key_env`): then the provider keeps its objects apart, and the path goes upstream as it came.

Every reference a request carries to other objects (a batch's `input_file_id`, an image edit's `file_id`, in its
body or query: gateway/tenancy/carried.py) must be the tenant's too, on stateless paths as well, and so must every
reference of the requests in a batch's input file (gateway/tenancy/request_files.py); the model a request or a batch's
line names is held to gateway/tenancy/models.py's rule. A batch's requests, in its input file or inline, meet the WAF
and the input guard as if sent alone (gateway/tenancy/batch_requests.py), anonymous ones too. Anonymous access (one
tenant) is otherwise passed through as before, within the catalog's paths.
"""

from __future__ import annotations

import logging
from typing import Any
from urllib.parse import parse_qsl, urlencode

import orjson
from starlette.responses import Response

from gateway.apis.anthropic.errors import anthropic_error
from gateway.context import RequestContext
from gateway.errors import GatewayError, invalid_request
from gateway.relay.upstream import PassedAnswer, Upstream
from gateway.routing.pool import Pool
from gateway.stages.auth import model_not_allowed
from gateway.tenancy.batch_requests import BatchRequestChecks, file_requests, inline_requests
from gateway.tenancy.carried import carried_references
from gateway.tenancy.catalog import (
    MODEL,
    PAGES,
    Collection,
    Named,
    ObjectRoute,
    Route,
    classify,
    is_object_id,
    is_plain_path,
    named_ids,
)
from gateway.tenancy.models import TenantModels
from gateway.tenancy.ownership import TenantObjects, anonymous
from gateway.tenancy.references import Reference
from gateway.tenancy.request_files import content_path, requests_references, unreadable

log = logging.getLogger(__name__)

LIST_PAGES = 10  # upstream pages read for one filtered list page, at most
SCAN_LIMIT = 100  # objects asked of the upstream per page while filtering (within the collection's max_limit)
_READS = frozenset({"GET", "HEAD"})


class ObjectPassthrough:
    def __init__(
        self, objects: TenantObjects, models: TenantModels, upstream: Upstream, batch_requests: BatchRequestChecks
    ) -> None:
        self._objects = objects
        self._models = models
        self._upstream = upstream
        self._batch_requests = batch_requests

    async def __call__(self, ctx: RequestContext, pool: Pool) -> Response:
        try:
            return await self._serve(ctx, pool)
        except GatewayError as error:
            if pool.config.api == "anthropic":  # its clients read Anthropic's error shape
                raise AnthropicShaped(error) from None
            raise

    async def _serve(self, ctx: RequestContext, pool: Pool) -> Response:
        method, path = ctx.request.method, ctx.request.scope["path"]
        route = classify(pool.config.api, path)
        # the provider keeps this tenant's objects apart; a route the pool passes through, not one its URL leads to
        if route is None and pool.has_own_key(ctx.tenant) and is_plain_path(path):
            return await self._upstream.pass_through(ctx, pool)
        if route is None:
            raise _unknown(method, path)
        batch = _batch(route, method)
        if anonymous(ctx) or ctx.tenant is None:
            if batch is not None:  # one tenant, whose batch's requests are still checked
                carried = carried_references(ctx, batch.inline_requests)
                await self._check_requests(ctx, pool, batch, carried, None)
            return await self._upstream.pass_through(ctx, pool)  # one tenant
        tenant, change = ctx.tenant, method not in _READS
        if isinstance(route, ObjectRoute) and route.object_id is not None:
            if route.collection.kind == MODEL:
                await self._models.require(ctx, route.object_id, pool, change=change, param="id")
            else:
                one = Reference(route.collection.kind, route.object_id, "id")
                await self._objects.require(tenant, [one], change=change)
        carried = carried_references(ctx, batch.inline_requests if batch is not None else None)
        await self._require(ctx, pool, tenant, carried)  # stateless paths too: an image edit's file_id
        if not isinstance(route, ObjectRoute):
            return await self._upstream.pass_through(ctx, pool)
        collection = route.collection
        if route.object_id is not None:
            return await self._one(ctx, pool, route, change)
        if route.action is None and method == "GET" and collection.lists:
            return await self._list(ctx, pool, collection, tenant)
        if route.action is not None and method == "POST":
            made: tuple[Named, ...] = collection.actions[route.action]
        elif method == "POST" and collection.creates:
            made = (Named(("id",), collection.kind), *collection.names)
            if batch is not None:
                await self._check_requests(ctx, pool, batch, carried, tenant)
        else:
            raise _unknown(method, path)
        answer = await self._upstream.pass_through_whole(ctx, pool)
        if answer.ok and (body := answer.json()) is not None:
            await self._record(ctx, pool, tenant, route, body, made)
        return answer.response()

    async def _one(self, ctx: RequestContext, pool: Pool, route: ObjectRoute, change: bool) -> Response:
        """One object the tenant may reach (checked): its content and sub-lists stream as they come, but for a page
        of sub-objects that name objects; anything else is read whole, for what it deletes or names."""
        collection, object_id = route.collection, route.object_id
        sub_list = collection.sub_lists.get(route.rest[0]) if len(route.rest) == 1 and not change else None
        if not change and route.rest and sub_list is None:
            return await self._upstream.pass_through(ctx, pool)
        answer = await self._upstream.pass_through_whole(ctx, pool)
        if not answer.ok or ctx.tenant is None or object_id is None:
            return answer.response()
        if ctx.request.method == "DELETE" and not route.rest:
            await self._objects.forget(object_id)
        elif (sub_list or collection.names) and (body := answer.json()) is not None:
            # what an object names is its owner's: not the reader's where it is an unrecorded object anyone may read
            if await self._objects.owned(ctx.tenant, collection.kind, [object_id]):
                if sub_list is None:
                    made = named_ids(body, collection.names)
                else:
                    made = [named for item in _list_page(answer)[1] for named in named_ids(item, sub_list)]
                await self._objects.record(ctx.tenant, made)
        return answer.response()

    async def _check_requests(
        self, ctx: RequestContext, pool: Pool, collection: Collection, carried: list[Reference], tenant: str | None
    ) -> None:
        """The requests a create holds, inline or in a file (a batch's input file, the tenant's: checked), that the
        upstream will make with the pool's key: each meets the WAF and the guard as if sent alone
        (gateway/tenancy/batch_requests.py), and a tenant's may build only on its own objects."""
        checks = self._batch_requests
        _one_file_each(collection, ctx.payload, carried)
        if collection.inline_requests is not None:
            if ctx.body and not ctx.payload:  # JSON past the parse limits: its requests cannot be read
                raise invalid_request(
                    "the body is not JSON within the gateway's limits: the requests in it cannot be checked",
                    param=collection.inline_requests[0],
                    code="invalid_json",
                )
            requests = await checks.read(inline_requests, ctx.payload, collection.inline_requests)
            await checks.check(ctx, requests)
        for named in carried:
            if named.param in collection.request_files:
                content = await self._request_file(ctx, pool, named)
                if tenant is not None:
                    await self._require(ctx, pool, tenant, await requests_references(content, named.param))
                await checks.check(ctx, await checks.read(file_requests, pool.config.api, content, named.param))

    async def _request_file(self, ctx: RequestContext, pool: Pool, request_file: Reference) -> bytes:
        """A file of requests read back from the upstream whole, within the pool's `max_response_bytes`."""
        member = request_file.param
        path = content_path(request_file.object_id)
        try:
            answer = await self._upstream.pass_through_whole(ctx, pool, method="GET", path=path, query="", body=b"")
        except GatewayError as error:
            if error.code == "upstream_response_too_large":
                raise unreadable(member, error.message) from None
            raise
        if not answer.ok:
            raise unreadable(member, f"the upstream answered {answer.status}")
        return answer.content

    async def _require(self, ctx: RequestContext, pool: Pool, tenant: str, wanted: list[Reference]) -> None:
        """Every reference must be the tenant's to use: the models it names allowed to the calling key and the
        tenant's on this pool (a batch's lines are requests the upstream makes with the pool's key: the key's
        allow-list holds for each, as if sent one by one), the other objects its own."""
        models = [r for r in wanted if r.kind == MODEL]
        key = ctx.key
        if key is not None:
            for reference in models:
                if not key.allows(reference.object_id):
                    raise model_not_allowed(reference.object_id, reference.param)
        await self._models.require_all(ctx, models, pool)
        await self._objects.require(tenant, [r for r in wanted if r.kind != MODEL])

    async def _record(
        self,
        ctx: RequestContext,
        pool: Pool,
        tenant: str,
        route: ObjectRoute,
        body: dict[str, Any],
        made: tuple[Named, ...],
    ) -> None:
        """Record what a create or an action made. A create that cannot be recorded is undone (deleted upstream,
        best effort) and refused: no one could reach it, its maker included."""
        try:
            await self._objects.record(tenant, named_ids(body, made))
        except GatewayError:
            object_id, collection = body.get("id"), route.collection
            if route.action is None and is_object_id(object_id, collection.kind):
                log.error("%s %s made upstream but not recorded: deleting it", collection.kind, object_id)
                try:
                    path = f"{collection.root}/{object_id}"
                    await self._upstream.pass_through_whole(ctx, pool, method="DELETE", path=path, query="", body=b"")
                except GatewayError as err:
                    log.error("%s %s could not be deleted: %s", collection.kind, object_id, err.message)
            raise

    async def _list(self, ctx: RequestContext, pool: Pool, collection: Collection, tenant: str) -> Response:
        """A list page of the tenant's own objects: the upstream's pages filtered, read on with its cursor until
        the page is full, the upstream has no more, or `LIST_PAGES` pages were read (then `has_more` stays true and
        the page may be short, or empty)."""
        pages = PAGES[pool.config.api]
        query = parse_qsl((ctx.request.scope.get("query_string") or b"").decode("latin-1"), keep_blank_values=True)
        asked = dict(query)
        limit = _limit(asked.get("limit"), collection)
        backward = pages.before in asked  # toward the list's start: each upstream page is read from its end
        cursor_name = pages.before if backward else pages.after
        cursor = asked.get(cursor_name)
        if cursor is not None:  # a cursor is an object of the tenant's own list, as the SDKs page
            await self._objects.require(tenant, [Reference(collection.kind, cursor, cursor_name)])
        passed = [(k, v) for k, v in query if k not in ("limit", pages.after, pages.before)]
        scan = str(min(max(limit, SCAN_LIMIT), collection.max_limit))
        kept: list[dict[str, Any]] = []
        more = True  # unless the upstream says it has no more
        for _ in range(LIST_PAGES):
            at = [(cursor_name, cursor)] if cursor is not None else []
            answer = await self._upstream.pass_through_whole(
                ctx, pool, query=urlencode([*passed, *at, ("limit", scan)])
            )
            if not answer.ok:
                return answer.response()  # the upstream's own refusal, as it sent it
            page, data = _list_page(answer)
            visible = await self._objects.visible(tenant, collection.kind, [item["id"] for item in data])
            mine = [item for item in (reversed(data) if backward else data) if item["id"] in visible]
            if collection.names and mine:  # what the tenant's own objects name is its own: a job's model
                owned = await self._objects.owned(tenant, collection.kind, [item["id"] for item in mine])
                made = [named for item in mine if item["id"] in owned for named in named_ids(item, collection.names)]
                await self._objects.record(tenant, made)
            room = limit - len(kept)
            kept += mine[:room]
            if len(mine) > room:  # the page is full, and more of the tenant's follow in this very one
                break
            if len(kept) == limit or not (page.get("has_more") and data):
                more = bool(page.get("has_more")) and bool(data)
                break
            cursor = (data[0] if backward else data[-1])["id"]
        if backward:
            kept.reverse()
        filtered = {
            **page,
            "data": kept,
            "first_id": kept[0]["id"] if kept else None,
            "last_id": kept[-1]["id"] if kept else None,
            "has_more": more,
        }
        return Response(orjson.dumps(filtered), media_type="application/json", headers=answer.headers)


def _one_file_each(collection: Collection, payload: Any, carried: list[Reference]) -> None:
    """A member naming a file of requests names one file by its id, a string: named any other way (an object, a
    list, a form field's nested name) the upstream might still read a file the gateway never read and checked."""
    for member in collection.request_files:
        value = payload.get(member) if isinstance(payload, dict) else None
        nested = any(r.param != member and r.param.startswith(member) and r.param[len(member)] in ".[" for r in carried)
        if nested or (value is not None and not isinstance(value, str)):
            raise invalid_request(f"'{member}' must be the id of one file, a string", param=member)


def _batch(route: Route, method: str) -> Collection | None:
    """The collection, where the request creates an object that hands the upstream requests to make later with the
    pool's key (a batch: in an input file, or inline in the create's body)."""
    if not isinstance(route, ObjectRoute) or route.object_id is not None or route.action is not None:
        return None
    collection = route.collection
    holds = bool(collection.request_files) or collection.inline_requests is not None
    return collection if method == "POST" and holds else None


def _limit(value: str | None, collection: Collection) -> int:
    if value is None:
        return collection.default_limit
    if not (value.isascii() and value.isdigit()) or not 1 <= int(value) <= collection.max_limit:
        raise invalid_request(
            f"'limit' must be an integer from 1 to {collection.max_limit}", param="limit", code="invalid_limit"
        )
    return int(value)


def _list_page(answer: PassedAnswer) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A list page's body and its objects (each with a string id), or a 502 for anything else."""
    body = answer.json()
    data = body.get("data") if body is not None else None
    if (
        body is None
        or not isinstance(data, list)
        or not all(isinstance(o, dict) and isinstance(o.get("id"), str) for o in data)
    ):
        raise GatewayError(
            502,
            "the upstream's list answer is not a page of objects the gateway can filter",
            type="upstream_error",
            code="upstream_bad_response",
        )
    return body, data


def _unknown(method: str, path: str) -> GatewayError:
    return GatewayError(404, f"Unknown route {method} {path[:256]}: not one this pool passes through", code="not_found")


class AnthropicShaped(GatewayError):
    """An error on an Anthropic pool's passthrough route, in Anthropic's shape."""

    def __init__(self, error: GatewayError) -> None:
        super().__init__(
            error.status, error.message, type=error.type, code=error.code, param=error.param, headers=error.headers
        )

    def body(self) -> dict[str, Any]:
        return anthropic_error(self.status, self.message, self.type)
