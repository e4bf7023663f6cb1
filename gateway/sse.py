"""Server-sent-event framing for the streaming relay: complete events out, byte for byte, as soon as they arrive."""

from __future__ import annotations

import re

_EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")
_LINE = re.compile(rb"\r\n|\n|\r")

DONE = b"data: [DONE]\n\n"


class EventFramer:
    """Splits an SSE byte stream into whole events (each ending in its blank line), however the bytes were chunked."""

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, data: bytes) -> list[bytes]:
        buffer = self._pending + data
        events, start = [], 0
        for match in _EVENT_END.finditer(buffer):
            events.append(buffer[start:match.end()])
            start = match.end()
        self._pending = buffer[start:]
        return events

    @property
    def pending(self) -> bytes:
        """Bytes of an event the stream has not finished."""
        return self._pending


def event_data(event: bytes) -> bytes | None:
    """The event's `data` field (multi-line data joined by newlines), or None for comments and data-less events."""
    lines = [line for line in _LINE.split(event) if line.startswith(b"data:")]
    if not lines:
        return None
    return b"\n".join(line[6:] if line.startswith(b"data: ") else line[5:] for line in lines)
