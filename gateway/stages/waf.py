"""WAF stage: the policy's compiled rules against the raw HTTP parts and the parsed body, before auth.

Runs after parse (it reads ctx.payload) and before auth, so attacks are refused before any per-tenant work. The
tenant and key label that overlays, exclusions and conditions may need come from the shared `KeyRing` (lookup
only; auth still decides). Blocks are OpenAI-shaped 403s with `code: waf_blocked` and the rule ids in `param`.
Rules cost microseconds per JSON value and per kilobyte of text, so a big body is judged (and redacted) on the
offload executor, not on the event loop.
"""

from __future__ import annotations

from collections.abc import Callable

from gateway.context import RequestContext
from gateway.edge.offload import Offload
from gateway.errors import GatewayError
from gateway.keystore.keyring import KeyRing
from gateway.observability.telemetry import Metrics, trace_ids
from gateway.policy.loader import PolicySet
from gateway.waf import audit
from gateway.waf.parts import RequestView, header_text


class WafStage:
    name = "waf"

    def __init__(self, policies: Callable[[], PolicySet], keys: KeyRing, offload: Offload, metrics: Metrics) -> None:
        self._policies = policies
        self._keys = keys
        self._offload = offload
        self._requests = metrics.tallies.counter(metrics.waf_requests)  # by action
        self._matches = metrics.tallies.counter(metrics.waf_rule_matches)  # by pack, rule and what it did

    async def __call__(self, ctx: RequestContext) -> None:
        policies = self._policies()
        span = ctx.span
        if not policies.waf.enabled_anywhere:  # no tenant has rules: not even the caller lookup
            span.set_attributes(
                {"portcullis.waf.policy_version": policies.waf.base.version, "portcullis.waf.action": "off"}
            )
            return
        request = ctx.request
        identity = self._keys.lookup(request.headers)
        tenant = identity.tenant if identity else None
        waf = policies.waf_for(tenant)
        span.set_attribute("portcullis.waf.policy_version", waf.version)
        if not waf.enabled:
            span.set_attribute("portcullis.waf.action", "off")
            return
        view = view_of(ctx, tenant, identity.label if identity else None)
        big = self._offload.is_big(len(ctx.body), ctx.json_values)
        verdict = await self._offload.run(big, waf.evaluate, view)  # (takes the inventory, for the later stages too)
        if view.inventory is not None and ctx.payload:
            ctx.keep_content(view.inventory)
        span.set_attribute("portcullis.waf.action", verdict.action)
        span.set_attribute("portcullis.waf.score", verdict.score)
        self._requests(verdict.action).inc()
        if not verdict.matches:
            return
        for match in verdict.matches:  # label values are the policy's own: its packs' names and rule ids
            self._matches(waf.pack_of[match.rule.id], match.rule.id, verdict.outcome(match)).inc()
        span.set_attribute("portcullis.waf.rules", verdict.rule_ids)
        if verdict.tags:
            span.set_attribute("portcullis.waf.tags", verdict.tags)
        if verdict.redactions and not verdict.blocked:
            if await self._offload.run(big, waf.redact, view, verdict, ctx.payload):
                ctx.payload_rewritten = True
                span.set_attribute("portcullis.waf.redacted", [m.rule.id for m in verdict.redactions])
        if verdict.action not in ("block", "monitor") and not any(m.rule.action == "monitor" for m in verdict.matches):
            return  # scored below the threshold (or tagged/redacted only): on the span, not in the audit log
        trace_id, span_id = trace_ids(ctx.span)
        audit.emit(
            audit.record(
                verdict,
                waf,
                request_id=ctx.request_id,
                trace_id=trace_id,
                span_id=span_id,
                tenant=tenant,
                method=request.method,
                path=request.scope["path"],
                client=ctx.client_ip or None,
                route=ctx.route,
            )
        )
        if verdict.blocked:
            rule = verdict.blocking_rule
            ids = ",".join(m.rule.id for m in verdict.matches if m.points or m.rule is rule)
            status, message = (
                (rule.status, rule.message or waf.spec.block.message)
                if rule is not None and rule.action == "block"
                else (waf.spec.block.status, waf.spec.block.message)  # blocked by score: the policy answers
            )
            raise GatewayError(
                status,
                f"{message} (rules: {ids}; request id {ctx.request_id})",
                type="invalid_request_error",
                code="waf_blocked",
                param=ids,
            )


def view_of(ctx: RequestContext, tenant: str | None, label: str | None) -> RequestView:
    scope = ctx.request.scope
    raw_path = scope.get("raw_path") or scope.get("path", "/").encode()
    return RequestView(
        method=scope.get("method", "POST"),
        path=raw_path.decode("latin-1"),
        query=(scope.get("query_string") or b"").decode("latin-1"),
        headers=[(k.decode("latin-1"), header_text(v)) for k, v in scope.get("headers", ())],
        body=ctx.body,
        payload=ctx.payload or None,  # none parsed (a passthrough route's non-JSON body): the WAF reads it raw
        route=ctx.route,
        client_ip=ctx.client_ip,
        tenant=tenant,
        key_label=label,
        model=ctx.model,
        inventory=ctx.kept_content(),
    )
