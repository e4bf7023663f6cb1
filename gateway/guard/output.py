"""The output guard: generated text scanned as it streams, behind a hold-back buffer; whole answers scanned at once.

What it reads: every string the client gets. The answer's format (gateway/apis/answers.py) names the channels of
the texts it knows (a choice, its reasoning, a refusal, a content part or block, a tool call's arguments or input,
a command), and every other string of every event, of a known event type or not, comes on an untrusted channel
(gateway/apis/untrusted.py): read the same way, never relayed unread. Identifiers (ids, types, statuses) and the keys
of every object are read for secrets once per distinct value, and a finding blocks: rewriting an id would break what
refers to it.

Streams: the relay hands each batch of complete SSE events to `feed()`, which returns the events that may go to the
client now. Text is released only after a scan has seen it together with what follows it: a scan runs when
`scan_every` new characters have arrived on a channel over the last ones plus some context, and the newest
`hold_back` characters stay held until the next scan, so a secret or an injected instruction that is still arriving
is not half-released. The end of a channel or of the stream scans the rest and releases everything; an untrusted
channel ends at the first event that does not add to it (so a field a server added to one event holds back only
until the next), and if a later event adds to it after all, the scan reads that with what was released before it.
Redaction rewrites the held events' text in place (typed placeholders); a block raises `GuardBlocked`, which the
relay turns into an explicit error event in the client's format — never a silent cut.

Logprobs (gateway/apis/logprobs.py) are read as the client rebuilds text from them: a text's tokens run together,
and their bytes decoded, on channels of their own that a stream's deltas add to; each alternative as an identifier.
A finding in them blocks, under `redact` too: an entry cannot be rewritten consistently with its figures.

Copies: some formats repeat a channel's whole text at its end (Responses' `*.done` events, the item's and the
response's copies). A copy that says what the pieces said is rewritten with the pieces' redactions; one that does
not (a secret in a `.done` after clean deltas) is scanned whole as a text of its own, and redacted or blocked.

A tool call's arguments (an `Arguments` channel) are JSON text an agent parses: the detectors read them as its parser
will (gateway/apis/decoded_json.py: `\\u0041KIA…` is a key, `\\n` a line break), a finding maps back to whole escape
sequences, so a redaction inside one string leaves the JSON valid, and one that does not lie inside one string (it
crosses a quote, or is a number) blocks instead. Hold-back counts the characters the client will decode, and an
escape sequence still arriving is never released before it is decoded and read. Every text is read folded and
unescaped as well (NFKC, invisible characters removed, character references and percent- and string escapes undone:
gateway/guard/folding.py) and a secret also in base64 (gateway/guard/pii.py); the classifier reads the folded text.
A whole answer's texts that its client reads one after another (a message's text blocks or a Response message's
parts in a row, the format's `read_after`) are also read joined; a stream's are not yet (its blocks end, and are
released, one at a time).
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field

from gateway.apis.answers import AnswerFormat, Arguments, Holder, Text
from gateway.apis.decoded_json import DecodedJson
from gateway.apis.logprobs import Logprobs, spelled
from gateway.apis.untrusted import Identifier, Place, Untrusted, place_of
from gateway.guard import pii
from gateway.guard.folding import folded
from gateway.guard.runtime import Guard, GuardBlocked, Verdict
from gateway.guard.spec import GuardSpec
from gateway.streaming.growing_text import GrowingText
from gateway.streaming.sse import event_parts, with_data

CONTEXT_CHARS = 512  # already-released text a scan re-reads before the new text
# what a stream's client gets outside its events' JSON: their lines other than data (a comment, an id, a name that is
# not the data's type); read, and never rewritten
UNPARSED = Untrusted("", "unparsed event")


@dataclass(frozen=True, slots=True)
class _Copy:
    """A copy of a channel's whole text that does not say what its pieces said: a text of its own."""

    of: Hashable
    number: int


@dataclass(slots=True)
class _Segment:
    channel: Hashable
    holder: Holder
    key: str | int
    start: int  # where the piece sits in its channel's text
    end: int


@dataclass(slots=True)
class _Held:
    event: bytes
    chunk: dict = field(default_factory=dict)  # the event's JSON object; {} for [DONE] and events that are not one
    segments: list[_Segment] = field(default_factory=list)
    snapshots: list[Text] = field(default_factory=list)


@dataclass
class _Channel:
    """A channel's text as the events carry it (offsets, redactions, what was scanned and released are in it), and,
    for JSON text, the text its parser reads (`decoded`), which the detectors and the hold-back count in."""

    text: GrowingText = field(default_factory=GrowingText)
    decoded: DecodedJson | None = None
    replaceable: bool = True  # a finding may be replaced by its placeholder (not in what no JSON holds)
    scanned: int = 0  # text[:scanned] has been scanned
    released: int = 0  # text[:released] has reached the client
    finished: bool = False
    redactions: list[pii.Finding] = field(default_factory=list)
    safe_at: tuple[int, int, int] = (-1, 0, 0)  # (scanned, hold_back, safe): JSON text's, mapped once per scan

    def append(self, piece: str) -> None:
        self.text.append(piece)
        if self.decoded is not None:
            self.decoded.append(piece)

    def complete(self) -> int:
        """How much of the text can be read: all of it, but an escape sequence still arriving."""
        return len(self.text) if self.decoded is None else self.decoded.consumed

    def view(self, start: int, end: int) -> tuple[str, int]:
        """What the client reads of text[start:end] (whole characters of it), and where that starts in the view."""
        if self.decoded is None:
            return self.text[start:end], start
        at = self.decoded.decoded_offset(start)
        return self.decoded.text[at : self.decoded.decoded_offset(end)], at

    def finding(self, found: pii.Finding, at: int) -> tuple[pii.Finding, bool]:
        """A finding in a view starting at `at`, in the text's offsets; and whether it can be replaced by other
        text (in JSON: it lies inside one string)."""
        start, end = found.start + at, found.end + at
        if self.decoded is None:
            return pii.Finding(found.type, found.kind, start, end), self.replaceable
        raw = pii.Finding(found.type, found.kind, self.decoded.raw_offset(start), self.decoded.raw_offset(end))
        return raw, self.decoded.in_one_string(start, end)

    def safe(self, hold_back: int) -> int:
        """How much may be released: what was scanned, less the hold-back (in what the client reads) until it ends."""
        if self.finished:
            return self.scanned
        if self.decoded is None:
            return self.scanned - hold_back
        if self.safe_at[:2] != (self.scanned, hold_back):
            safe = self.decoded.raw_offset(max(0, self.decoded.decoded_offset(self.scanned) - hold_back))
            self.safe_at = (self.scanned, hold_back, safe)
        return self.safe_at[2]


def _opened(channel: Hashable, text: str = "") -> _Channel:
    base = channel.of if isinstance(channel, _Copy) else channel
    replaceable = base != UNPARSED and not isinstance(base, Logprobs)
    state = _Channel(decoded=DecodedJson() if isinstance(base, Arguments) else None, replaceable=replaceable)
    state.append(text)
    return state


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
        self._growing: dict[Hashable, None] = {}  # the untrusted channels the last event added to
        self._identified: set[str] = set()  # the identifiers' values read so far
        self.verdicts: list[Verdict] = []
        self._recorded: set[tuple[str, str]] = set()

    # ---- streams -------------------------------------------------------------------------------------------
    async def feed(self, events: list[bytes]) -> list[bytes]:
        """Take complete SSE events; return those now safe to send (in order). Raises GuardBlocked."""
        done = False
        for event in events:
            data, fields = event_parts(event)
            chunk = _json(data) if data is not None else None
            held = _Held(event, chunk or {})
            if data is not None and self._answers.ends(data, chunk):
                done = True
            self._read(held, chunk or {}, _unparsed(chunk, fields))
            self._held.append(held)
        # only channels with new text: an answer may open thousands (a command's words each), and walking them all
        # for every event made the cost of a stream the product of the two
        due = []
        for channel in list(self._unscanned):
            state = self._channels[channel]
            new = state.complete() - state.scanned
            if not new:  # nothing new it can read yet
                del self._unscanned[channel]
            elif done or state.finished or new >= self._policy.scan_every:
                due.append((channel, state))
                del self._unscanned[channel]
        if due:
            await self._scan(due)
        return self._release(done)

    def _read(self, held: _Held, chunk: dict, unparsed: str) -> None:
        """Every string of one event onto its channel: the format's known texts, its copies, the rest of its
        strings, and its lines outside its JSON."""
        answers = self._answers
        known: set[Place] = set()
        for channel, holder, key in answers.texts(chunk):
            known.add(place_of(holder, key))
            self._append(held, channel, holder, key)
        for channel, holder, key in answers.snapshots(chunk):
            known.add(place_of(holder, key))
            self._snapshot(held, channel, holder, key)
        for channel in answers.ended(chunk):
            self._finish(channel)
        self._read_logprobs(held, chunk, known)
        growing: dict[Hashable, None] = {}
        for channel, holder, key in answers.untrusted(chunk, known, self._identified):
            if isinstance(channel, Identifier):
                self._identify(channel, holder[key])
                continue
            self._append(held, channel, holder, key)
            growing[channel] = None
        if unparsed:
            self._append(held, UNPARSED, {"text": unparsed}, "text")
            growing[UNPARSED] = None
        for channel in self._growing:
            if channel not in growing:
                self._finish(channel)
        for channel in growing:
            self._channels[channel].finished = False
        self._growing = growing

    def _read_logprobs(self, held: _Held, chunk: dict, known: set[Place]) -> None:
        """What an event's logprobs spell (gateway/apis/logprobs.py): a delta's on channels that run on across
        events, a whole copy's on channels that end with it; alternatives read as identifiers."""
        for where, value, grows in self._answers.logprobs(chunk):
            kind = chunk.get("type")
            for channel, text in spelled(kind if isinstance(kind, str) else "", where, value, known):
                if isinstance(channel, Identifier):
                    self._identify(channel, text)
                    continue
                self._append(held, channel, {"text": text}, "text")
                if not grows:
                    self._finish(channel)

    def _channel(self, channel: Hashable) -> _Channel:
        state = self._channels.get(channel)
        if state is None:
            state = self._channels[channel] = _opened(channel)
        return state

    def _append(self, held: _Held, channel: Hashable, holder: Holder, key: str | int) -> None:
        state = self._channel(channel)
        start = len(state.text)
        state.append(holder[key])
        held.segments.append(_Segment(channel, holder, key, start, len(state.text)))
        if len(state.text) > state.scanned:
            self._unscanned[channel] = None

    def _snapshot(self, held: _Held, channel: Hashable, holder: Holder, key: str | int) -> None:
        """A copy of a channel's whole text: its text if the channel had none (it arrives only whole); else redacted
        as the pieces were where it says what they said, and otherwise a text of its own, read whole now."""
        state = self._channels.get(channel)
        if state is None or not state.text:
            self._append(held, channel, holder, key)
        elif holder[key] == str(state.text):
            held.snapshots.append((channel, holder, key))
        else:
            copy = _Copy(channel, len(self._channels))
            self._append(held, copy, holder, key)
            self._finish(copy)

    def _finish(self, channel: Hashable) -> None:
        state = self._channel(channel)
        state.finished = True
        if state.complete() > state.scanned:
            self._unscanned[channel] = None

    async def _scan(self, due: list[tuple[Hashable, _Channel]]) -> None:
        """Scan each channel's new text with some of what came before it (the detectors), then all of it at once
        (the classifier: one batch for every channel due, the untrusted ones' texts run together into one: an
        answer of a million one-word fields costs the classifier its length, not a million windows)."""
        texts: list[tuple[str, str]] = []
        untrusted: list[tuple[str, str]] = []
        for channel, state in due:
            start = max(0, min(state.released, state.scanned) - CONTEXT_CHARS)
            end = state.complete()
            text, at = state.view(start, end)
            where = self._where(channel)
            self._detect(text, at, state, where)
            state.scanned = end
            if state.redactions:
                self._rewrite(channel, state)
            (untrusted if isinstance(channel, Untrusted) else texts).append((text, where))
        if untrusted:
            where = untrusted[0][1] if len(untrusted) == 1 else f"{untrusted[0][1]} and {len(untrusted) - 1} more"
            texts.append(("\n".join(text for text, _ in untrusted), where))
        await self._classify(texts)

    def _release(self, done: bool) -> list[bytes]:
        out: list[bytes] = []
        hold_back = self._policy.hold_back
        channels = self._channels
        while self._held:
            held = self._held[0]
            if not done:
                for segment in held.segments:  # a loop, not all(): the head is checked after every event
                    if segment.end > channels[segment.channel].safe(hold_back):
                        return out
            self._held.popleft()
            for segment in held.segments:
                state = channels[segment.channel]
                state.released = max(state.released, segment.end)
            if held.snapshots and any(channels[channel].redactions for channel, _, _ in held.snapshots):
                for channel, holder, key in held.snapshots:
                    state = self._channels[channel]
                    holder[key] = pii.redact(str(state.text), sorted(state.redactions, key=lambda f: f.start))
                held.event = with_data(held.event, json.dumps(held.chunk).encode())
            out.append(held.event)
        return out

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
        """Scan every string of a non-streaming answer; returns the (possibly redacted) body. Raises GuardBlocked.
        (A body that is no JSON object never gets here: the relay refuses it as a bad answer.)"""
        body = _json(content)
        if body is None:
            return content
        texts = list(self._answers.body_texts(body))
        known = {place_of(holder, key) for _, holder, key in texts}
        for where, value, _ in self._answers.logprobs(body):
            texts += ((channel, {"text": text}, "text") for channel, text in spelled("", where, value, known))
        texts += self._answers.untrusted(body, known, self._identified, whole=True)
        scans = []
        for channel, holder, key in texts:
            if isinstance(channel, Identifier):
                self._identify(channel, holder[key])
            elif holder[key]:
                state = _opened(channel, holder[key])
                state.finished = True
                scans.append((channel, state, holder, key))
        await self._scan([(channel, state) for channel, state, _, _ in scans])
        self._detect_across(scans)
        changed = False
        for _, state, holder, key in scans:
            if state.redactions:
                holder[key] = pii.redact(str(state.text), sorted(state.redactions, key=lambda f: f.start))
                changed = True
        return json.dumps(body).encode() if changed else content

    # ---- the checks ----------------------------------------------------------------------------------------
    def _where(self, channel: Hashable) -> str:
        if isinstance(channel, (Untrusted, Identifier)):
            return f"{channel.kind} {channel.path}" if channel.kind else channel.path
        return self._answers.where(channel.of if isinstance(channel, _Copy) else channel)

    def _detect_across(self, scans: list[tuple[Hashable, _Channel, Holder, str | int]]) -> None:
        """A whole answer's texts that its client reads one after another (a message's text blocks in a row): what
        only their join shows, as its piece in each (a key split across two blocks)."""
        policy, answers = self._policy, self._answers
        if policy.pii == "off" and policy.secrets == "off":
            return
        runs: list[list[tuple[Hashable, _Channel]]] = []
        for channel, state, _, _ in scans:
            if runs and answers.read_after(runs[-1][-1][0], channel):
                runs[-1].append((channel, state))
            else:
                runs.append([(channel, state)])
        for run in (run for run in runs if len(run) > 1):
            pieces = pii.find_across([str(state.text) for _, state in run], self._spec.pii.types or None)
            for (channel, state), found in zip(run, pieces):
                if found:
                    self._detect(str(state.text), 0, state, self._where(channel), found)

    def _detect(
        self, text: str, at: int, state: _Channel, where: str, findings: list[pii.Finding] | None = None
    ) -> None:
        """The secrets and PII detectors over a view of a channel's text that starts at `at` (or what they found
        there already)."""
        policy = self._policy
        if policy.pii == "off" and policy.secrets == "off":
            return
        if findings is None:
            findings = pii.find(text, self._spec.pii.types or None)
        known = {(f.start, f.end) for f in state.redactions}
        for kind, action in (("pii", policy.pii), ("secret", policy.secrets)):
            if action == "off":
                continue
            found = [state.finding(f, at) for f in findings if f.kind == kind]
            found = [(f, fits) for f, fits in found if (f.start, f.end) not in known]
            if not found:
                continue
            types = sorted({f.type for f, _ in found})
            if action == "redact" and any(_unredacted_from(f, state.redactions) < state.released for f, _ in found):
                action = "block"  # part of it already reached the client: refusing is the only honest option
            if action == "redact" and not all(fits for _, fits in found):
                action = "block"  # it crosses a JSON string's quote (or is a number): redacting would break the JSON
            self._verdict(Verdict("output", kind, f"guard.output.{kind}.{types[0]}", action, types=types, where=where))
            if action == "redact":
                state.redactions = _merged(state.redactions, [f for f, _ in found])

    def _identify(self, channel: Identifier, value: str) -> None:
        """An identifier's value (an id, a model, a status), read once: a secret in it blocks, as rewriting it would
        break what refers to it. PII is not looked for: a user's id may well be an address, and it is their own."""
        policy = self._policy
        if policy.secrets == "off" or value in self._identified:
            return
        self._identified.add(value)
        types = sorted({f.type for f in pii.find(value, self._spec.pii.types or None) if f.kind == "secret"})
        if types:
            action = "block" if policy.secrets == "redact" else policy.secrets
            rule = f"guard.output.secret.{types[0]}"
            self._verdict(Verdict("output", "secret", rule, action, types=types, where=self._where(channel)))

    async def _classify(self, texts: list[tuple[str, str]]) -> None:
        """The injection classifier over texts (with where each is), as their reader sees them (folded)."""
        policy = self._policy
        read = [(folded(text), where) for text, where in texts if text.strip()]
        if policy.injection == "off" or not read:
            return
        score, index = await self._guard.classify(
            [text for text, _ in read], self._spec.injection, self._spec.runtime, target="output"
        )
        threshold = self._guard.threshold(self._spec.injection)
        if score >= threshold:
            where = read[index][1] if 0 <= index < len(read) else read[0][1]
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


def _unparsed(chunk: dict | None, fields: list[bytes]) -> str:
    """The text of an event that no format reads: its lines other than its data (a comment, an id, a name that is
    not its data's type), less the `event:` line that names its data's type. (Data that is no event of the route's
    never gets here: the relay ends the stream at it.)"""
    if not fields:
        return ""
    kind = chunk.get("type") if chunk is not None else None
    named = b"event: " + kind.encode() if isinstance(kind, str) else None
    if fields[0] == named and len(fields) == 1:  # the typed stream's event, no more than its name
        return ""
    lines = [line for line in fields if line != named]
    return b"\n".join(lines).decode("utf-8", "replace") if lines else ""


def _json(data: bytes) -> dict | None:
    try:
        value = json.loads(data)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None
