"""Text as whoever reads it sees it: each character's NFKC form (fullwidth `ＡＫＩＡ` is `AKIA`), the invisible
characters removed (zero-width spaces and joiners, bidi controls, soft hyphens, variation selectors: a person does not
see them and a program may strip them), and tag characters, invisible too, read as the ASCII they mirror, as a model
reads them. A detector that reads the folded view finds what the text's reader will find; `Folded.source` maps a
stretch of the view back to the whole characters of the text it came from, so a redaction takes out the invisible
characters inside a value as well.

Folding is per character and only where the text is not ASCII, so the common case costs one `isascii()`.
"""

from __future__ import annotations

import functools
import re
import unicodedata
from bisect import bisect_right

# Default-ignorable code points (Unicode's DerivedCoreProperties): zero-width spaces and joiners, bidi controls and
# isolates, soft hyphen, invisible operators, variation selectors, Hangul fillers, tags. Nobody sees them.
_INVISIBLE = re.compile(
    "[\u00ad\u034f\u061c\u115f\u1160\u17b4\u17b5\u180b-\u180f\u200b-\u200f\u202a-\u202e\u2060-\u206f"
    "\u3164\ufe00-\ufe0f\ufeff\uffa0\U0001bca0-\U0001bca3\U0001d173-\U0001d17a\U000e0000-\U000e0fff]"
)
_NOT_ASCII = re.compile(r"[^\x00-\x7f]+")


@functools.lru_cache(maxsize=4096)
def _folded_char(char: str) -> str:
    if 0xE0020 <= ord(char) <= 0xE007E:  # a tag character: invisible, yet a model reads the ASCII it mirrors
        return chr(ord(char) - 0xE0000)
    return "" if _INVISIBLE.match(char) else unicodedata.normalize("NFKC", char)


class Folded:
    """A text's folded view (each character's NFKC form, invisible characters removed) and the way back: the
    characters that changed, where their replacement starts in the view (`at`), where they are in the text
    (`source_at`) and their replacement's length (`width`, 0 for one removed)."""

    def __init__(self, text: str, at: list[int], source_at: list[int], width: list[int]) -> None:
        self.text, self._at, self._source_at, self._width = text, at, source_at, width

    @classmethod
    def identity(cls, text: str) -> Folded:
        return cls(text, [], [], [])

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

    def source(self, start: int, end: int) -> tuple[int, int]:
        """The stretch of the text that the view's [start, end) comes from (whole characters of it)."""
        return self._source(start), self._source(end - 1) + 1

    def _source(self, position: int) -> int:
        i = bisect_right(self._at, position) - 1
        if i < 0:
            return position
        if position < self._at[i] + self._width[i]:
            return self._source_at[i]
        return self._source_at[i] + 1 + position - self._at[i] - self._width[i]


def folded(text: str) -> str:
    """The text as its reader sees it: each character's NFKC form, the invisible ones removed."""
    view = Folded.of(text)
    return text if view is None else view.text
