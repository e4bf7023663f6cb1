"""PII and secrets detectors: regular expressions narrowed by validators (Luhn, IBAN mod 97, SSN ranges, IP octets).

Each detector has a type (`email`, `credit_card`, `aws_access_key`, ...) and a kind (`pii` or `secret`). `find()`
returns the validated matches without overlaps; `redact()` replaces each with a typed placeholder such as
`[REDACTED:EMAIL]`, so the model (or the client) still sees that something was there and what it was.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Detector:
    type: str
    kind: str  # "pii" | "secret"
    pattern: re.Pattern
    validate: Callable[[str], bool] | None = None
    group: int = 0


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
    # secrets first: a key must not be half-eaten by a broader PII pattern
    Detector(
        "private_key",
        "secret",
        re.compile(
            r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----[\s\S]*?(?:-----END (?:[A-Z0-9]+ )*PRIVATE KEY"
            r"(?: BLOCK)?-----|\Z)"
        ),
    ),
    Detector("aws_access_key", "secret", re.compile(r"\b(?:AKIA|ASIA|ABIA|ACCA)[0-9A-Z]{16}\b")),
    Detector(
        "aws_secret_key",
        "secret",
        re.compile(r"(?i)aws.{0,20}?(?:secret|private).{0,20}?[\"'=: ]\s*([A-Za-z0-9/+]{40})(?![A-Za-z0-9/+])"),
        group=1,
    ),
    Detector("gcp_api_key", "secret", re.compile(r"\bAIza[0-9A-Za-z_\-]{35}(?![0-9A-Za-z_\-])")),
    Detector("gcp_service_account", "secret", re.compile(r"\"type\"\s*:\s*\"service_account\"")),
    Detector(
        "github_token", "secret", re.compile(r"\b(?:gh[pousr]_[A-Za-z0-9]{36,255}|github_pat_[A-Za-z0-9_]{22,255})\b")
    ),
    Detector("anthropic_api_key", "secret", re.compile(r"\bsk-ant-[A-Za-z0-9_\-]{20,}")),
    Detector(
        "openai_api_key",
        "secret",
        re.compile(
            r"\bsk-(?:proj-|svcacct-|admin-)?[A-Za-z0-9_\-]{20,}(?:T3BlbkFJ[A-Za-z0-9_\-]{20,})?(?![A-Za-z0-9_\-])"
        ),
    ),
    Detector("slack_token", "secret", re.compile(r"\bxox[abposr]-[A-Za-z0-9-]{10,}")),
    Detector("jwt", "secret", re.compile(r"\beyJ[A-Za-z0-9_-]{5,}\.eyJ[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]{10,}")),
    Detector(
        "email",
        "pii",
        re.compile(r"(?<![\w.+-])[A-Za-z0-9](?:[A-Za-z0-9._%+-]{0,63})@(?:[A-Za-z0-9-]{1,63}\.)+[A-Za-z]{2,24}\b"),
    ),
    Detector("iban", "pii", re.compile(r"\b[A-Z]{2}\d{2}(?: ?[A-Z0-9]{4}){2,7}(?: ?[A-Z0-9]{1,4})?\b"), iban),
    Detector("credit_card", "pii", re.compile(r"(?<![\d-])(?:\d[ -]?){12,18}\d(?![\d-])"), luhn),
    Detector("us_ssn", "pii", re.compile(r"(?<![\d-])\d{3}-\d{2}-\d{4}(?![\d-])"), ssn),
    Detector("ip_address", "pii", re.compile(r"(?<![\d.])(?:\d{1,3}\.){3}\d{1,3}(?![\d.])"), ipv4),
    Detector("ip_address", "pii", re.compile(r"(?<![\w:.])(?:[0-9a-fA-F]{0,4}:){2,7}[0-9a-fA-F]{0,4}(?![\w:])"), ipv6),
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
    """Validated findings in text order, without overlaps (the earlier detector in DETECTORS wins a tie)."""
    wanted = set(types) if types is not None else None
    found: list[Finding] = []
    taken: list[tuple[int, int]] = []
    for detector in DETECTORS:
        if wanted is not None and detector.type not in wanted:
            continue
        for match in detector.pattern.finditer(text):
            start, end = match.span(detector.group)
            if start < 0 or (detector.validate and not detector.validate(match.group(detector.group))):
                continue
            if any(start < e and s < end for s, e in taken):
                continue
            taken.append((start, end))
            found.append(Finding(detector.type, detector.kind, start, end))
    found.sort(key=lambda f: f.start)
    return found


def redact(text: str, findings: list[Finding]) -> str:
    out, last = [], 0
    for f in findings:
        out.append(text[last : f.start])
        out.append(f.placeholder())
        last = f.end
    out.append(text[last:])
    return "".join(out)
