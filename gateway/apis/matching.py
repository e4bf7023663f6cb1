"""Text as the detectors match it: the guard's classifier, the WAF's prompt packs and the secret detectors read a
text after this normalisation, so what renders (or tokenizes) as an instruction or a key cannot hide behind
characters that change how it is written but not what it says.

- Zero-width and bidirectional control characters are removed (`AKIA\u200bIOSF...` is the key it looks like).
- Unicode tag characters (U+E0020 to U+E007E, "ASCII smuggling": invisible, yet a model reads them) become the
  ASCII they mirror, so the hidden text is read, not dropped.
- NFKC folds compatibility forms (full-width letters, ligatures, superscripts) onto the plain ones.

The original text is what goes upstream; a redaction that only the normal form reveals sends the normal form, with
the finding replaced.
"""

from __future__ import annotations

import unicodedata

_INVISIBLE = (
    *range(0x200B, 0x2010),  # zero-width space, non-joiner, joiner; left-to-right and right-to-left marks
    *range(0x202A, 0x202F),  # bidirectional embeddings and overrides
    *range(0x2060, 0x2065),  # word joiner, invisible operators
    *range(0x2066, 0x206A),  # bidirectional isolates
    0x00AD,  # soft hyphen
    0x061C,  # Arabic letter mark
    0x180E,  # Mongolian vowel separator
    0xFEFF,  # zero-width no-break space (byte-order mark)
    0xE0001,  # language tag
    0xE007F,  # cancel tag
)
_TABLE: dict[int, int | None] = {cp: None for cp in _INVISIBLE}
_TABLE.update({cp: cp - 0xE0000 for cp in range(0xE0020, 0xE007F)})


def matching_form(text: str) -> str:
    """The text the detectors read (the same object when nothing changes: ASCII text is its own normal form)."""
    if text.isascii():
        return text
    return unicodedata.normalize("NFKC", text.translate(_TABLE))
