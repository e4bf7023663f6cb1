"""Strings that carry something other than their own characters: files and media as base64 or data: URLs, JSON text
(a tool call's arguments, whose strings a model reads with their escapes decoded), and a provider's opaque state. The
inventory (gateway/apis/inventory.py) reads each as its consumer will: a text file is decoded and read as the text it
holds; media and encrypted state, which no detector here can read, are classified as binary only when they are what
they claim to be (valid base64), and read as unknown text otherwise, so a "file" or "signature" that is really prose
is scanned like prose.
"""

from __future__ import annotations

import binascii
import json
import mimetypes
import re
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import quote, unquote

# Past this many encoded characters a text file is not decoded: it is read as the unknown text it is sent as (the
# guard then refuses it as too long to scan, rather than pass it unread). The parse stage's max_string_chars bounds
# every string first; this bounds the decoder where no parse stage ran (the WAF's command-line tools).
MAX_DECODED_CHARS = 4 * 1024 * 1024

Reading = Literal["text", "binary", "unknown"]

_TEXT_APPLICATION = frozenset(
    {
        "application/json",
        "application/ld+json",
        "application/xml",
        "application/yaml",
        "application/x-yaml",
        "application/javascript",
        "application/x-javascript",
        "application/x-sh",
        "application/sql",
        "application/csv",
        "application/x-ndjson",
        "application/jsonl",
        "application/toml",
        "application/x-httpd-php",
    }
)
_DATA_URL = re.compile(r"(?is)data:([^,;]*)((?:;[^,;]*)*?)(;base64)?,")
_OPAQUE = re.compile(r"[A-Za-z0-9+/=_.\-]*")
_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(slots=True)
class DecodedText:
    """A text carried encoded: what it reads as, and how a rewritten text goes back into the string it came in."""

    text: str
    prefix: str = ""  # the data: URL header, kept as sent
    base64: bool = True

    def encode(self, text: str) -> str:
        self.text = text
        body = binascii.b2a_base64(text.encode("utf-8"), newline=False).decode("ascii") if self.base64 else quote(text)
        return self.prefix + body


def is_text_type(media_type: str) -> bool:
    media_type = media_type.strip().lower()
    return (
        media_type.startswith("text/")
        or media_type in _TEXT_APPLICATION
        or media_type.endswith(("+json", "+xml", "+yaml"))
    )


def declared_type(filename: object) -> str:
    """The media type a file name declares by its extension ("" when it declares none the system knows)."""
    if not isinstance(filename, str) or not filename:
        return ""
    guessed, _ = mimetypes.guess_type(filename, strict=False)
    if guessed is None and filename.lower().endswith((".md", ".markdown", ".jsonl", ".ndjson", ".yaml", ".yml")):
        return "text/plain"
    return guessed or ""


def read_file(value: str, declared: str = "") -> tuple[Reading, DecodedText | None]:
    """A file's bytes as sent (a data: URL, or bare base64 whose type `declared` says, from a sibling field): its text
    when its type is a text type, or when it declares none and its bytes are UTF-8; binary when its type is not a
    text type and it is valid base64; unknown when it is neither (read as the text it is sent as)."""
    prefix, media_type, is_base64 = "", declared, True
    if value[:5].lower() == "data:":
        header = _DATA_URL.match(value)
        if header is None:
            return "unknown", None
        prefix, media_type, is_base64 = value[: header.end()], header.group(1), header.group(3) is not None
        body = value[header.end() :]
    else:
        body = value
    if len(body) > MAX_DECODED_CHARS:
        return "unknown", None
    if not is_base64:  # data:text/plain,percent%20encoded: whatever its type says, the characters are text
        return "text", DecodedText(unquote(body), prefix, base64=False)
    raw = _base64(body)
    if raw is None:
        return "unknown", None
    if media_type and not is_text_type(media_type):
        return "binary", None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        if not media_type:
            return "binary", None  # no type declared and not UTF-8: bytes the model reads as a file, not text
        text = raw.decode("utf-8", errors="replace")
    return "text", DecodedText(text, prefix)


def read_media_url(value: str) -> tuple[Reading | Literal["url"], DecodedText | None]:
    """An image's or file's URL: an http(s) URL is a reference the provider fetches; a data: URL is read as a file."""
    head = value[:8].lower()
    if head.startswith(("https://", "http://")):
        return "url", None
    if head.startswith("data:"):
        return read_file(value)
    return "unknown", None


def is_opaque(value: str) -> bool:
    """Whether a provider's opaque state (encrypted reasoning, signatures) looks like the base64 it must be."""
    return _OPAQUE.fullmatch(value) is not None


def _base64(body: str) -> bytes | None:
    try:
        return binascii.a2b_base64(body, strict_mode=True)
    except (binascii.Error, ValueError):
        pass
    compact = "".join(body.split())  # MIME-style base64 broken into lines
    if compact == body:
        return None
    try:
        return binascii.a2b_base64(compact, strict_mode=True)
    except (binascii.Error, ValueError):
        return None


@dataclass(slots=True, eq=False)
class EmbeddedJson:
    """A string that holds a JSON object or array, parsed: its strings are read as the consumer reads them
    (`\\u0041KIA` is `AKIA`), and a rewrite of one of them writes the whole JSON back into the string it came in."""

    holder: Any
    key: str | int
    doc: dict[str, Any] | list[Any]
    loc: tuple[str | int, ...]  # the string's place in the payload
    renamed: dict[tuple[int, str], str] = field(default_factory=dict)  # (id of an object, its key): the key written

    def write_back(self) -> None:
        doc = self.doc if not self.renamed else self._renamed(self.doc)
        self.holder[self.key] = json.dumps(doc, ensure_ascii=False)

    def _renamed(self, node: Any) -> Any:
        if type(node) is dict:
            return {self.renamed.get((id(node), k), k): self._renamed(v) for k, v in node.items()}
        if type(node) is list:
            return [self._renamed(v) for v in node]
        return node


@dataclass(slots=True, eq=False)
class EmbeddedKey:
    """A key of an object inside a JSON text, as a holder its text is read from and rewritten in: a rewrite renames
    the key where the JSON is written back, so the object's values stay where the texts that read them look."""

    container: dict[str, Any]
    json: EmbeddedJson

    def __getitem__(self, key: str) -> str:
        written = self.json.renamed.get((id(self.container), key))
        return readable(key) if written is None else written

    def __setitem__(self, key: str, text: str) -> None:
        self.json.renamed[(id(self.container), key)] = text


def read_json(value: str) -> dict[str, Any] | list[Any] | None:
    """The JSON object or array a string holds (bounded like a file); None when it holds none, and the string is
    read as the text it is. An object with a key twice is read as text too: its reader may keep either value, so
    both are read as sent. Deep nesting is bounded by the string's own length limit and the parser's recursion."""
    head = value[:64].lstrip()
    if not head.startswith(("{", "[")) or len(value) > MAX_DECODED_CHARS:
        return None
    try:
        doc = json.loads(value, object_pairs_hook=_each_key_once)
    except (ValueError, RecursionError):
        return None
    return doc if isinstance(doc, (dict, list)) else None


def _each_key_once(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    doc = dict(pairs)
    if len(doc) != len(pairs):
        raise ValueError("a key twice")
    return doc


def readable(text: str) -> str:
    """A decoded string as UTF-8 can carry it: a lone surrogate (valid in JSON's escapes) becomes U+FFFD."""
    return text if text.isascii() else _SURROGATE.sub("\ufffd", text)
