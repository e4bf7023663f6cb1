"""Guard stage: PII/secrets and the prompt-injection classifier on the request's messages, after admission.

The guard reads the request's content inventory (gateway/apis/inventory.py): which provenances are scanned is policy
(`spec.guard.injection.roles`, `spec.guard.pii.roles`, default all); role-less prompts and unknown content are always
scanned, token-id prompts decoded with the model's tokenizer (gateway/guard/inputs.py); every text is read as its
reader sees it (gateway/guard/folding.py). The classifier reads each carrier's texts as one passage (a message, a
block, a document, a tool call's arguments) and judges each by its provenance's threshold and action
(`injection.provenances`). It judges the text as the client sent it: redaction is for what goes upstream, and a
`[REDACTED:EMAIL]` marker must not be what decides whether a prompt is an attack. Content the request's shape does
not classify is refused (400 `unknown_content`) where the policy says `unknown_content: refuse`, even with the guard
off. Blocks are OpenAI-shaped 400s with `code: prompt_blocked`, the rule id in
`param` and the verdict in `error.guard`; `flag` serves the request with an `x-portcullis-guard` response header;
`monitor` only records. Input the guard cannot scan whole is refused, never served unscanned: token ids of a model
whose tokenizer is unknown (400, unless the policy passes them), text holding more than `max_tokens` and a scan
that would spend more than `cpu_budget` of classifier time (413). A scan stops at the first passage whose finding
blocks (gateway/guard/scan.py). When the policy turns the output guard on, the stage leaves an `OutputGuard` on the
context for the upstream relay.

Reading, detecting and tokenizing a big body run on the offload executor; the classifier runs on the micro-batcher's
threads: neither holds the event loop. Off (the default), the stage costs one policy lookup per request.
"""

from __future__ import annotations

from collections.abc import Callable

from gateway.apis.inventory import Carried, Passage, passages, runs
from gateway.context import RequestContext
from gateway.edge.offload import Offload
from gateway.errors import GatewayError
from gateway.guard import pii
from gateway.guard.inputs import Decode, request_texts, selected
from gateway.guard.output import OutputGuard
from gateway.guard.runtime import HEADER, Guard, GuardBlocked, Verdict, Windows
from gateway.guard.spec import GuardSpec, InjectionPolicy
from gateway.policy.loader import PolicySet

# (the passages the classifier scans, their windows)
Scan = tuple[list[Passage], Windows]
# what a finding does, most severe first: the verdict of each that happened is recorded
_SEVERITY = ("block", "redact", "flag", "monitor")
REDACTED_INJECTION = "[REDACTED:PROMPT_INJECTION]"


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

    def applies(self, policies: PolicySet) -> bool:
        """Whether any tenant's guard reads requests or refuses unknown content: where none does, the pipeline leaves
        this stage out (gateway/pipeline.py's `Conditional`). A tenant without an overlay has the base's guard."""
        specs = [policies.guard_for(None), *(policies.guard_for(tenant) for tenant in policies.overlays)]
        return any(spec.enabled or spec.unknown_content == "refuse" for spec in specs)

    async def __call__(self, ctx: RequestContext) -> None:
        policies = self._policies()
        spec = policies.guard_for(ctx.tenant)
        if await self.check_input(ctx, policies) and spec.output.enabled and ctx.api.generates:
            answers = ctx.exchange.client_answers(ctx.payload)
            ctx.output_guard = OutputGuard(self.guard, spec, policies.version, ctx.request_id, answers)

    async def check_input(self, ctx: RequestContext, policies: PolicySet) -> bool:
        """The input side, as the tenant's policy says: raises its refusal, records its verdicts, flags and redacts
        (`payload_rewritten`); whether the guard reads this request at all. A batch's requests are read by it one by
        one too (gateway/tenancy/batch_requests.py)."""
        spec = policies.guard_for(ctx.tenant)
        if spec.unknown_content == "refuse":
            await self._offload.run(self._offload.is_big(len(ctx.body), ctx.json_values), refuse_unknown, ctx)
        if not spec.enabled or not ctx.api.guarded(spec.embeddings):
            return False
        verdicts: list[Verdict] = []
        if _scans_pii(spec) or spec.injection.enabled:
            if spec.injection.enabled:
                await self.guard.ensure(spec.runtime)
            big = self._offload.is_big(len(ctx.body), ctx.json_values)
            verdicts, scan = await self._offload.run(big, self._read, ctx, spec)
            if scan is not None:
                verdicts += await self._injection(ctx, scan, spec)
        for verdict in verdicts:
            self.guard.record(verdict, policies.version)
        for verdict in verdicts:
            if verdict.result == "block":
                raise GuardBlocked(verdict, policies.version, ctx.request_id)
        flagged = [v.header() for v in verdicts if v.result == "flag"]
        if flagged:
            ctx.response_headers[HEADER] = ", ".join(flagged)
        return True

    def _read(self, ctx: RequestContext, spec: GuardSpec) -> tuple[list[Verdict], Scan | None]:
        """Blocking: the request's texts, PII verdicts (redacting the payload), and the classifier's windows over
        the original texts; no windows when the injection classifier is off or a PII verdict already blocks."""
        scan_pii, injection = _scans_pii(spec), spec.injection.enabled
        roles = set(spec.pii.roles if scan_pii else ()) | set(spec.injection.roles if injection else ())
        texts = request_texts(ctx.content(), roles, self._decoder(ctx.model, spec))
        read = [t for t in selected(texts, spec.injection.roles) if t.text]
        scanned = passages(read, ctx.content().runs) if injection else []
        originals = [p.text for p in scanned]  # read before redaction rewrites them
        verdicts = self._pii(ctx, spec, selected(texts, spec.pii.roles)) if scan_pii else []
        if not injection or any(v.result == "block" for v in verdicts):
            return verdicts, None
        policy = spec.injection
        return verdicts, (scanned, self.guard.windows(originals, policy, policy.max_tokens, tenant=ctx.tenant))

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

    async def _injection(self, ctx: RequestContext, scan: Scan, spec: GuardSpec) -> list[Verdict]:
        """Each passage judged by its provenance's threshold and action: a verdict for the highest-scoring passage of
        each result that happened (one `pass` verdict when none did); `redact` rewrites the passages it finds."""
        scanned, windows = scan
        policy = spec.injection
        decisions = [self._decision(policy, passage) for passage in scanned]
        blocks = [threshold if result == "block" else None for threshold, result in decisions]
        scores = await self.guard.text_scores(windows, budget=policy.cpu_budget, blocks=blocks)
        found: dict[str, tuple[float, float, Passage]] = {}
        best: tuple[float, float] = (0.0, self.guard.threshold(policy))
        redacted: list[Passage] = []
        for passage, score, (threshold, result) in zip(scanned, scores, decisions):
            if score > best[0]:
                best = (score, threshold)
            if score < threshold:
                continue
            if result == "redact":
                redacted.append(passage)
            if result not in found or score > found[result][0]:
                found[result] = (score, threshold, passage)
        for passage in redacted if "block" not in found else ():
            for part in passage.parts:
                part.rewrite(REDACTED_INJECTION)
            ctx.payload_rewritten = True
        if not found:
            return [Verdict("input", "prompt_injection", "guard.injection", "pass", best[0], best[1])]
        return [
            Verdict(
                "input",
                "prompt_injection",
                "guard.injection",
                result,
                score,
                threshold,
                where=passage.where,
                provenance=passage.provenance,
            )
            for result in _SEVERITY
            if result in found
            for score, threshold, passage in (found[result],)
        ]

    def _decision(self, policy: InjectionPolicy, passage: Passage) -> tuple[float, str]:
        """(threshold, result) of a finding in this passage: its provenance's, else the policy's; redaction of a
        token-id prompt, which cannot be rewritten, blocks."""
        decision = policy.provenances.get(passage.provenance)
        threshold = self.guard.threshold(policy, decision.threshold if decision else None)
        result = (decision.action if decision else None) or policy.action
        if result == "redact" and any(part.holder is None for part in passage.parts):
            result = "block"
        return threshold, result

    def _pii(self, ctx: RequestContext, spec: GuardSpec, texts: list[Carried]) -> list[Verdict]:
        """Detector verdicts (the detectors read each text folded, unescaped and decoded too, gateway/guard/pii.py,
        and the texts of a message's content parts joined as well, gateway/apis/inventory.py `runs`); `redact`
        rewrites the payload in place, through the inventory. Token-id prompts cannot be rewritten, so there
        redaction blocks."""
        policy = spec.pii
        types = policy.types or None
        verdicts: list[Verdict] = []
        found_in = {id(item): pii.find(item.text, types) for item in texts}
        for parts in runs(texts, ctx.content().runs):  # parts read one after another: what only their join shows
            for item, pieces in zip(parts, pii.find_across([part.text for part in parts], types)):
                own = found_in[id(item)]
                own += [p for p in pieces if not any(p.start < f.end and f.start < p.end for f in own)]
        for item in texts:
            text = item.text
            findings = sorted(found_in[id(item)], key=lambda f: f.start)
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
                        "input",
                        kind,
                        f"guard.{kind}.{found_types[0]}",
                        action,
                        types=found_types,
                        where=item.where,
                        provenance=item.provenance or "unknown",
                    )
                )
                if action == "redact":
                    redact += found
            if redact and item.holder is not None:  # (no holder: redaction became a block above)
                item.rewrite(pii.redact(text, sorted(redact, key=lambda f: f.start)))
                ctx.payload_rewritten = True
        return verdicts


def refuse_unknown(ctx: RequestContext) -> None:
    """400 `unknown_content` naming the first place that holds content the request's shape does not classify."""
    unknown = ctx.content().unknown()
    if unknown:
        where = unknown[0].where
        raise GatewayError(
            400,
            f"{where} is content the gateway does not know how to read for {ctx.api.path}, and the policy refuses "
            "unknown content (guard.unknown_content: refuse)",
            code="unknown_content",
            param=where,
        )


def _scans_pii(spec: GuardSpec) -> bool:
    return spec.pii.pii != "off" or spec.pii.secrets != "off"
