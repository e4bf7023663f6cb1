"""Two texts a sentence-embedding model finds alike that still ask different questions, told from their words: the
semantic match serves one's answer for the other only where none of these holds.

- A number differs (digits, or the number words two to twenty, the tens, hundred, thousand, million, billion):
  "15 % of 200" is not "25 % of 200".
- One is negated and the other is not (an odd count of not, no, never, none, nothing, nobody, neither, nor,
  without): "does the hotel allow pets" is not "does the hotel not allow pets".
- They are the same words in another order: "from London to New York" is not "from New York to London".
- They are the same but for one short span, at most MAX_EDIT words on either side: "open" or "close", "renew" or
  "cancel", "before" or "after". An embedding model finds such a pair nearly identical whether the words swapped
  mean the same or the opposite, and which they mean is all the answer hangs on. (A paraphrase that differs only so,
  "how do I" for "how can I", is a miss: the price of the rule.)

Words are compared case-folded, without punctuation, with contractions spelled out ("what's" is "what is", "isn't"
is "is not") and numbers in digits. Only a text's first MAX_WORDS words are read (a kept text's words are held
beside its embedding), and a word past MAX_WORD_CHARS is cut there. What the checks buy, with the embeddings of the
bundled all-MiniLM-L6-v2, is measured in tests/evals/test_semantic_cache.py (docs/benchmarks.md).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from itertools import islice

MAX_WORDS = 128
MAX_WORD_CHARS = 40
MAX_EDIT = 2  # words on either side of the one span two texts may differ in and still be refused
_WORD = re.compile(r"\d+(?:[.,]\d+)*|[^\W\d_]+(?:['’][^\W\d_]+)?")
_IRREGULAR = {"won't": "will not", "can't": "can not", "cannot": "can not", "shan't": "shall not"}
_SUFFIXES = (
    ("n't", "not"),
    ("'re", "are"),
    ("'ve", "have"),
    ("'ll", "will"),
    ("'d", "would"),
    ("'m", "am"),
    ("'s", "is"),
)
_NEGATIONS = frozenset({"not", "no", "never", "none", "nothing", "nobody", "neither", "nor", "without"})
_UNITS = "two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen seventeen"
_NUMBER_WORDS = {word: str(n) for n, word in enumerate((_UNITS + " eighteen nineteen twenty").split(), start=2)}
_NUMBER_WORDS |= {w: str(10 * n) for n, w in enumerate("thirty forty fifty sixty seventy eighty ninety".split(), 3)}
_NUMBER_WORDS |= {"hundred": "100", "thousand": "1000", "million": "1000000", "billion": "1000000000"}


@dataclass(frozen=True)
class Wording:
    """A text's words, as the checks compare them."""

    words: tuple[str, ...]

    @classmethod
    def of(cls, text: str) -> Wording:
        words: list[str] = []
        for match in islice(_WORD.finditer(text), MAX_WORDS):
            words.extend(_spelled_out(match.group().casefold().replace("’", "'")[:MAX_WORD_CHARS]))
        return cls(tuple(words[:MAX_WORDS]))

    def numbers(self) -> list[str]:
        return sorted(w for w in self.words if w[0].isdigit())

    def negated(self) -> bool:
        return sum(w in _NEGATIONS for w in self.words) % 2 == 1

    def conflict(self, other: Wording) -> str | None:
        """Why the two texts ask different questions, where their words say so: "number", "negation", "order" or
        "edit"; None where they do not."""
        if self.numbers() != other.numbers():
            return "number"
        if self.negated() != other.negated():
            return "negation"
        if self.words != other.words and sorted(self.words) == sorted(other.words):
            return "order"
        if self.words != other.words and _one_short_edit(self.words, other.words):
            return "edit"
        return None


def _spelled_out(word: str) -> list[str]:
    """The word as the checks read it: contractions spelled out, numbers in digits ("three" and "3" are one word)."""
    if word[0].isdigit() or word in _NUMBER_WORDS:
        return [_NUMBER_WORDS.get(word, word.replace(",", ""))]
    if word in _IRREGULAR:
        return _IRREGULAR[word].split()
    for suffix, spelled in _SUFFIXES:
        if word.endswith(suffix) and len(word) > len(suffix):
            return [word[: -len(suffix)], spelled]
    return [word]


def _one_short_edit(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    """Whether `a` and `b` are the same but for one span of at most MAX_EDIT words on either side."""
    shorter = min(len(a), len(b))
    start = 0
    while start < shorter and a[start] == b[start]:
        start += 1
    end = 0
    while end < shorter - start and a[-1 - end] == b[-1 - end]:
        end += 1
    return len(a) - start - end <= MAX_EDIT and len(b) - start - end <= MAX_EDIT
