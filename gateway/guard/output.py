"""The output guard: generated text scanned as it streams, behind a hold-back buffer; whole answers scanned at once.

Streams: the relay hands each batch of complete SSE events to `feed()`, which returns the events that may go to the
client now. Text is released only after a scan has seen it together with what follows it: a scan runs when
`scan_every` new characters have arrived (over the last ones plus some context), and the newest `hold_back`
characters stay held until the next scan, so a secret or an injected instruction that is still arriving is not
half-released. The end of a choice (`finish_reason`) or `[DONE]` scans the rest and releases everything. Redaction
rewrites the held events' text in place (typed placeholders); a block raises `GuardBlocked`, which the relay turns into
an explicit SSE error event with the verdict and `[DONE]` — never a silent cut.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gateway.guard import pii
from gateway.guard.runtime import Guard, GuardBlocked, Verdict
from gateway.guard.spec import GuardSpec
from gateway.sse import event_data

if TYPE_CHECKING:
    pass

CONTEXT_CHARS = 512  # already-released text a scan re-reads before the new text


@dataclass
class _Held:
    event: bytes
    chunk: dict = field(default_factory=dict)  # the event's JSON object; {} for [DONE] and events that are not one
    segments: list[tuple[int, str, int, int]] = field(default_factory=list)  # (choice index, key, start, end)


@dataclass
class _Choice:
    text: str = ""
    scanned: int = 0  # text[:scanned] has been scanned
    released: int = 0  # text[:released] has reached the client
    finished: bool = False
    redactions: list[pii.Finding] = field(default_factory=list)


class OutputGuard:
    def __init__(self, guard: Guard, spec: GuardSpec, policy_version: str, request_id: str, route: str) -> None:
        self._guard = guard
        self._spec = spec
        self._policy = spec.output
        self._version = policy_version
        self._request_id = request_id
        self._route = route
        self._held: list[_Held] = []
        self._choices: dict[int, _Choice] = {}
        self.verdicts: list[Verdict] = []
        self._recorded: set[tuple[str, str]] = set()

    # ---- streams -------------------------------------------------------------------------------------------
    async def feed(self, events: list[bytes]) -> list[bytes]:
        """Take complete SSE events; return those now safe to send (in order). Raises GuardBlocked."""
        done = False
        for event in events:
            data = event_data(event)
            if data == b"[DONE]":
                done = True
                self._held.append(_Held(event))
                continue
            held = _Held(event, (_json(data) if data is not None else None) or {})
            for index, choice in enumerate(held.chunk.get("choices") or ()):
                if not isinstance(choice, dict):
                    continue
                number = choice.get("index", index)
                state = self._choices.setdefault(number, _Choice())
                holder, key = _text_holder(choice)
                if holder is not None:
                    start = len(state.text)
                    state.text += holder[key]
                    held.segments.append((index, key, start, len(state.text)))
                if choice.get("finish_reason"):
                    state.finished = True
            self._held.append(held)
        for number, state in self._choices.items():
            final = done or state.finished
            if len(state.text) - state.scanned >= self._policy.scan_every or (
                final and state.scanned < len(state.text)
            ):
                await self._scan(number, state)
        return self._release(done)

    async def _scan(self, number: int, state: _Choice) -> None:
        start = max(0, min(state.released, state.scanned) - CONTEXT_CHARS)
        end = len(state.text)
        text = state.text[start:end]
        await self._check(text, offset=start, state=state, where=f"choices[{number}]")
        state.scanned = end
        if any(f for f in state.redactions):
            self._rewrite(number, state)

    def _release(self, done: bool) -> list[bytes]:
        out: list[bytes] = []
        while self._held:
            held = self._held[0]
            if not done:
                ready = True
                for index, _key, _start, end in held.segments:
                    state = self._choice_of(held, index)
                    safe = state.scanned if state.finished else state.scanned - self._policy.hold_back
                    if end > safe:
                        ready = False
                        break
                if not ready:
                    break
            self._held.pop(0)
            for index, _key, _start, end in held.segments:
                state = self._choice_of(held, index)
                state.released = max(state.released, end)
            out.append(held.event)
        return out

    def _choice_of(self, held: _Held, index: int) -> _Choice:
        choice = held.chunk["choices"][index]
        return self._choices[choice.get("index", index)]

    def _rewrite(self, number: int, state: _Choice) -> None:
        """Re-render held events of this choice from the original text minus every redaction so far."""
        findings = sorted(state.redactions, key=lambda f: f.start)
        for held in self._held:
            touched = False
            for index, key, start, end in held.segments:
                choice = held.chunk["choices"][index]
                if choice.get("index", index) != number:
                    continue
                if not any(f.start < end and start < f.end for f in findings):
                    continue
                holder, _ = _text_holder(choice)
                assert holder is not None, "a segment is recorded only for a choice that holds text"
                holder[key] = _redacted_segment(state.text, start, end, findings)
                touched = True
            if touched:
                held.event = b"data: " + json.dumps(held.chunk).encode() + b"\n\n"

    # ---- whole answers -------------------------------------------------------------------------------------
    async def check_body(self, content: bytes) -> bytes:
        """Scan a non-streaming answer's choices; returns the (possibly redacted) body. Raises GuardBlocked."""
        body = _json(content)
        if body is None:
            return content
        changed = False
        for index, choice in enumerate(body.get("choices") or ()):
            if not isinstance(choice, dict):
                continue
            holder, key = _text_holder(choice)
            if holder is None or not holder[key]:
                continue
            state = _Choice(text=holder[key])
            await self._check(state.text, offset=0, state=state, where=f"choices[{index}]")
            if state.redactions:
                holder[key] = pii.redact(state.text, sorted(state.redactions, key=lambda f: f.start))
                changed = True
        return json.dumps(body).encode() if changed else content

    # ---- the checks ----------------------------------------------------------------------------------------
    async def _check(self, text: str, *, offset: int, state: _Choice, where: str) -> None:
        policy = self._policy
        if policy.pii != "off" or policy.secrets != "off":
            known = {(f.start, f.end) for f in state.redactions}
            for kind, action in (("pii", policy.pii), ("secret", policy.secrets)):
                if action == "off":
                    continue
                found = [f for f in pii.find(text, self._spec.pii.types or None) if f.kind == kind]
                found = [pii.Finding(f.type, f.kind, f.start + offset, f.end + offset) for f in found]
                found = [f for f in found if (f.start, f.end) not in known]
                if not found:
                    continue
                types = sorted({f.type for f in found})
                if action == "redact" and any(f.start < state.released for f in found):
                    action = "block"  # part of it already reached the client: refusing is the only honest option
                self._verdict(
                    Verdict("output", kind, f"guard.output.{kind}.{types[0]}", action, types=types, where=where)
                )
                if action == "redact":
                    state.redactions += found
        if policy.injection != "off" and text.strip():
            score, _ = await self._guard.classify([text], self._spec.injection, self._spec.runtime, target="output")
            threshold = self._guard.threshold(self._spec.injection)
            if score >= threshold:
                self._verdict(
                    Verdict(
                        "output",
                        "prompt_injection",
                        "guard.output.injection",
                        policy.injection,
                        score,
                        threshold,
                        where=where,
                    )
                )

    def _verdict(self, verdict: Verdict) -> None:
        key = (verdict.rule, verdict.result)
        if key not in self._recorded:
            self._recorded.add(key)
            self.verdicts.append(verdict)
            self._guard.record(verdict, self._version)
        if verdict.result == "block":
            raise GuardBlocked(verdict, self._version, self._request_id)


def _text_holder(choice: dict) -> tuple[dict | None, str]:
    """The dict and key holding a choice's text: delta.content, message.content or text."""
    for outer in ("delta", "message"):
        inner = choice.get(outer)
        if isinstance(inner, dict) and isinstance(inner.get("content"), str):
            return inner, "content"
    if isinstance(choice.get("text"), str):
        return choice, "text"
    return None, ""


def _redacted_segment(text: str, start: int, end: int, findings: list[pii.Finding]) -> str:
    """text[start:end] with each finding's first character replaced by its placeholder and the rest removed."""
    out, pos = [], start
    for f in findings:
        if f.end <= start or f.start >= end:
            continue
        if f.start > pos:
            out.append(text[pos : f.start])
        if f.start >= start:
            out.append(f.placeholder())
        pos = max(pos, min(f.end, end))
    out.append(text[pos:end])
    return "".join(out)


def _json(data: bytes) -> dict | None:
    try:
        value = json.loads(data)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None
