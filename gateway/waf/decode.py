"""Values that hide a payload under base64, whole or as a data: URI's payload: decoded so the rules read what the
server would.

A value counts as base64 text only when all of it is base64 (standard or URL-safe alphabet, padded or not), it is
at least `MIN_LENGTH` characters long, and it decodes to UTF-8 that is mostly printable: a word, a number, a hex
digest or a random token decodes to bytes that are not, so ordinary values yield nothing. Decoding goes at most
`MAX_LAYERS` deep (base64 of base64) and reads at most `MAX_BYTES` of a value, so its cost stays bounded whatever
a request sends.
"""

from __future__ import annotations

import base64
import binascii
import functools
import re

MIN_LENGTH = 8
MAX_LAYERS = 2
MAX_BYTES = 64 * 1024
PRINTABLE_SHARE = 0.9

# A data: URI with a base64 payload (RFC 2397; PHP's data:// wrapper too): group 1 is everything before the payload,
# group 2 the payload, which is read decoded like any base64 value.
DATA_URI = re.compile(r"(data:(?://)?[\w/+.-]*(?:;[\w.=-]+)*);base64,([A-Za-z0-9+/_-]*={0,2})", re.I)
_STANDARD = re.compile(r"[A-Za-z0-9+/]+={0,2}")
_URL_SAFE = re.compile(r"[A-Za-z0-9_-]+={0,2}")


def base64_text(value: str) -> str | None:
    """The text `value` encodes, when it is base64 of mostly printable UTF-8; else None."""
    value = value.strip()
    if len(value) < MIN_LENGTH or len(value) > MAX_BYTES or len(value.rstrip("=")) % 4 == 1:
        return None
    if _STANDARD.fullmatch(value):
        altchars = None
    elif _URL_SAFE.fullmatch(value):
        altchars = b"-_"
    else:
        return None
    try:
        raw = base64.b64decode(value.rstrip("=") + "=" * (-len(value.rstrip("=")) % 4), altchars=altchars)
        text = raw.decode("utf-8")
    except (binascii.Error, ValueError):
        return None
    printable = sum(1 for c in text if c.isprintable() or c in "\t\r\n")
    if not text or printable < PRINTABLE_SHARE * len(text) or not any(c.isalpha() for c in text):
        return None
    return text


@functools.lru_cache(maxsize=4096)
def _layers_of_short(value: str) -> tuple[str, ...]:
    return _layers(value)


def _layers(value: str) -> tuple[str, ...]:
    out: list[str] = []
    for _ in range(MAX_LAYERS):
        decoded = base64_text(value)
        if decoded is None:
            break
        out.append(decoded)
        value = decoded
    return tuple(out)


def base64_layers(value: str) -> tuple[str, ...]:
    """Each decoded layer of a base64 value or of a data: URI's base64 payload, outermost first (empty for a value
    that is neither)."""
    if len(value) < MIN_LENGTH or value[0] in " {[<\"'":
        return ()
    if value[:5].lower() == "data:":
        data_uri = DATA_URI.fullmatch(value.rstrip())
        if data_uri is None:
            return ()
        value = data_uri.group(2)
    return _layers_of_short(value) if len(value) <= 512 else _layers(value)
