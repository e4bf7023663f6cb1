"""Text that a stream grows a piece at a time: an answer's channel, a tool call's arguments.

A str grown with += on an object's attribute is copied whole for every piece (CPython resizes in place only a local
name's string), so a 1 MB answer in 5-character deltas cost the event loop 34 s. This buffer grows in place and
reads back any stretch of itself.
"""

from __future__ import annotations

import io


class GrowingText:
    def __init__(self, text: str = "") -> None:
        self._buffer = io.StringIO(newline="")  # newline="": no newline translation, characters as given
        self._length = 0
        self.append(text)

    def append(self, piece: str) -> None:
        self._buffer.seek(self._length)
        self._buffer.write(piece)
        self._length += len(piece)

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, where: int | slice) -> str:
        """One character, or a stretch (`text[start:end]`, no step)."""
        if isinstance(where, int):
            return self[where : where + 1] if 0 <= where < self._length else ""
        start, end, _ = where.indices(self._length)
        self._buffer.seek(start)
        return self._buffer.read(max(0, end - start))

    def __str__(self) -> str:
        return self._buffer.getvalue()
