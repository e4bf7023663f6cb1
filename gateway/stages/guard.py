"""Guard stage: PII/secrets and the prompt-injection classifier on the request's messages, after admission.

Which messages are scanned is policy (`spec.guard.injection.roles`, `spec.guard.pii.roles`); completions prompts are
always scanned, token-id prompts decoded with the model's tokenizer (gateway/guard/inputs.py). The classifier judges
the text as the client sent it: redaction is for what goes upstream, and a `[REDACTED:EMAIL]` marker must not be
what decides whether a prompt is an attack. Blocks are OpenAI-shaped 400s with `code: prompt_blocked`, the rule id in
`param` and the verdict in `error.guard`; `flag` serves the request with an `x-portcullis-guard` response header;
`monitor` only records. Input the guard cannot scan whole is refused, never served unscanned: token ids of a model
whose tokenizer is unknown (400, unless the policy passes them) and text needing more than `max_windows` (413). When
the policy turns the output guard on, the stage leaves an `OutputGuard` on the context for the upstream relay.

Reading, detecting and tokenizing a big body run on the offload executor; the classifier runs on the micro-batcher's
threads: neither holds the event loop. Off (the default), the stage costs one policy lookup per request.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gateway.apis.shape import PromptText
from gateway.context import RequestContext
from gateway.errors import GatewayError
from gateway.guard import pii
from gateway.guard.inputs import Decode, request_texts, selected
from gateway.guard.output import OutputGuard
from gateway.guard.runtime import HEADER, Guard, GuardBlocked, Verdict, Windows
from gateway.guard.spec import GuardSpec
from gateway.offload import Offload
from gateway.policy.loader import PolicySet

# (the texts the classifier scans, their windows)
Scan = tuple[list[PromptText], Windows]


class GuardStage:
    name = "guard"

    def __init__(
        self,
        policies: Callable[[], PolicySet],
        guard: Guard,
        offload: Offload,
        decode: Callable[[str, list[int]], str | None],
    ) -> None:
        self._policies = policies
        self.guard = guard
        self._offload = offload
        self._decode = decode  # (model, token ids) -> text, or None when the model's tokenizer is unknown

    def warm(self) -> None:
        """Load the model at startup when the base policy turns the guard on (blocking: run in a thread)."""
        spec = self._policies().guard_for(None)
        if spec.enabled and spec.injection.enabled:
            self.guard.load(spec.runtime)

    async def __call__(self, ctx: RequestContext) -> None:
        policies = self._policies()
        spec = policies.guard_for(ctx.tenant)
        if not spec.enabled or not ctx.api.guarded(spec.embeddings):
            return
        verdicts: list[Verdict] = []
        if _scans_pii(spec) or spec.injection.enabled:
            if spec.injection.enabled:
                await self.guard.ensure(spec.runtime)
            big = self._offload.is_big(len(ctx.body), ctx.json_values)
            verdicts, scan = await self._offload.run(big, self._read, ctx, spec)
            if scan is not None:
                verdicts.append(await self._injection(scan, spec))
        for verdict in verdicts:
            self.guard.record(verdict, policies.version)
        for verdict in verdicts:
            if verdict.result == "block":
                raise GuardBlocked(verdict, policies.version, ctx.request_id)
        flagged = [v.header() for v in verdicts if v.result == "flag"]
        if flagged:
            ctx.response_headers[HEADER] = ", ".join(flagged)
        if spec.output.enabled and ctx.api.generates:
            answers = ctx.exchange.client_answers(ctx.payload)
            ctx.output_guard = OutputGuard(self.guard, spec, policies.version, ctx.request_id, answers)

    def _read(self, ctx: RequestContext, spec: GuardSpec) -> tuple[list[Verdict], Scan | None]:
        """Blocking: the request's texts, PII verdicts (redacting the payload), and the classifier's windows over
        the original texts; no windows when the injection classifier is off or a PII verdict already blocks."""
        scan_pii, injection = _scans_pii(spec), spec.injection.enabled
        roles = set(spec.pii.roles if scan_pii else ()) | set(spec.injection.roles if injection else ())
        texts = request_texts(ctx.api, ctx.payload, roles, self._decoder(ctx.model, spec))
        verdicts = self._pii(ctx, spec, selected(texts, spec.pii.roles)) if scan_pii else []
        if not injection or any(v.result == "block" for v in verdicts):
            return verdicts, None
        scanned = [t for t in selected(texts, spec.injection.roles) if t.text]
        policy = spec.injection
        return verdicts, (scanned, self.guard.windows([t.text for t in scanned], policy, policy.max_windows))

    def _decoder(self, model: str, spec: GuardSpec) -> Decode:
        def decode(ids: list[int], where: str) -> str | None:
            text = self._decode(model, ids)
            if text is None and spec.unknown_tokenizer == "refuse":
                raise GatewayError(
                    400,
                    f"{where} is token ids, and the gateway knows no tokenizer for model {model!r} to read "
                    "them with, so the guard cannot scan them: send the prompt as text",
                    code="prompt_unscannable",
                    param=where,
                )
            return text

        return decode

    async def _injection(self, scan: Scan, spec: GuardSpec) -> Verdict:
        texts, windows = scan
        score, index = await self.guard.score(windows)
        threshold = self.guard.threshold(spec.injection)
        result = spec.injection.action if score >= threshold else "pass"
        return Verdict(
            "input",
            "prompt_injection",
            "guard.injection",
            result,
            score,
            threshold,
            where=texts[index].where if result != "pass" and index >= 0 else None,
        )

    def _pii(self, ctx: RequestContext, spec: GuardSpec, texts: list[PromptText]) -> list[Verdict]:
        """Detector verdicts; `redact` rewrites the payload in place. Token-id prompts cannot be rewritten, so there
        redaction blocks."""
        policy = spec.pii
        types = policy.types or None
        verdicts: list[Verdict] = []
        for item in texts:
            findings = pii.find(item.text, types)
            if not findings:
                continue
            redact = []
            for kind, action in (("pii", policy.pii), ("secret", policy.secrets)):
                found = [f for f in findings if f.kind == kind]
                if not found or action == "off":
                    continue
                if action == "redact" and item.holder is None:
                    action = "block"
                found_types = sorted({f.type for f in found})
                verdicts.append(
                    Verdict(
                        "input", kind, f"guard.{kind}.{found_types[0]}", action, types=found_types, where=item.where
                    )
                )
                if action == "redact":
                    redact += found
            if redact and item.holder is not None:  # (no holder: redaction became a block above)
                holder: Any = item.holder  # a message, content part, payload or prompt list; item.key fits it
                holder[item.key] = pii.redact(item.text, sorted(redact, key=lambda f: f.start))
                ctx.payload_rewritten = True
        return verdicts


def _scans_pii(spec: GuardSpec) -> bool:
    return spec.pii.pii != "off" or spec.pii.secrets != "off"
