"""A batch's requests, which the upstream makes later with the pool's key, read when the batch is made as the
requests they stand for: each one parsed and bounded as its route's requests are (gateway/stages/parse.py), then
through the WAF and the input guard with the calling key's tenant's policy, by the same stages a request sent alone
meets (gateway/stages/waf.py, gateway/stages/guard.py). Otherwise a prompt the gateway refuses alone would reach the
model in a batch.

The requests are an OpenAI batch input file's lines (`{"custom_id", "method", "url", "body"}`, read back from the
upstream: gateway/tenancy/request_files.py) or an Anthropic Message Batch's inline `requests[].params`. A request
on a route the gateway does not serve, or one it cannot read, refuses the batch: nothing is skipped. A request the
policy blocks refuses it with the refusal the request alone would get, its `param` naming the request
(`input_file_id line 3: guard.injection`). A request the policy redacts refuses it too: the upstream runs the file as
uploaded, which the gateway cannot rewrite. `monitor` and `flag` findings are recorded as for a request, and the
batch is made.

The cost is bounded per batch as it is per request: where the tenant's WAF or guard is on, a batch holds at most
`MAX_SCANNED_REQUESTS` requests, and where its classifier is on, the requests' scans share one request's
`guard.injection.cpu_budget` (in seconds of scanning); past either the batch is refused (413
`batch_too_large_to_scan`), never made with requests unscanned.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import orjson
from starlette.requests import Request

from gateway.apis.inventory import Inventory
from gateway.apis.routes import BY_NAME
from gateway.apis.shape import Api
from gateway.config import LimitsConfig
from gateway.context import RequestContext
from gateway.edge.offload import Offload
from gateway.errors import GatewayError, invalid_request
from gateway.policy.loader import PolicySet
from gateway.stages.guard import GuardStage
from gateway.stages.parse import parse_body
from gateway.stages.waf import WafStage
from gateway.tenancy.catalog import ApiName

MAX_SCANNED_REQUESTS = 1000  # a batch's requests the WAF and the guard read, at most (OpenAI's files hold up to 50,000)
# the routes a batch's requests may be for, by the API its pool speaks (OpenAI's Batch `endpoint`s the gateway serves)
BATCH_ROUTES: dict[ApiName, tuple[str, ...]] = {
    "openai": ("chat", "responses", "embeddings", "completions"),
    "anthropic": ("messages",),
}


class BatchRequest(NamedTuple):
    """One request of a batch, parsed as its route's: `where` names it in refusals."""

    where: str
    api: Api
    body: bytes
    payload: dict[str, Any]
    values: int
    inventory: Inventory | None


def file_requests(api: ApiName, content: bytes, member: str, limits: LimitsConfig) -> list[BatchRequest]:
    """Every request of a JSONL batch input file (blank lines aside), each `<member> line <n>`; blocking."""
    routes = {BY_NAME[name].path: BY_NAME[name] for name in BATCH_ROUTES[api]}
    found = []
    for number, line in enumerate(content.split(b"\n"), start=1):  # JSONL: lines end at LF alone
        if not line.strip():
            continue
        where = f"{member} line {number}"
        try:
            request = orjson.loads(line)
        except orjson.JSONDecodeError:
            request = None
        if not isinstance(request, dict):
            raise _unreadable(where, "is not a JSON object the gateway can read")
        url = request.get("url")
        route = routes.get(url) if isinstance(url, str) else None
        if route is None or request.get("method", "POST") != "POST":
            served = ", ".join(f"POST {path}" for path in routes)
            raise _unreadable(where, f"is not a request on a route the gateway serves ({served})")
        found.append(_parsed(where, route, request.get("body"), limits))
    return found


def inline_requests(payload: dict[str, Any], inline: tuple[str, str], limits: LimitsConfig) -> list[BatchRequest]:
    """Every request a create's body holds inline (Anthropic's `requests[i].params`); blocking."""
    listed, member = inline
    requests = payload.get(listed)
    if requests is None:
        return []
    if not isinstance(requests, list):
        raise _unreadable(listed, "is not a list of requests")
    found = []
    for i, request in enumerate(requests):
        where = f"{listed}[{i}].{member}"
        body = request.get(member) if isinstance(request, dict) else None
        found.append(_parsed(where, BY_NAME[BATCH_ROUTES["anthropic"][0]], body, limits))
    return found


class BatchRequestChecks:
    """The WAF and the input guard over each request of a batch, with the calling key's tenant's policy."""

    def __init__(
        self,
        policies: Callable[[], PolicySet],
        waf: WafStage,
        guard: GuardStage,
        offload: Offload,
        limits: LimitsConfig,
    ) -> None:
        self._policies = policies
        self._waf = waf
        self._guard = guard
        self._offload = offload
        self.limits = limits  # each request's bounds: its route's, as if sent alone

    async def read(self, work: Callable[..., list[BatchRequest]], *args: object) -> list[BatchRequest]:
        """A batch's requests, parsed on the offload executor (a file may hold thousands)."""
        return await self._offload.run(True, work, *args, self.limits)

    async def check(self, ctx: RequestContext, requests: list[BatchRequest]) -> None:
        """Raises the first refusal a request would get alone, its `param` and message naming the request; a 413 for
        a batch past the guard's bound; a 400 for a request the policy would rewrite."""
        policies = self._policies()
        spec = policies.guard_for(ctx.tenant)
        scanned = spec.enabled and spec.injection.enabled
        if (spec.enabled or policies.waf_for(ctx.tenant).enabled) and len(requests) > MAX_SCANNED_REQUESTS:
            raise _too_large(
                f"the batch holds {len(requests)} requests, and the WAF and the guard read at most "
                f"{MAX_SCANNED_REQUESTS} of a batch's: split it into smaller batches",
                requests[MAX_SCANNED_REQUESTS].where,
            )
        budget = spec.injection.cpu_budget
        started = time.monotonic()
        for request in requests:
            await asyncio.sleep(0)  # a small request's checks run on the event loop: other requests' turn between
            line = _request_context(ctx, request)
            try:
                await self._waf(line)
                await self._guard.check_input(line, policies)
            except GatewayError as error:
                raise _naming(error, request.where) from None
            if line.payload_rewritten:
                raise invalid_request(
                    f"{request.where}: the policy redacts what this request holds, and the upstream runs a batch's "
                    "requests as they were sent, which the gateway cannot rewrite: remove it and make the batch again",
                    param=request.where,
                    code="batch_request_redacted",
                )
            if scanned and time.monotonic() - started > budget:
                raise _too_large(
                    f"scanning the batch's requests took more than the {budget:g} s the guard may spend on one "
                    f"request (guard.injection.cpu_budget), at {request.where}: split it into smaller batches",
                    "guard.injection.cpu_budget",
                )


def _parsed(where: str, api: Api, body: Any, limits: LimitsConfig) -> BatchRequest:
    if not isinstance(body, dict):
        raise _unreadable(where, f"has no JSON object of a {api.path} request to read")
    raw = orjson.dumps(body)
    try:
        payload, _, values, inventory = parse_body(api.name, raw, limits)
    except GatewayError as error:
        raise _naming(error, where) from None
    return BatchRequest(where, api, raw, payload, values, inventory)


def _request_context(ctx: RequestContext, request: BatchRequest) -> RequestContext:
    """The request as if sent alone, on its route's path, with the batch's caller, headers and request id."""
    path = request.api.path
    scope = {**ctx.request.scope, "method": "POST", "path": path, "raw_path": path.encode(), "query_string": b""}
    line = RequestContext(
        request=Request(scope),
        route=request.api.name,
        span=ctx.span,
        client_ip=ctx.client_ip,
        request_id=ctx.request_id,
        tenant=ctx.tenant,
        key_id=ctx.key_id,
        key_label=ctx.key_label,
        key=ctx.key,
    )
    line.body, line.payload, line.json_values = request.body, request.payload, request.values
    line.model = request.payload.get("model") or ""
    if request.inventory is not None:
        line.keep_content(request.inventory)
    return line


def _naming(error: GatewayError, where: str) -> GatewayError:
    """The refusal a request got, naming which request of the batch it is."""
    error.param = f"{where}: {error.param}" if error.param else where
    error.message = f"{where}: {error.message}"
    return error


def _unreadable(where: str, why: str) -> GatewayError:
    return invalid_request(
        f"{where} {why}: the upstream would run it unchecked", param=where, code="batch_request_unreadable"
    )


def _too_large(message: str, param: str) -> GatewayError:
    return GatewayError(413, message, code="batch_too_large_to_scan", param=param)
