"""Response header values, rendered so that any text is a valid HTTP field value.

Headers the gateway writes carry text that came from elsewhere: the model that served (the client's name for it, or
a fallback's from the config), a replica's URL, names from policies, an upstream's Retry-After, a passthrough
answer's own headers. Starlette encodes a header value as Latin-1 and uvicorn refuses one with a control character,
so a single character outside both cost a 500 or a dropped connection, after the upstream had served the request and
it was charged. Every header the gateway answers with is rendered here, so no text can do that; the request id, 32 hex
digits the gateway makes itself (gateway/context.py), is the one value written as made.

The rendering: a value that is already a valid field value of printable ASCII is written as it is (a passthrough
answer's `content-disposition` keeps its own percent-encoded `filename*`); any other is written with each character
outside printable ASCII (a control character, DEL, anything beyond ASCII) as the percent-encoded bytes of its UTF-8,
the encoding RFC 8187 gives non-ASCII header parameters, and so are its `%` (decoding it once gives the text back)
and spaces at either end (a reader trims them). Percent-encoding rather than refusing: the text is already decided
by the time a header is written (the upstream answered), and an encoded name still says which model served to anyone
who decodes it. The request's own model is held to visible ASCII before anything acts on it
(gateway/apis/model_name.py), so for clients this never changes a byte.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from urllib.parse import quote_from_bytes

_KEPT = "".join(chr(c) for c in range(0x20, 0x7F) if chr(c) != "%")  # what percent-encoding leaves as it is
_EDGE_SPACES = re.compile(r"^ +| +$")


def header_value(text: str) -> str:
    """`text` as an HTTP field value: itself where it is one, else percent-encoded where it is not printable ASCII."""
    return text if _is_field_value(text) else _encoded(text)


def rendered(headers: Mapping[str, str]) -> dict[str, str]:
    """Headers to answer with, each value rendered by `header_value`."""
    return {name: value if _is_field_value(value) else _encoded(value) for name, value in headers.items()}


def _is_field_value(text: str) -> bool:
    """Printable ASCII (space to `~`) without a space at either end, or nothing: str's own checks, where a regular
    expression's repeat and its backtrack to the last character cost five times as much."""
    return text.isascii() and text.isprintable() and (not text or (text[0] != " " and text[-1] != " "))


def _encoded(text: str) -> str:
    # surrogatepass: a lone surrogate (an upstream's undecodable byte, as aiohttp decodes headers) is encoded too
    quoted = quote_from_bytes(text.encode("utf-8", "surrogatepass"), safe=_KEPT)
    return _EDGE_SPACES.sub(lambda spaces: "%20" * len(spaces.group()), quoted)
