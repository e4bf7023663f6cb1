"""Transformations applied to a request part before matching. Each is linear in its input."""

from __future__ import annotations

import base64
import binascii
import html
import re
import unicodedata
from collections.abc import Callable
from urllib.parse import unquote

from gateway.waf.decode import DATA_URI

_PERCENT_U = re.compile(r"%u([0-9a-fA-F]{4})")
_WS = re.compile(r"\s+")
_SQL_COMMENT = re.compile(r"/\*.*?(?:\*/|$)", re.S)
_JS_ESCAPE = re.compile(r"\\(?:x([0-9a-fA-F]{2})|u\{?([0-9a-fA-F]{4})\}?|([0-7]{1,3}))")
_CMD_DROP = re.compile(r"[\\\"'^]")
_CMD_SPACE_BEFORE = re.compile(r"\s+(?=[/(])")
_CMD_SEP = re.compile(r",")
_SLASHES = re.compile(r"[\\/]+")
_DOT_SEGMENT = re.compile(r"(?:(?<=/)|^)\./")
_B64 = re.compile(r"^[A-Za-z0-9+/_-]+={0,2}$")
_PROCESSING_INSTRUCTION = re.compile(r"<\?(?!php\b|=)[A-Za-z][\w.:-]*(?:\s[^<>]*)?\?>", re.I)
_SHELL_WORD_BREAK = re.compile(r"[\s;|&`()<>]+")
_QUOTE_INSIDE_WORD = re.compile(r"""\w['"]+\w""")
# A complete formatting tag (or its end tag) whose attributes are all presentational or a link to a path or an
# http(s) URL, every value quoted: markup people paste from a page or a CMS, which runs nothing. Used lowercase,
# after entity decoding, so `javascript&#58;` arrives as the colon that disqualifies a value.
_INERT_ELEMENT = (
    r"(?:a|abbr|b|blockquote|br|code|dd|div|dl|dt|em|h[1-6]|hr|i|li|ol|p|pre|q|s|small|span|strong|sub|sup|"
    r"table|tbody|td|tfoot|th|thead|tr|u|ul)"
)
_INERT_ATTRIBUTE = (
    r"\s+(?:class|id|title|lang|dir|align|valign|width|height|border|cellpadding|cellspacing|colspan|rowspan|href|"
    r"name|rel|target|alt)\s*=\s*(?:\"(?:https?://)?[^\"<>:`]*\"|'(?:https?://)?[^'<>:`]*')"
)
_INERT_MARKUP = re.compile(rf"<{_INERT_ELEMENT}(?:{_INERT_ATTRIBUTE})*\s*/?>|</{_INERT_ELEMENT}\s*>")
# A value that opens with a processing instruction (<?xml ...?>, <?xpacket ...?>; not PHP's <?php or <?=) is an XML
# document, not a fragment of a page. Its element tags are data (<order>, </id>, <x:xmpmeta xmlns:x="...">) unless
# the element is one a browser runs or loads (script, iframe, img, a, ...) or an attribute is an event handler or
# holds a scheme; those stay for the XSS rules to read. An SVG document's own <svg> tag runs nothing by itself: its
# scripts come from such elements and attributes.
_XML_DOCUMENT = re.compile(r"\s*<\?(?!php\b|=)[A-Za-z]", re.I)
_SCRIPT_CAPABLE = (
    r"(?:script|iframe|frame|frameset|object|embed|applet|math|base|meta|link|style|img|image|a|form|input|"
    r"button|body|html|foreignobject|use|animate|set|handler|listener|xss|import|template|portal|video|audio|source)"
)
_XML_DATA_TAG = re.compile(
    rf"</?(?!{_SCRIPT_CAPABLE}\b)[a-z_][\w.-]*(?::[a-z_][\w.-]*)?"
    r"(?:\s+(?:xmlns(?::[\w.-]+)?\s*=\s*(?:\"[^\"<>`]*\"|'[^'<>`]*')|(?!on)[a-z_][\w.-]*(?::(?!on)[\w.-]+)?\s*=\s*"
    r"(?:\"[^\"<>:`]*\"|'[^'<>:`]*')))*\s*/?>",
    re.I,
)
# A bracketed list of two or more quoted strings (['a','b'], ["x", "y"]): a JSON or Python literal, whose
# quote-comma-quote is the list's punctuation, not SQL's.
_STRING_LIST = re.compile(r"""\[\s*(?:'[^'\\\[\]]*'|"[^"\\\[\]]*")(?:\s*,\s*(?:'[^'\\\[\]]*'|"[^"\\\[\]]*"))+\s*\]""")

# Markdown's code marks. A fence line opens a block when it names the block's language (```python, ```diff, no
# backtick after the run, as CommonMark requires); the bare fence after it closes the block. A language that is a
# command printing something by itself (```id) stays, as a shell would run it. An inline code span is a backtick
# pair in prose: after the value's start or a space that follows text (not a shell operator), its code starting
# with no space, and followed by a space and a word (or a dash, bracket or quote) or by punctuation, as a sentence
# goes on.
_FENCE_OPEN = re.compile(r"[ ]{0,3}`{3,}[ \t]*([A-Za-z][\w+#.-]*)(?:[ \t][^`\r\n]*)?\r?")
_FENCE_CLOSE = re.compile(r"[ ]{0,3}`{3,}[ \t]*\r?")
_RUNS_ALONE = frozenset(
    "id whoami uname hostname ifconfig ipconfig netstat env printenv pwd ls ps uptime systeminfo tasklist".split()
)
_INLINE_CODE = re.compile(
    r"""(?:^|(?<=[^\s;|&<>`$({=\\]\s))`([^`\s][^`\r\n]{0,119})`(?=\s+[\w(«"'—–]|\s*[.,:?!)»。、，？！：）])"""
)


def url_decode(value: str) -> str:
    """%XX (as UTF-8, invalid bytes kept as U+FFFD), %uXXXX, and '+' as space."""
    if "%" not in value and "+" not in value:
        return value
    value = _PERCENT_U.sub(lambda m: chr(int(m.group(1), 16)), value.replace("+", " "))
    return unquote(value, errors="replace")


def js_decode(value: str) -> str:
    if "\\" not in value:
        return value

    def one(m: re.Match[str]) -> str:
        code = m.group(1) or m.group(2)
        return chr(int(code, 16)) if code else chr(int(m.group(3), 8) & 0xFF)

    return _JS_ESCAPE.sub(one, value)


def base64_decode(value: str) -> str:
    """The decoded text when the whole value is base64 (standard or URL-safe), else the value unchanged."""
    stripped = value.strip()
    if len(stripped) < 8 or not _B64.match(stripped):
        return value
    try:
        raw = base64.b64decode(
            stripped + "=" * (-len(stripped) % 4), altchars=b"-_" if "-" in stripped or "_" in stripped else None
        )
    except (binascii.Error, ValueError):
        return value
    return raw.decode("utf-8", errors="replace")


def cmd_line(value: str) -> str:
    """Shell-evasion normalisation: drop \\ " ' ^, commas to spaces, no space before / or (, lowercase,
    whitespace compressed."""
    value = _CMD_DROP.sub("", value)
    value = _CMD_SEP.sub(" ", value)
    value = _WS.sub(" ", value)
    value = _CMD_SPACE_BEFORE.sub("", value)
    return value.lower()


def quote_split_words(value: str) -> str:
    """The words a quote splits from inside (wh'o'ami, "w"get), quotes removed, space-separated; every other word
    is dropped. The shell joins quoted and bare pieces into one word, so this is the word it runs; a word merely
    in quotes ("ip") is not split and does not appear, nor does one whose quote is closed in a later word (I'd,
    c'at x'): the shell's word then runs on past a space, and is no command (prose's I'd is not id)."""
    if "'" not in value and '"' not in value:
        return ""
    # Split first, then test each word: one pattern spanning a whole word would backtrack quadratically on a long
    # word that holds a quote but is not split by it.
    return " ".join(
        w.replace("'", "").replace('"', "")
        for w in _SHELL_WORD_BREAK.split(value)
        if _QUOTE_INSIDE_WORD.search(w) and w.count("'") % 2 == 0 and w.count('"') % 2 == 0
    )


def remove_markdown_code_marks(value: str) -> str:
    """The backticks Markdown quotes code with (see _FENCE_OPEN, _INLINE_CODE) removed, the code kept for the rules
    to read: in prose and code pasted as a value they mark code, not a shell's command substitution."""
    if "`" not in value:
        return value
    lines = value.split("\n")
    in_block = False
    for i, line in enumerate(lines):
        if "`" not in line:
            continue
        if in_block and _FENCE_CLOSE.fullmatch(line):
            lines[i], in_block = "", False
        elif not in_block and (fence := _FENCE_OPEN.fullmatch(line)) and fence.group(1).lower() not in _RUNS_ALONE:
            lines[i], in_block = "", True
    return _INLINE_CODE.sub(r" \1 ", "\n".join(lines))


def remove_xml_data_markup(value: str) -> str:
    """In an XML document, the element tags that are data (see _XML_DATA_TAG) removed; any other value unchanged."""
    if not _XML_DOCUMENT.match(value):
        return value
    return _XML_DATA_TAG.sub(" ", value)


def normalize_path(value: str) -> str:
    value = _SLASHES.sub("/", value)
    return _DOT_SEGMENT.sub("", value)


TRANSFORMS: dict[str, Callable[[str], str]] = {
    "lowercase": str.lower,
    "url_decode": url_decode,
    "html_entity_decode": lambda v: html.unescape(v) if "&" in v else v,
    "nfkc": lambda v: v if v.isascii() else unicodedata.normalize("NFKC", v),
    "remove_nulls": lambda v: v.replace("\x00", "") if "\x00" in v else v,
    "compress_whitespace": lambda v: _WS.sub(" ", v),
    "remove_whitespace": lambda v: _WS.sub("", v),
    "base64_decode": base64_decode,
    "js_decode": js_decode,
    "remove_comments": lambda v: _SQL_COMMENT.sub(" ", v) if "/*" in v else v,
    "cmd_line": cmd_line,
    "quote_split_words": quote_split_words,
    "normalize_path": normalize_path,
    # XML declarations and other processing instructions (<?xml ...?>, <?xpacket ...?>) are no markup a browser
    # runs; PHP's own open tags stay.
    "remove_processing_instructions": lambda v: _PROCESSING_INSTRUCTION.sub(" ", v) if "<?" in v else v,
    # Formatting markup with presentational attributes only (<a href="/faq">, <span class="x">, </b>), removed so
    # that what is left is the markup that could run something.
    "remove_inert_markup": lambda v: _INERT_MARKUP.sub(" ", v) if "<" in v else v,
    "remove_xml_data_markup": remove_xml_data_markup,
    "remove_string_lists": lambda v: _STRING_LIST.sub("[]", v) if "[" in v else v,
    # A data: URI's base64 payload dropped, its media type kept: the payload is read decoded (the `base64` part),
    # and its `;base64,` parameter is no `; base64` command.
    "remove_data_uri_payloads": lambda v: DATA_URI.sub(r"\1", v) if ";base64," in v else v,
    "remove_markdown_code_marks": remove_markdown_code_marks,
    "trim": str.strip,
}


def apply(chain: tuple[str, ...], value: str) -> str:
    for name in chain:
        value = TRANSFORMS[name](value)
    return value
