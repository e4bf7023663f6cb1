"""Guard stage: PII/secrets and the prompt-injection classifier on the request's messages, after admission.

Which messages are scanned is policy (`spec.guard.injection.roles`, `spec.guard.pii.roles`); completions prompts are
always scanned. PII is handled first, so a redacted prompt is what the classifier and the upstream see. Blocks are
OpenAI-shaped 400s with `code: prompt_blocked`, the rule id in `param` and the verdict in `error.guard`; `flag`
serves the request with an `x-portcullis-guard` response header; `monitor` only records. When the policy turns the
output guard on, the stage leaves an `OutputGuard` on the context for the upstream relay.

Off (the default), the stage costs one policy lookup per request.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from gateway.context import RequestContext
from gateway.guard import pii
from gateway.guard.output import OutputGuard
from gateway.guard.runtime import HEADER, Guard, GuardBlocked, Verdict
from gateway.guard.spec import GuardSpec
from gateway.policy.loader import PolicySet
from gateway.tool_text import dotted, tool_descriptions


class GuardStage:
    name = "guard"

    def __init__(self, policies: Callable[[], PolicySet], guard: Guard) -> None:
        self._policies = policies
        self.guard = guard

    def warm(self) -> None:
        """Load the model at startup when the base policy turns the guard on (blocking: run in a thread)."""
        spec = self._policies().guard_for(None)
        if spec.enabled and spec.injection.enabled:
            self.guard.load(spec.runtime)

    async def __call__(self, ctx: RequestContext) -> None:
        policies = self._policies()
        spec = policies.guard_for(ctx.tenant)
        if not spec.enabled:
            return
        verdicts: list[Verdict] = []
        if spec.pii.pii != "off" or spec.pii.secrets != "off":
            verdicts += self._pii(ctx, spec)
        if spec.injection.enabled:
            verdicts.append(await self._injection(ctx, spec))
        for verdict in verdicts:
            self.guard.record(verdict, policies.version)
        for verdict in verdicts:
            if verdict.result == "block":
                raise GuardBlocked(verdict, policies.version, ctx.request_id)
        flagged = [v.header() for v in verdicts if v.result == "flag"]
        if flagged:
            ctx.response_headers[HEADER] = ", ".join(flagged)
        if spec.output.enabled:
            ctx.output_guard = OutputGuard(self.guard, spec, policies.version, ctx.request_id, ctx.route)

    async def _injection(self, ctx: RequestContext, spec: GuardSpec) -> Verdict:
        policy = spec.injection
        texts, where = texts_of(ctx, policy.roles)
        score, index = await self.guard.classify(texts, policy, spec.runtime)
        threshold = self.guard.threshold(policy)
        result = policy.action if score >= threshold else "pass"
        return Verdict("input", "prompt_injection", "guard.injection", result, score, threshold,
                       where=where[index] if result != "pass" and index >= 0 else None)

    def _pii(self, ctx: RequestContext, spec: GuardSpec) -> list[Verdict]:
        policy = spec.pii
        types = policy.types or None
        verdicts: list[Verdict] = []
        changed = False
        for holder, key, where in _text_slots(ctx, policy.roles):
            text = holder[key]
            findings = pii.find(text, types)
            if not findings:
                continue
            redact = []
            for kind, action in (("pii", policy.pii), ("secret", policy.secrets)):
                found = [f for f in findings if f.kind == kind]
                if not found or action == "off":
                    continue
                found_types = sorted({f.type for f in found})
                verdicts.append(Verdict("input", kind, f"guard.{kind}.{found_types[0]}", action,
                                        types=found_types, where=where))
                if action == "redact":
                    redact += found
            if redact:
                holder[key] = pii.redact(text, sorted(redact, key=lambda f: f.start))
                changed = True
        if changed:
            ctx.body = json.dumps(ctx.payload).encode()
        return verdicts


def texts_of(ctx: RequestContext, roles: list[str]) -> tuple[list[str], list[str]]:
    """The texts to classify and where each came from ("messages[1]", "prompt")."""
    texts, where = [], []
    for holder, key, place in _text_slots(ctx, roles):
        texts.append(holder[key])
        where.append(place)
    return texts, where


def _text_slots(ctx: RequestContext, roles: list[str]):
    """(container, key, where) for every string the roles select: message content, content parts, prompts, and
    with `tool_definitions` the descriptions of the request's tools and their parameters."""
    payload = ctx.payload
    if ctx.route == "completions":
        prompt = payload.get("prompt")
        if isinstance(prompt, str):
            yield payload, "prompt", "prompt"
        elif isinstance(prompt, list):
            for i, p in enumerate(prompt):
                if isinstance(p, str):
                    yield prompt, i, f"prompt[{i}]"
        return
    for i, message in enumerate(payload.get("messages") or ()):
        if not isinstance(message, dict) or message.get("role") not in roles:
            continue
        content = message.get("content")
        if isinstance(content, str):
            yield message, "content", f"messages[{i}]"
        elif isinstance(content, list):
            for j, part in enumerate(content):
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    yield part, "text", f"messages[{i}].content[{j}]"
    if "tool_definitions" in roles:
        for holder, key, loc in tool_descriptions(payload):
            yield holder, key, dotted(loc)
