"""PII and secrets detectors: regular expressions narrowed by validators (Luhn, IBAN mod 97, SSN ranges, IP octets).

Each detector has a type (`email`, `credit_card`, `aws_access_key`, ...) and a kind (`pii` or `secret`). `find()`
returns the validated matches without overlaps; `redact()` replaces each with a typed placeholder such as
`[REDACTED:EMAIL]`, so the model (or the client) still sees that something was there and what it was.

Text is read as whoever gets it will read it, not only as its code points run: also folded and unescaped
(gateway/guard/folding.py: NFKC, invisible characters removed; character references, percent-escapes and `\\u`/`\\x`
escapes undone), and where a detector's type allows it (the secrets: a key's base64 is the key to
anyone who decodes it), inside base64 runs of a plausible length (`MIN_BASE64_RUN` to `MAX_BASE64_RUN` characters:
shorter ones cannot hold a key, longer ones are files and images, not decoded), and in hex inside them. A finding in
a folded or decoded view covers the whole stretch of the text it came from, so a redaction takes out the invisible
characters inside a key and the whole base64 run.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import re
from bisect import bisect_right
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from itertools import accumulate

from gateway.guard.folding import views


@dataclass(frozen=True, slots=True)
class Detector:
    type: str
    kind: str  # "pii" | "secret"
    pattern: re.Pattern
    validate: Callable[[str], bool] | None = None
    group: int = 0
    in_base64: bool = False  # also looked for inside base64 runs (a secret's encoding is the secret)
    # every match holds one of these (a literal the pattern requires): a text with none is not searched, which spares
    # most scans most patterns (tests/unit/test_guard_pii.py derives each claim from the pattern)
    needles: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Finding:
    type: str
    kind: str
    start: int
    end: int

    def placeholder(self) -> str:
        return f"[REDACTED:{self.type.upper()}]"


def luhn(value: str) -> bool:
    digits = [int(c) for c in value if c.isdigit()]
    if not 13 <= len(digits) <= 19:
        return False
    total = 0
    for i, d in enumerate(reversed(digits)):
        if i % 2:
            d *= 2
            if d > 9:
                d -= 9
        total += d
    return total % 10 == 0


_IBAN_LENGTHS = {
    "AD": 24,
    "AE": 23,
    "AL": 28,
    "AT": 20,
    "AZ": 28,
    "BA": 20,
    "BE": 16,
    "BG": 22,
    "BH": 22,
    "BR": 29,
    "CH": 21,
    "CR": 22,
    "CY": 28,
    "CZ": 24,
    "DE": 22,
    "DK": 18,
    "DO": 28,
    "EE": 20,
    "EG": 29,
    "ES": 24,
    "FI": 18,
    "FO": 18,
    "FR": 27,
    "GB": 22,
    "GE": 22,
    "GI": 23,
    "GL": 18,
    "GR": 27,
    "GT": 28,
    "HR": 21,
    "HU": 28,
    "IE": 22,
    "IL": 23,
    "IS": 26,
    "IT": 27,
    "JO": 30,
    "KW": 30,
    "KZ": 20,
    "LB": 28,
    "LI": 21,
    "LT": 20,
    "LU": 20,
    "LV": 21,
    "MC": 27,
    "MD": 24,
    "ME": 22,
    "MK": 19,
    "MR": 27,
    "MT": 31,
    "MU": 30,
    "NL": 18,
    "NO": 15,
    "PK": 24,
    "PL": 28,
    "PS": 29,
    "PT": 25,
    "QA": 29,
    "RO": 24,
    "RS": 22,
    "SA": 24,
    "SE": 24,
    "SI": 19,
    "SK": 24,
    "SM": 27,
    "TN": 24,
    "TR": 26,
    "UA": 29,
    "VG": 24,
    "XK": 20,
}


def iban(value: str) -> bool:
    compact = re.sub(r"\s", "", value).upper()
    if _IBAN_LENGTHS.get(compact[:2]) != len(compact):
        return False
    rearranged = compact[4:] + compact[:4]
    number = "".join(str(int(c, 36)) for c in rearranged)
    return int(number) % 97 == 1


def ssn(value: str) -> bool:
    area, group, serial = value.split("-")
    return area not in ("000", "666") and not area.startswith("9") and group != "00" and serial != "0000"


def ipv4(value: str) -> bool:
    try:
        address = ipaddress.IPv4Address(value)
    except ValueError:
        return False
    return not (address.is_loopback or address.is_unspecified)  # version-like 0.0.0.0 / 127.0.0.1 are not PII


def ipv6(value: str) -> bool:
    try:
        address = ipaddress.IPv6Address(value)
    except ValueError:
        return False
    return not (address.is_loopback or address.is_unspecified) and value.count(":") >= 3


def phone(value: str) -> bool:
    digits = re.sub(r"\D", "", value)
    return 10 <= len(digits) <= 15 and len(set(digits)) > 2


DETECTORS: tuple[Detector, ...] = (
    # secrets first: a key must not be half-eaten by a broader PII pattern. A key's prefix is its own boundary: one
    # glued to a word (`f_AKIA…`, `xAKIA…EXAMPLEx`, a tool named `get_ghp_…`) is still the key to whoever reads it;
    # only `sk-`, the end of common words (`task-`), needs no letter or digit before it.
    Detector(
        "private_key",
        "secret",
        re.compile(
            r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----[\s\S]*?(?:-----END (?:[A-Z0-9]+ )*PRIVATE KEY"
            r"(?: BLOCK)?-----|\Z)"
        ),
        in_base64=True,
        needles=("-----BEGIN ",),
    ),
    Detector(
        "aws_access_key",
        "secret",
        re.compile(r"(?:AKIA|ASIA|ABIA|ACCA)[0-9A-Z]{16}"),
        in_base64=True,
        needles=("AKIA", "ASIA", "ABIA", "ACCA"),
    ),
    Detector(
        "aws_secret_key",
        "secret",
        re.compile(r"(?i)aws.{0,20}?(?:secret|private).{0,20}?[\"'=: ]\s*([A-Za-z0-9/+]{40})(?![A-Za-z0-9/+])"),
        group=1,
        in_base64=True,
    ),
    Detector(
        "gcp_api_key",
        "secret",
        re.compile(r"AIza[0-9A-Za-z_\-]{35}(?![0-9A-Za-z_\-])"),
        in_base64=True,
        needles=("AIza",),
    ),
    Detector(
        "gcp_service_account",
        "secret",
        re.compile(r"\"type\"\s*:\s*\"service_account\""),
        in_base64=True,
        needles=('"type"',),
    ),
    Detector(
        "github_token",
        "secret",
        re.compile(r"(?:gh[pousr]_[A-Za-z0-9]{36,255}|github_pat_[A-Za-z0-9_]{22,255})"),
        in_base64=True,
        needles=("ghp_", "gho_", "ghu_", "ghs_", "ghr_", "github_pat_"),
    ),
    Detector(
        "anthropic_api_key", "secret", re.compile(r"sk-ant-[A-Za-z0-9_\-]{20,}"), in_base64=True, needles=("sk-ant-",)
    ),
    Detector(
        "openai_api_key",
        "secret",
        re.compile(
            r"(?<![A-Za-z0-9])sk-(?:proj-|svcacct-|admin-)?[A-Za-z0-9_\-]{20,}(?:T3BlbkFJ[A-Za-z0-9_\-]{20,})?(?![A-Za-z0-9_\-])"
        ),
        in_base64=True,
        needles=("sk-",),
    ),
    Detector("slack_token", "secret", re.compile(r"xox[abposr]-[A-Za-z0-9-]{10,}"), in_base64=True, needles=("xox",)),
    Detector(
        "jwt",
        "secret",
        re.compile(r"eyJ[A-Za-z0-9_-]{5,}\.eyJ[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]{10,}"),
        in_base64=True,
        needles=("eyJ",),
    ),
    Detector(
        "email",
        "pii",
        re.compile(  # an ASCII look-behind: a letter of another script just before an address (`ébob@…`) hides nothing
            r"(?<![A-Za-z0-9_.+-])[A-Za-z0-9](?:[A-Za-z0-9._%+-]{0,63})@(?:[A-Za-z0-9-]{1,63}\.)+[A-Za-z]{2,24}\b"
        ),
        needles=("@",),
    ),
    Detector("iban", "pii", re.compile(r"\b[A-Z]{2}\d{2}(?: ?[A-Z0-9]{4}){2,7}(?: ?[A-Z0-9]{1,4})?\b"), iban),
    Detector("credit_card", "pii", re.compile(r"(?<![\d-])(?:\d[ -]?){12,18}\d(?![\d-])"), luhn),
    Detector("us_ssn", "pii", re.compile(r"(?<![\d-])\d{3}-\d{2}-\d{4}(?![\d-])"), ssn, needles=("-",)),
    Detector("ip_address", "pii", re.compile(r"(?<![\d.])(?:\d{1,3}\.){3}\d{1,3}(?![\d.])"), ipv4, needles=(".",)),
    Detector(
        "ip_address",
        "pii",
        re.compile(r"(?<![\w:.])(?:[0-9a-fA-F]{0,4}:){2,7}[0-9a-fA-F]{0,4}(?![\w:])"),
        ipv6,
        needles=(":",),
    ),
    Detector(
        "phone",
        "pii",
        re.compile(
            r"(?<![\w+])(?:\+\d{1,3}(?:[ .-]?\(?\d{1,4}\)?){2,5}|(?:\(\d{3}\)[ .-]?|\d{3}[.-])\d{3}[.-]\d{4})"
            r"(?![\w-])"
        ),
        phone,
    ),
)

TYPES = tuple(sorted({d.type for d in DETECTORS}))


def find(text: str, types: Iterable[str] | None = None) -> list[Finding]:
    """Validated findings in text order, without overlaps: in the text as it is, then in its folded and unescaped
    views (gateway/guard/folding.py; the earlier detector in DETECTORS wins a tie, the text as it is over a view of
    it), then in its base64 runs."""
    wanted = set(types) if types is not None else None
    detectors = [d for d in DETECTORS if wanted is None or d.type in wanted]
    read = views(text)
    found: list[Finding] = []
    taken: list[tuple[int, int]] = []

    def take(finding: Finding) -> None:
        if not any(finding.start < e and s < finding.end for s, e in taken):
            taken.append((finding.start, finding.end))
            found.append(finding)

    for detector in detectors:
        for view in read:
            for start, end in _matches(detector, view.text):
                take(Finding(detector.type, detector.kind, *view.source(start, end)))
    encoded = [d for d in detectors if d.in_base64]
    if encoded:
        for finding in _in_base64(text, encoded):
            take(finding)
    found.sort(key=lambda f: f.start)
    return found


def find_across(texts: list[str], types: Iterable[str] | None = None) -> list[list[Finding]]:
    """What only the texts read one after another show (a key split across two content parts in a row): each
    finding of the joined texts that crosses from one into the next, as its piece in each text it covers."""
    ends = list(accumulate(len(text) for text in texts))
    pieces: list[list[Finding]] = [[] for _ in texts]
    for found in find("".join(texts), types):
        first, last = bisect_right(ends, found.start), bisect_right(ends, found.end - 1)
        for i in range(first, last + 1) if first != last else ():
            start = ends[i] - len(texts[i])
            piece = Finding(found.type, found.kind, max(found.start, start) - start, min(found.end, ends[i]) - start)
            if piece.end > piece.start:
                pieces[i].append(piece)
    return pieces


def _matches(detector: Detector, text: str) -> Iterator[tuple[int, int]]:
    if detector.needles and not any(needle in text for needle in detector.needles):
        return
    for match in detector.pattern.finditer(text):
        start, end = match.span(detector.group)
        if start >= 0 and not (detector.validate and not detector.validate(match.group(detector.group))):
            yield start, end


# Base64 runs (standard or URL-safe alphabet) a secret may be encoded in: 24 characters are 18 bytes, less than the
# shortest key; past MAX_BASE64_RUN a run is a file or an image, which is not decoded (the bound on the cost).
MIN_BASE64_RUN, MAX_BASE64_RUN = 24, 8192
_BASE64_RUN = re.compile(rf"[A-Za-z0-9+/_-]{{{MIN_BASE64_RUN},}}={{0,2}}")
_URL_SAFE = str.maketrans("-_", "+/")
_HEX_RUN = re.compile(rf"[0-9A-Fa-f]{{{MIN_BASE64_RUN},}}")  # hex digits inside a run: 24 of them are 12 bytes
# the shortest secret a detector finds (a Slack token) is 15 characters of text: bytes without such a stretch are not
# read further (what a file, an image or a random id decodes to), which keeps base64-heavy text cheap
_TEXT_STRETCH = re.compile(r"[\x20-\x7e\t\r\n]{15,}")


def _in_base64(text: str, detectors: list[Detector]) -> Iterator[Finding]:
    """A finding for each base64 run that decodes to text one of these detectors finds something in, covering the
    whole run. The run is decoded from each of its first four characters: what precedes the encoding in the run
    (`token` in `tokenQUtJQ…`) shifts where its groups of four start. Hex digits in a run are read as hex first (a
    finding there covers those digits)."""
    for run in _BASE64_RUN.finditer(text):
        encoded = run.group().rstrip("=").translate(_URL_SAFE)
        if len(encoded) > MAX_BASE64_RUN:
            continue
        hexed = [(h.start(), h.end(), _hex_hit(h.group(), detectors)) for h in _HEX_RUN.finditer(run.group())]
        if any(hit for _, _, hit in hexed):
            yield from (Finding(h.type, h.kind, run.start() + a, run.start() + b) for a, b, h in hexed if h)
            continue
        for shift in range(4):
            part = encoded[shift:]
            part = part[:-1] if len(part) % 4 == 1 else part + "=" * (-len(part) % 4)  # a last char alone is no byte
            try:
                plain = base64.b64decode(part, validate=True).decode("latin-1")
            except (binascii.Error, ValueError):
                continue
            if not _TEXT_STRETCH.search(plain):
                continue
            hit = next((d for d in detectors if next(_matches(d, plain), None)), None)
            if hit is not None:
                yield Finding(hit.type, hit.kind, run.start(), run.end())
                break


def _hex_hit(encoded: str, detectors: list[Detector]) -> Detector | None:
    """The detector that finds something in what a hex run decodes to, from either of its first two digits."""
    for shift in (0, 1):
        part = encoded[shift : len(encoded) - (len(encoded) - shift) % 2]
        plain = bytes.fromhex(part).decode("latin-1")
        if _TEXT_STRETCH.search(plain):
            hit = next((d for d in detectors if next(_matches(d, plain), None)), None)
            if hit is not None:
                return hit
    return None


def redact(text: str, findings: list[Finding]) -> str:
    out, last = [], 0
    for f in findings:
        out.append(text[last : f.start])
        out.append(f.placeholder())
        last = f.end
    out.append(text[last:])
    return "".join(out)
