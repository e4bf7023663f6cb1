"""Server-sent-event framing for the streaming relay: complete events out, byte for byte, as soon as they arrive.

An event ends at a blank line, and a line may end in CRLF, LF or CR (the SSE specification allows all three, mixed).
The framer keeps its scan position between chunks, so a stream costs time linear in its length however it is
chunked, and it holds at most one unfinished event, never more than `max_event_bytes` of it.

`read_event` reads a framed event as a client will, and refuses one that is not SSE at all: an event is relayed
byte for byte, so what the gateway read of it (its type, its data) must be all that any client's parser reads.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

_LINE_END = re.compile(rb"[\r\n]")
_LINE = re.compile(rb"\r\n|\n|\r")
_FIELDS = (b"data", b"event", b"id", b"retry")  # the fields the SSE specification gives a meaning

DONE = b"data: [DONE]\n\n"
BOM = b"\xef\xbb\xbf"  # UTF-8's byte order mark


class EventTooLarge(Exception):
    """An upstream event grew past the framer's limit: the stream cannot be relayed event by event."""


class MalformedEvent(Exception):
    """An upstream event that no client could read as the event the gateway read: not SSE, or data that is none of
    the route's events. Relayed, it would reach the client as bytes the gateway never judged."""


class EventFramer:
    """Splits an SSE byte stream into whole events (each ending in its blank line), however the bytes were chunked.

    Events are emitted byte for byte: their concatenation is the stream, less a BOM that starts it (the SSE
    specification has a reader ignore it; kept, it would hide the first event's first field, its data). A CR that
    ends an event as the last byte of a chunk is emitted at once (the event is complete); when the next chunk starts
    with the LF of that CRLF, the LF leads the next event, where it parses as nothing.
    """

    def __init__(self, max_event_bytes: int | None = None) -> None:
        self._max = max_event_bytes
        self._pending = bytearray()
        self._scanned = 0  # bytes of _pending already looked at
        self._line_start = 0  # where the current line begins in _pending
        self._cr_at: int | None = None  # position of the last CR line end (-1: the byte just before _pending)
        self._head: bytes | None = b""  # the stream's first bytes while they may still be a BOM; None after

    def feed(self, data: bytes) -> list[bytes]:
        if self._head is not None:
            data = self._head + data
            if BOM.startswith(data):  # all a BOM so far, or nothing yet: wait for the bytes that decide
                self._head = data
                return []
            self._head = None
            data = data.removeprefix(BOM)
        buffer = self._pending
        buffer += data
        events, start = [], 0
        position = self._scanned
        while match := _LINE_END.search(buffer, position):
            at = match.start()
            position = at + 1
            if buffer[at] == 0x0A and self._cr_at == at - 1:  # the LF of a CRLF: the line ended at its CR
                self._line_start = position
                continue
            self._cr_at = at if buffer[at] == 0x0D else None
            if at != self._line_start:  # a line with content ends; the event goes on
                self._line_start = position
                continue
            if self._cr_at is not None and position < len(buffer) and buffer[position] == 0x0A:
                position += 1  # the blank line's CRLF is whole here: keep it with its event
                self._cr_at = None
            events.append(self._checked(buffer[start:position]))
            start = self._line_start = position
        if start:
            del buffer[:start]
            self._line_start -= start
            if self._cr_at is not None:
                self._cr_at -= start
        self._scanned = len(buffer)
        self._check_size(len(buffer))
        return events

    def _checked(self, event: bytearray) -> bytes:
        self._check_size(len(event))
        return bytes(event)

    def _check_size(self, size: int) -> None:
        if self._max is not None and size > self._max:
            raise EventTooLarge(f"an upstream event exceeded {self._max} bytes")

    @property
    def pending(self) -> bytes:
        """Bytes of an event the stream has not finished."""
        return (self._head or b"") + bytes(self._pending)


def event_data(event: bytes) -> bytes | None:
    """The event's `data` field (multi-line data joined by newlines), or None for comments and data-less events."""
    return event_parts(event)[0]


def event_parts(event: bytes) -> tuple[bytes | None, list[bytes]]:
    """The event's `data` field (as `event_data` reads it) and its other lines (`event:`, `id:`, comments)."""
    data, other = [], []
    for line in event.split(b"\n") if b"\r" not in event else _LINE.split(event):  # the common LF lines: no regex
        if line.startswith(b"data:"):
            data.append(line[6:] if line.startswith(b"data: ") else line[5:])
        elif line:
            other.append(line)
    return (b"\n".join(data) if data else None), other


def read_event(event: bytes) -> tuple[bytes | None, bytes | None]:
    """An event's type (its `event` field; None where it names none) and its data (as `event_data` reads it; None for
    a comment or an event without data).

    MalformedEvent unless every line is a comment or one of the fields the SSE specification defines, with its
    colon, and a comment's or field's text is UTF-8 (data is checked as the route's format reads it, as JSON or
    [DONE]). The specification has a client skip a line of any other field and decode bytes that are not UTF-8 as
    replacement characters, so such a line in a relayed event is something the gateway did not read and a client
    may read otherwise (binary garbage, a field a lenient parser takes for data). One pass over the event's lines,
    which the framer bounds at `max_event_bytes`."""
    name, data = None, []
    for line in _LINE.split(event):
        if not line:
            continue
        field, colon, value = line.partition(b":")
        if field and (not colon or field not in _FIELDS):
            raise MalformedEvent("an upstream event has a line that is neither an SSE field nor a comment")
        value = value[1:] if value.startswith(b" ") else value
        if field == b"data":
            data.append(value)
            continue
        try:
            value.decode()
        except UnicodeDecodeError:
            raise MalformedEvent("an upstream event has a line that is not UTF-8") from None
        if field == b"event":
            name = value
    return name, b"\n".join(data) if data else None


def typed_event(data: dict[str, Any]) -> bytes:
    """One event named by its data's `type`, as Anthropic's and OpenAI Responses' streams name theirs."""
    return b"event: " + str(data["type"]).encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def with_data(event: bytes, data: bytes) -> bytes:
    """The event with its data replaced (one line) and its other fields (`event:`, `id:`) kept: a rewritten event
    must keep the type a client dispatches it by."""
    fields = [line for line in _LINE.split(event) if line and not line.startswith(b"data:")]
    return b"".join(line + b"\n" for line in fields) + b"data: " + data + b"\n\n"
