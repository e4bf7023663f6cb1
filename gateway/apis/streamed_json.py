"""JSON text that arrives in pieces, and whether it is whole yet: a streamed tool call's arguments.

The Messages translation may stop a call's block only once its arguments are whole JSON. Parsing all of them after
each fragment cost their length per fragment: megabytes of code in a string, fragments ending in `}`, took the
event loop seconds to minutes. This follows the brackets and strings as the pieces come (a regex finds the few
characters that matter), and parses the text once, when its outermost value has just closed.
"""

from __future__ import annotations

import re

import orjson

from gateway.streaming.growing_text import GrowingText

_STRUCTURE = re.compile(r'["\\{}\[\]]')  # the characters that open or close a string, an object or an array


class StreamedJson:
    def __init__(self) -> None:
        self.text = GrowingText()
        self._depth = 0  # brackets open outside strings
        self._in_string = False
        self._escaped = False  # the previous piece ended in a backslash inside a string
        self._closed = 0  # times the outermost value closed
        self._whole: bool | None = None  # the parse's verdict on the value that closed; None: not parsed yet

    def append(self, piece: str) -> None:
        self.text.append(piece)
        free_from = 1 if self._escaped else 0  # the first character is escaped
        self._escaped = False
        for match in _STRUCTURE.finditer(piece, free_from):
            at, char = match.start(), match.group()
            if at < free_from:
                continue  # escaped
            if self._in_string:
                if char == "\\":
                    free_from = at + 2
                    self._escaped = free_from > len(piece)
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._closed += 1
                    # a second value after the first can never be whole JSON
                    self._whole = None if self._closed == 1 else False

    def whole(self) -> bool:
        """Whether the text is one whole JSON value (and what follows it, if anything, is not a second one)."""
        if self._whole is None and self._closed and not self._depth and not self._in_string:
            try:
                orjson.loads(str(self.text))
                self._whole = True
            except orjson.JSONDecodeError:
                self._whole = False
        return bool(self._whole)

    def __len__(self) -> int:
        return len(self.text)
