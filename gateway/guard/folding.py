"""Text as whoever reads it sees it: each character's NFKC form (fullwidth `ＡＫＩＡ` is `AKIA`), the invisible
characters removed (zero-width spaces and joiners, bidi controls, soft hyphens, variation selectors: a person does not
see them and a program may strip them), and tag characters, invisible too, read as the ASCII they mirror, as a model
reads them. A detector that reads the folded view finds what the text's reader will find; `Folded.source` maps a
stretch of the view back to the whole characters of the text it came from, so a redaction takes out the invisible
characters inside a value as well.

Folding is per character and only where the text is not ASCII, so the common case costs one `isascii()`.

A reader also undoes the escapes a text may be written in: a browser or a model reads `&#65;KIA…`, `&#x41;` and
`&amp;` as the characters they stand for, a URL's reader `%41KIA…` as `AKIA…`, and a program or a model the string
escapes `\\u0041` and `\\x41` (which is also how JSON written inside a JSON string reads, at any depth). `Unescaped`
is that view, each escape undone once, and `views` lists every view the detectors read; a finding in one maps back to
whole escapes of the text. A text with no `&`, `%` or backslash has nothing to undo: three `in` checks.
"""

from __future__ import annotations

import functools
import html
import re
import unicodedata
from bisect import bisect_right
from urllib.parse import unquote

# Default-ignorable code points (Unicode's DerivedCoreProperties): zero-width spaces and joiners, bidi controls and
# isolates, soft hyphen, invisible operators, variation selectors, Hangul fillers, tags. Nobody sees them.
_INVISIBLE = re.compile(
    "[\u00ad\u034f\u061c\u115f\u1160\u17b4\u17b5\u180b-\u180f\u200b-\u200f\u202a-\u202e\u2060-\u206f"
    "\u3164\ufe00-\ufe0f\ufeff\uffa0\U0001bca0-\U0001bca3\U0001d173-\U0001d17a\U000e0000-\U000e0fff]"
)
_NOT_ASCII = re.compile(r"[^\x00-\x7f]+")
# character references (decimal, hex, named), runs of percent-escaped bytes, runs of \\u and \\x escapes (with the
# backslash escaped too, as a JSON string inside a JSON string writes it: one escape, read through every layer)
_ESCAPE = re.compile(
    r"&(?:#[0-9]{1,7}|#[xX][0-9a-fA-F]{1,6}|[A-Za-z][A-Za-z0-9]{1,31});?"
    r"|(?:%[0-9A-Fa-f]{2})+|(?<!\\)(?:\\++u[0-9A-Fa-f]{4})+|(?<!\\)(?:\\++x[0-9A-Fa-f]{2})+"
)  # (a run of backslashes is matched from its first, whole: linear in a text of backslashes)
_DIGITS = re.compile(r"\\+[ux]([0-9A-Fa-f]+)")
_SURROGATES = re.compile("[\ud800-\udfff]")


@functools.lru_cache(maxsize=4096)
def _folded_char(char: str) -> str:
    if 0xE0020 <= ord(char) <= 0xE007E:  # a tag character: invisible, yet a model reads the ASCII it mirrors
        return chr(ord(char) - 0xE0000)
    return "" if _INVISIBLE.match(char) else unicodedata.normalize("NFKC", char)


class View:
    """A text as one reader reads it, and the way back: the stretches of the text that read otherwise, where their
    reading starts in the view (`at`), where they are in the text (`source_at`), their reading's length (`width`, 0
    for one removed) and their own (`source_width`: one character folded, a whole escape undone)."""

    def __init__(
        self, text: str, at: list[int], source_at: list[int], width: list[int], source_width: list[int] | None = None
    ) -> None:
        self.text, self._at, self._source_at, self._width = text, at, source_at, width
        self._source_width = source_width

    @classmethod
    def identity(cls, text: str) -> View:
        return cls(text, [], [], [])

    def source(self, start: int, end: int) -> tuple[int, int]:
        """The stretch of the text that the view's [start, end) comes from (whole characters and escapes of it)."""
        return self._source(start, False), self._source(end - 1, True)

    def _source(self, position: int, end: bool) -> int:
        i = bisect_right(self._at, position) - 1
        if i < 0:
            return position + end
        widths = self._source_width
        source_width = 1 if widths is None else widths[i]
        if position < self._at[i] + self._width[i]:
            return self._source_at[i] + (source_width if end else 0)
        return self._source_at[i] + source_width + position - self._at[i] - self._width[i] + end


class Through(View):
    """A view of a view (the folded reading of an unescaped text): positions map back through both."""

    def __init__(self, outer: View, inner: View) -> None:
        super().__init__(outer.text, [], [], [])
        self._outer, self._inner = outer, inner

    def source(self, start: int, end: int) -> tuple[int, int]:
        return self._inner.source(*self._outer.source(start, end))


class Unescaped(View):
    """A text with its character references, percent-escapes and `\\u`/`\\x` escapes undone, once."""

    @classmethod
    def of(cls, text: str) -> Unescaped | None:
        """The unescaped view; None where the text has nothing to undo."""
        if "&" not in text and "%" not in text and "\\" not in text:
            return None
        pieces: list[str] = []
        at: list[int] = []
        source_at: list[int] = []
        width: list[int] = []
        source_width: list[int] = []
        length = last = 0
        for escape in _ESCAPE.finditer(text):
            written = escape.group()
            read = _unescaped(written)
            if read == written:
                continue
            pieces.append(text[last : escape.start()])
            length += escape.start() - last
            at.append(length)
            source_at.append(escape.start())
            width.append(len(read))
            source_width.append(len(written))
            pieces.append(read)
            length += len(read)
            last = escape.end()
        if not at:
            return None
        pieces.append(text[last:])
        return cls("".join(pieces), at, source_at, width, source_width)


def _unescaped(written: str) -> str:
    head = written[0]
    if head == "&":
        return html.unescape(written)
    if head == "%":
        return unquote(written, errors="replace")
    digits = _DIGITS.findall(written)
    if written.lstrip("\\")[0] == "u":  # UTF-16 units: a pair is one character, a lone surrogate is no character
        units = b"".join(int(unit, 16).to_bytes(2, "big") for unit in digits)
        return _SURROGATES.sub("\ufffd", units.decode("utf-16-be", errors="surrogatepass"))
    return bytes.fromhex("".join(digits)).decode("utf-8", errors="replace")


class Folded(View):
    """A text's folded view (each character's NFKC form, invisible characters removed)."""

    @classmethod
    def of(cls, text: str) -> Folded | None:
        """The folded view; None where it is the text itself (ASCII, or already NFKC with nothing invisible)."""
        if text.isascii() or (unicodedata.is_normalized("NFKC", text) and not _INVISIBLE.search(text)):
            return None
        pieces: list[str] = []
        at: list[int] = []
        source_at: list[int] = []
        width: list[int] = []
        length = last = 0
        for run in _NOT_ASCII.finditer(text):
            pieces.append(text[last : run.start()])
            length += run.start() - last
            for offset, char in enumerate(run.group()):
                folded = _folded_char(char)
                if folded != char:
                    at.append(length)
                    source_at.append(run.start() + offset)
                    width.append(len(folded))
                pieces.append(folded)
                length += len(folded)
            last = run.end()
        pieces.append(text[last:])
        return cls("".join(pieces), at, source_at, width)


def views(text: str) -> list[View]:
    """The text as each of its readers may read it: as it is, folded, unescaped, and unescaped then folded (only
    those that differ from the text)."""
    found: list[View] = [View.identity(text)]
    folded_view = Folded.of(text)
    if folded_view is not None:
        found.append(folded_view)
    unescaped = Unescaped.of(text)
    if unescaped is not None:
        found.append(unescaped)
        both = Folded.of(unescaped.text)
        if both is not None:
            found.append(Through(both, unescaped))
    return found


def folded(text: str) -> str:
    """The text as its reader sees it: each character's NFKC form, the invisible ones removed."""
    view = Folded.of(text)
    return text if view is None else view.text
