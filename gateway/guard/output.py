"""The output guard: generated text scanned as it streams, behind a hold-back buffer; whole answers scanned at once.

Streams: the relay hands each batch of complete SSE events to `feed()`, which returns the events that may go to the
client now. Text is released only after a scan has seen it together with what follows it: a scan runs when
`scan_every` new characters have arrived on a channel (a choice, its reasoning, a content part or block: the
answer's format says, gateway/apis/answers.py) over the last ones plus some context, and the newest `hold_back`
characters stay held until the next scan, so a secret or an injected instruction that is still arriving is not
half-released. The end of a channel or of the stream scans the rest and releases everything. Redaction rewrites the
held events' text in place (typed placeholders), and the copies of a channel's whole text that some formats repeat
at its end (Responses' `*.done` events and final response) as well; a block raises `GuardBlocked`, which the relay
turns into an explicit error event in the client's format — never a silent cut.

A tool call's arguments (an `Arguments` channel) are JSON text an agent parses: the detectors read them with each
escape sequence blanked out, so `\\nAKIA...` still starts a key and a finding never cuts an escape in two, and a
finding that crosses a string's quote blocks instead of being redacted, so a redaction leaves the JSON valid.
"""

from __future__ import annotations

import json
import re
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field

from gateway.apis.answers import AnswerFormat, Arguments, Holder, Text
from gateway.growing_text import GrowingText
from gateway.guard import pii
from gateway.guard.runtime import Guard, GuardBlocked, Verdict
from gateway.guard.spec import GuardSpec
from gateway.sse import event_data, with_data

CONTEXT_CHARS = 512  # already-released text a scan re-reads before the new text


@dataclass(slots=True)
class _Segment:
    channel: Hashable
    holder: Holder
    key: str | int
    start: int  # where the piece sits in its channel's text
    end: int


@dataclass
class _Held:
    event: bytes
    chunk: dict = field(default_factory=dict)  # the event's JSON object; {} for [DONE] and events that are not one
    segments: list[_Segment] = field(default_factory=list)
    snapshots: list[Text] = field(default_factory=list)


@dataclass
class _Channel:
    text: GrowingText = field(default_factory=GrowingText)
    scanned: int = 0  # text[:scanned] has been scanned
    released: int = 0  # text[:released] has reached the client
    finished: bool = False
    redactions: list[pii.Finding] = field(default_factory=list)
    json: bool = False  # JSON text (a tool call's arguments): redactions must leave it JSON


def _opened(channel: Hashable, text: str = "") -> _Channel:
    return _Channel(text=GrowingText(text), json=isinstance(channel, Arguments))


class OutputGuard:
    def __init__(
        self, guard: Guard, spec: GuardSpec, policy_version: str, request_id: str, answers: AnswerFormat
    ) -> None:
        self._guard = guard
        self._answers = answers.for_stream()  # the upstream's format: where its text is
        self._spec = spec
        self._policy = spec.output
        self._version = policy_version
        self._request_id = request_id
        self._held: deque[_Held] = deque()
        self._channels: dict[Hashable, _Channel] = {}
        self._unscanned: dict[Hashable, None] = {}  # the channels with text not scanned yet, in order
        self.verdicts: list[Verdict] = []
        self._recorded: set[tuple[str, str]] = set()

    # ---- streams -------------------------------------------------------------------------------------------
    async def feed(self, events: list[bytes]) -> list[bytes]:
        """Take complete SSE events; return those now safe to send (in order). Raises GuardBlocked."""
        answers = self._answers
        done = False
        for event in events:
            data = event_data(event)
            chunk = (_json(data) if data is not None else None) or {}
            held = _Held(event, chunk)
            if data is not None and answers.ends(data, chunk or None):
                done = True
            for channel, holder, key in answers.texts(chunk):
                self._append(held, channel, holder, key)
            for channel, holder, key in answers.snapshots(chunk):
                if channel in self._channels and self._channels[channel].text:
                    held.snapshots.append((channel, holder, key))
                else:  # the channel's text arrives only whole: read it as its text
                    self._append(held, channel, holder, key)
            for channel in answers.ended(chunk):
                self._channel(channel).finished = True
            self._held.append(held)
        # only channels with new text: an answer may open thousands (a command's words each), and walking them all
        # for every event made the cost of a stream the product of the two
        for channel in list(self._unscanned):
            state = self._channels[channel]
            final = done or state.finished
            if len(state.text) - state.scanned >= self._policy.scan_every or final:
                await self._scan(channel, state)
                del self._unscanned[channel]
        return self._release(done)

    def _channel(self, channel: Hashable) -> _Channel:
        if channel not in self._channels:
            self._channels[channel] = _opened(channel)
        return self._channels[channel]

    def _append(self, held: _Held, channel: Hashable, holder: Holder, key: str | int) -> None:
        state = self._channel(channel)
        start = len(state.text)
        state.text.append(holder[key])
        held.segments.append(_Segment(channel, holder, key, start, len(state.text)))
        if len(state.text) > state.scanned:
            self._unscanned[channel] = None

    async def _scan(self, channel: Hashable, state: _Channel) -> None:
        start = max(0, min(state.released, state.scanned) - CONTEXT_CHARS)
        end = len(state.text)
        await self._check(state.text[start:end], offset=start, state=state, where=self._answers.where(channel))
        state.scanned = end
        if state.redactions:
            self._rewrite(channel, state)

    def _release(self, done: bool) -> list[bytes]:
        out: list[bytes] = []
        while self._held:
            held = self._held[0]
            if not done and not all(s.end <= self._safe(self._channels[s.channel]) for s in held.segments):
                break
            self._held.popleft()
            for segment in held.segments:
                state = self._channels[segment.channel]
                state.released = max(state.released, segment.end)
            if any(self._channels[channel].redactions for channel, _, _ in held.snapshots):
                for channel, holder, key in held.snapshots:
                    state = self._channels[channel]
                    holder[key] = pii.redact(str(state.text), sorted(state.redactions, key=lambda f: f.start))
                held.event = with_data(held.event, json.dumps(held.chunk).encode())
            out.append(held.event)
        return out

    def _safe(self, state: _Channel) -> int:
        """How much of a channel's text may be released: what was scanned, less the hold-back until it ends."""
        return state.scanned if state.finished else state.scanned - self._policy.hold_back

    def _rewrite(self, channel: Hashable, state: _Channel) -> None:
        """Re-render held events of this channel from the original text minus every redaction so far."""
        findings = sorted(state.redactions, key=lambda f: f.start)
        for held in self._held:
            touched = False
            for s in held.segments:
                if s.channel == channel and any(f.start < s.end and s.start < f.end for f in findings):
                    s.holder[s.key] = _redacted_segment(state.text, s.start, s.end, findings)
                    touched = True
            if touched:
                held.event = with_data(held.event, json.dumps(held.chunk).encode())

    # ---- whole answers -------------------------------------------------------------------------------------
    async def check_body(self, content: bytes) -> bytes:
        """Scan a non-streaming answer's texts; returns the (possibly redacted) body. Raises GuardBlocked."""
        body = _json(content)
        if body is None:
            return content
        changed = False
        for channel, holder, key in self._answers.body_texts(body):
            if not holder[key]:
                continue
            state = _opened(channel, holder[key])
            await self._check(holder[key], offset=0, state=state, where=self._answers.where(channel))
            if state.redactions:
                holder[key] = pii.redact(holder[key], sorted(state.redactions, key=lambda f: f.start))
                changed = True
        return json.dumps(body).encode() if changed else content

    # ---- the checks ----------------------------------------------------------------------------------------
    async def _check(self, text: str, *, offset: int, state: _Channel, where: str) -> None:
        policy = self._policy
        if state.json:
            text = _json_view(state.text, offset, offset + len(text))
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
                if action == "redact" and any(_unredacted_from(f, state.redactions) < state.released for f in found):
                    action = "block"  # part of it already reached the client: refusing is the only honest option
                if (
                    action == "redact"
                    and state.json
                    and any('"' in text[f.start - offset : f.end - offset] for f in found)
                ):
                    action = "block"  # it crosses a string's quote: redacting it would break the JSON
                self._verdict(
                    Verdict("output", kind, f"guard.output.{kind}.{types[0]}", action, types=types, where=where)
                )
                if action == "redact":
                    state.redactions = _merged(state.redactions, found)
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


def _unredacted_from(finding: pii.Finding, redactions: list[pii.Finding]) -> int:
    """Where a finding's text stops being covered by the redactions it overlaps (its start, if none)."""
    covered = [r.end for r in redactions if r.start <= finding.start < r.end]
    return max(covered, default=finding.start)


def _merged(redactions: list[pii.Finding], found: list[pii.Finding]) -> list[pii.Finding]:
    """Redactions with the new findings added; one that overlaps an earlier one is the same value seen whole now
    (a scan ended inside an address, the next one saw the rest): it extends that one, so it gets one placeholder."""
    out = list(redactions)
    for new in found:
        near = [r for r in out if r.start < new.end and new.start < r.end]
        if near:
            out = [r for r in out if r not in near]
            new = pii.Finding(
                near[0].type, new.kind, min(new.start, *(r.start for r in near)), max(new.end, *(r.end for r in near))
            )
        out.append(new)
    return out


def _redacted_segment(text: GrowingText, start: int, end: int, findings: list[pii.Finding]) -> str:
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


_ESCAPE = re.compile(r"\\(?:u[0-9A-Fa-f]{0,4}|.)?", re.DOTALL)  # one JSON escape sequence (or its start, mid-stream)


def _json_view(text: GrowingText, start: int, end: int) -> str:
    """text[start:end], a stretch of JSON text, with each escape sequence blanked out (spaces, same length): a
    detector sees the word boundary a `\\n` stands for, and its finding starts and ends outside escapes. The
    parse starts far enough back (an escape is 6 characters at most) to know which backslashes start one."""
    lo = max(0, start - 5)
    while lo and text[lo - 1] == "\\":
        lo -= 1
    return _ESCAPE.sub(lambda m: " " * len(m.group()), text[lo:end])[start - lo :]


def _json(data: bytes) -> dict | None:
    try:
        value = json.loads(data)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None
