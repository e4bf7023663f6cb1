"""JSON text as a client's parser reads it: a tool call's arguments as they stream, each string's escape sequences
decoded, with the way back from the decoded text to the raw one.

A client `json.loads` a call's arguments, so to it `\\u0041KIA…` is `AKIA…` and `\\n` a line break: the output guard
reads what the escapes stand for, never the escapes. The decoded text keeps what lies outside strings and the
strings' own quotes as they are, and puts in place of each escape sequence (`\\n`, `\\u00e9`, a surrogate pair
`\\ud83d\\ude00`) the one character it stands for, as `json.loads` does. Every decoded character comes from a whole
stretch of raw text, so a stretch of decoded text maps back to raw offsets that cover whole escape sequences:
replacing those inside one string keeps the JSON valid.

An escape sequence still arriving (the text so far ends in `\\u00`, or in the first half of a surrogate pair whose
second half may follow) is not decoded yet: `consumed` stops before it, and whatever is released to a client must
stop there too, or the client could finish decoding what the guard has not read. The cost is linear in the text:
a regular expression finds the few characters that matter, and offsets map back by bisection over the escapes.
"""

from __future__ import annotations

import re
from bisect import bisect_left, bisect_right

from gateway.streaming.growing_text import GrowingText

_IN_STRING = re.compile(r'["\\]')  # what ends a stretch of a string's plain characters
_SIMPLE = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_HEX = re.compile(r"[0-9A-Fa-f]{4}")
# what may still become a low surrogate's escape (`\udc00`-`\udfff`) after a high one: decided only once it is whole
_LOW_SURROGATE_START = re.compile(r"(?:\\(?:u(?:[dD](?:[c-fC-F][0-9a-fA-F]{0,2})?)?)?)?")


class DecodedJson:
    def __init__(self) -> None:
        self.text = GrowingText()  # the decoded text
        self.consumed = 0  # raw characters decoded so far; the rest is an escape sequence still arriving
        self._pending = ""  # that rest
        self._in_string = False
        # each escape sequence: where its character is in the decoded text, where it starts and ends in the raw text
        self._decoded_at: list[int] = []
        self._raw_at: list[int] = []
        self._raw_end: list[int] = []
        self._quotes: list[int] = []  # decoded offsets of the quotes that open and close strings

    def append(self, piece: str) -> None:
        if not self._pending and self._in_string and _IN_STRING.search(piece) is None:
            self.text.append(piece)  # the common piece, a string's plain characters: itself decoded
            self.consumed += len(piece)
            return
        self._decode(self._pending + piece, final=False)

    def finish(self) -> None:
        """The raw text is whole: an escape sequence left unfinished stands for itself (no parser accepts it), and a
        lone high surrogate for itself (as `json.loads` reads one)."""
        if self._pending:
            self._decode(self._pending, final=True)

    def raw_offset(self, decoded: int) -> int:
        """Where the decoded character at `decoded` starts in the raw text (`consumed` at the decoded text's end): a
        decoded stretch [a, b) comes from the raw stretch [raw_offset(a), raw_offset(b))."""
        i = bisect_right(self._decoded_at, decoded) - 1
        if i < 0:
            return decoded
        if decoded == self._decoded_at[i]:
            return self._raw_at[i]
        return self._raw_end[i] + decoded - self._decoded_at[i] - 1

    def decoded_offset(self, raw: int) -> int:
        """The decoded character the raw offset `raw` falls in (an escape sequence's middle: its character)."""
        i = bisect_right(self._raw_at, raw) - 1
        if i < 0:
            return raw
        if raw < self._raw_end[i]:
            return self._decoded_at[i]
        return self._decoded_at[i] + 1 + raw - self._raw_end[i]

    def in_one_string(self, start: int, end: int) -> bool:
        """Whether the decoded stretch [start, end) lies inside one string: no quote of the JSON's own in it, and an
        odd number of them before it. Only such a stretch can be replaced by other string text."""
        before = bisect_left(self._quotes, start)
        return before % 2 == 1 and bisect_left(self._quotes, end) == before

    def __len__(self) -> int:
        return len(self.text)

    def _decode(self, buffer: str, final: bool) -> None:
        base = self.consumed  # the raw offset of buffer[0]
        self._pending = ""
        out: list[str] = []
        length = len(self.text)  # of the decoded text, with `out`
        pos = 0
        while pos < len(buffer):
            if not self._in_string:
                quote = buffer.find('"', pos)
                stop = len(buffer) if quote < 0 else quote + 1
                out.append(buffer[pos:stop])
                length += stop - pos
                if quote >= 0:
                    self._quotes.append(length - 1)
                    self._in_string = True
                pos = stop
                continue
            found = _IN_STRING.search(buffer, pos)
            at = len(buffer) if found is None else found.start()
            out.append(buffer[pos:at])
            length += at - pos
            pos = at
            if found is None:
                break
            if buffer[at] == '"':
                out.append('"')
                self._quotes.append(length)
                length += 1
                self._in_string = False
                pos = at + 1
                continue
            char, size = _escape(buffer, at, final)
            if size == 0:  # still arriving
                self._pending = buffer[at:]
                break
            if char is None:  # not an escape sequence: the backslash stands for itself
                out.append("\\")
                length += 1
                pos = at + 1
                continue
            self._decoded_at.append(length)
            self._raw_at.append(base + at)
            self._raw_end.append(base + at + size)
            out.append(char)
            length += 1
            pos = at + size
        self.text.append("".join(out))
        self.consumed = base + len(buffer) - len(self._pending)


def _escape(buffer: str, at: int, final: bool) -> tuple[str | None, int]:
    """The escape sequence at buffer[at] (a backslash): (its character, its raw length); (None, 1) when it is none;
    (None, 0) when the buffer ends before that is known and more may come."""
    if at + 1 >= len(buffer):
        return None, 0 if not final else 1
    kind = buffer[at + 1]
    if kind in _SIMPLE:
        return _SIMPLE[kind], 2
    if kind != "u":
        return None, 1
    digits = buffer[at + 2 : at + 6]
    if len(digits) < 4 and not final and all(c in "0123456789abcdefABCDEF" for c in digits):
        return None, 0
    if not _HEX.fullmatch(digits):
        return None, 1
    code = int(digits, 16)
    if not 0xD800 <= code < 0xDC00:
        return chr(code), 6
    after = buffer[at + 6 : at + 12]
    if len(after) < 6 and not final and _LOW_SURROGATE_START.fullmatch(after):
        return None, 0  # the second half of a pair may be arriving
    if len(after) == 6 and after[:2] == "\\u" and _HEX.fullmatch(after[2:]) and 0xDC00 <= int(after[2:], 16) < 0xE000:
        return chr(0x10000 + ((code - 0xD800) << 10) + int(after[2:], 16) - 0xDC00), 12
    return chr(code), 6  # a lone high surrogate, as json.loads reads it
