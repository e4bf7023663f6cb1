"""Evaluation harness over ../shared/corpora/waf: the OWASP CRS regression tests and libinjection's lists, decided
by the same WAF engine the gateway runs, on synthetic requests (no proxy in between).

Mapping (see docs/benchmarks.md): each go-ftw stage is turned into the bytes go-ftw sends and passed through the
parsers of the gateway's HTTP server (tests/waf_corpus/wire.py): a request the server refuses with 400 before the
app sees it (an invalid method or HTTP version, a target without a path) counts as *refused*, that is blocked;
otherwise the method, target, headers and the body as the server framed it become a RequestView; a body without
Content-Type or form-encoded is parsed as form arguments, JSON into its leaves, multipart into fields, XML into
attribute values and text, any other type is one argument. The web-attack packs run, and the gateway's own
`protocol` pack without the two rules that pin its API's shape (POST, application/json), which would refuse every
other request. An attack stage (go-ftw `expect_ids`) counts as caught when it is refused or the WAF blocks it
(anomaly score >= 5); a stage expecting no match (`no_expect_ids`) counts as passed when it is neither.
libinjection lines are URL-encoded query values: `GET /?x=<line>`, sent with the User-Agent every CRS stage
sends, so that a list judges its values and not the missing header (a request without a User-Agent scores 2 more
at paranoia level 2, scanner-120).

A no-match stage only says that *its* CRS rule must stay quiet, so some carry the very payload another stage of the
corpus expects to be caught (932230's `;cat /path/file.gz` is 932236's attack). Such a stage is *contested*: no WAF
can pass it and catch its twin. The pass rate is reported over all no-match stages and, separately, over the
uncontested ones.

    python -m tests.waf_corpus.harness [--level 1 2] [--json FILE] [--family 933 934 libinjection]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

from gateway.waf.cases import Case, load_cases
from gateway.waf.engine import CompiledWaf
from gateway.waf.model import Exclusion, WafSpec
from gateway.waf.packs import compile_waf, pack_rules
from gateway.waf.parts import RequestView, from_raw_http
from tests.waf_corpus.wire import served, wire_bytes

CORPUS = Path(__file__).resolve().parents[2].parent / "shared" / "corpora" / "waf"
CRS = CORPUS / "crs-regression-tests"
LIBINJECTION = CORPUS / "libinjection"
TEST_AGENT = "OWASP CRS test agent"  # go-ftw's User-Agent in every CRS stage
WEB_PACKS = [
    "protocol",
    "scanners",
    "protocol-attack",
    "protocol-enforcement",
    "lfi",
    "rce",
    "xss",
    "sqli",
    "java",
    "rfi",
    "php",
    "generic",
    "session-fixation",
]


@dataclass
class Tally:
    attacks: int = 0
    caught: int = 0
    benign: int = 0
    passed: int = 0
    uncontested: int = 0  # no-match stages whose payload is no attack stage's
    uncontested_passed: int = 0
    refused: int = 0  # stages the HTTP server answers before the WAF runs

    @property
    def catch_rate(self) -> float:
        return self.caught / self.attacks if self.attacks else float("nan")

    @property
    def pass_rate(self) -> float:
        return self.passed / self.benign if self.benign else float("nan")

    @property
    def uncontested_pass_rate(self) -> float:
        return self.uncontested_passed / self.uncontested if self.uncontested else float("nan")


API_SHAPE = Exclusion(id="api-shape", rules=["protocol-100", "protocol-110"])  # POST and JSON only


def web_waf(level: int) -> CompiledWaf:
    spec = WafSpec(paranoia_level=level, packs=WEB_PACKS, exclusions=[API_SHAPE])
    return compile_waf(spec, pack_rules({}), "harness")


def as_served(case: Case) -> RequestView | None:
    """The stage's request as the gateway's HTTP server hands it to the WAF, None when the server refuses it."""
    request = served(wire_bytes(case.given))
    if request is None:
        return None
    uri = request.path + ("?" + request.query if request.query else "")
    return from_raw_http(request.method, uri, request.headers, request.body)


def crs_cases() -> dict[str, list[Case]]:
    """The stages that say something about detection, by family (status-only or log-regex stages are left out)."""
    return {
        family.name: [c for c in load_cases(family) if c.expect_ids or c.no_expect_ids]
        for family in sorted(p for p in CRS.iterdir() if p.is_dir() and p.name.startswith("REQUEST-"))
    }


def payload_values(view: RequestView) -> set[str]:
    """What a stage sends that could carry an attack: arguments and their names, multipart field and file names,
    cookies, Referer, User-Agent, path."""
    targets = ("args", "args_names", "multipart_names", "cookies")
    values = {text.strip() for target in targets for _, text, _ in view.values(target)}
    values |= {
        text.strip() for part, text, _ in view.values("headers") if part in ("header:referer", "header:user-agent")
    }
    values.add(view.path)
    return {v for v in values if len(v) >= 6}


def contested_stages(families: dict[str, list[Case]], boilerplate: int = 5) -> set[str]:
    """No-match stages that send a value an attack stage sends. A value seen in `boilerplate` or more stages is
    shared filler (the test User-Agent, a form's other field), not a payload, and contests nothing."""
    stages = [c for cases in families.values() for c in cases]
    values = {c.name: payload_values(c.view) for c in stages}
    seen = Counter(v for vs in values.values() for v in vs)
    attacks = {v for c in stages if c.expect_ids for v in values[c.name] if seen[v] < boilerplate}
    return {c.name for c in stages if not c.expect_ids and values[c.name] & attacks}


def selected(name: str, only: list[str] | None) -> bool:
    return not only or any(text in name for text in only)


def crs_families(waf: CompiledWaf, misses: dict | None = None, only: list[str] | None = None) -> dict[str, Tally]:
    """Tallies per CRS family; `only` evaluates just the families whose name contains one of its texts (contested
    stages are still judged against every family's attacks)."""
    out: dict[str, Tally] = {}
    families = crs_cases()
    contested = contested_stages(families)
    for family, cases in families.items():
        if not selected(family, only):
            continue
        tally = out[family] = Tally()
        for case in cases:
            view = as_served(case)
            tally.refused += view is None
            blocked = view is None or waf.evaluate(view).blocked
            if case.expect_ids:
                tally.attacks += 1
                tally.caught += blocked
                if not blocked and misses is not None:
                    misses.setdefault(family, []).append(("miss", case))
            else:
                tally.benign += 1
                tally.passed += not blocked
                if case.name not in contested:
                    tally.uncontested += 1
                    tally.uncontested_passed += not blocked
                if blocked and misses is not None:
                    misses.setdefault(family, []).append(("fp", case))
    return out


def libinjection_request(line: str) -> RequestView:
    return from_raw_http(
        "GET", "/?x=" + line.replace("&", "%26"), [("Host", "localhost"), ("User-Agent", TEST_AGENT)], b""
    )


def libinjection_lists(waf: CompiledWaf, misses: dict | None = None) -> dict[str, Tally]:
    out: dict[str, Tally] = defaultdict(Tally)
    for path in sorted(LIBINJECTION.glob("*.txt")):
        kind = "false_positives" if path.name == "false_positives.txt" else path.name.split("-")[0]
        tally = out[kind]
        for line in path.read_text(errors="replace").splitlines():
            if not line.strip() or line.startswith("#"):
                continue
            view = libinjection_request(line)
            blocked = waf.evaluate(view).blocked
            if kind == "false_positives":
                tally.benign += 1
                tally.passed += not blocked
                if blocked and misses is not None:
                    misses.setdefault(kind, []).append(("fp", line))
            else:
                tally.attacks += 1
                tally.caught += blocked
                if not blocked and misses is not None:
                    misses.setdefault(kind, []).append(("miss", line))
    return dict(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--level", type=int, nargs="*", default=[1, 2])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--misses", help="print misses/false positives of families containing this text")
    parser.add_argument(
        "--family", nargs="*", help="evaluate only the families whose name contains one of these ('libinjection' too)"
    )
    args = parser.parse_args(argv)
    if not CRS.is_dir():
        print(f"corpus not found at {CORPUS}", file=sys.stderr)
        return 2
    results = {}
    for level in args.level:
        waf = web_waf(level)
        misses: dict = {}
        started = time.perf_counter()
        tallies = dict(crs_families(waf, misses, args.family))
        if selected("libinjection", args.family):
            tallies |= {f"libinjection {k}": v for k, v in libinjection_lists(waf, misses).items()}
        elapsed = time.perf_counter() - started
        results[level] = {k: vars(v) for k, v in tallies.items()}
        print(f"\nparanoia level {level}: {len(waf.rules)} rules, {elapsed:.1f}s")
        print(
            f"{'family':48} {'attacks':>8} {'caught':>8} {'rate':>7} {'benign':>7} {'passed':>7} {'rate':>7} "
            f"{'uncont.':>7} {'rate':>7} {'refused':>7}"
        )
        for name, t in tallies.items():
            print(
                f"{name:48} {t.attacks:8} {t.caught:8} {t.catch_rate:7.1%} {t.benign:7} {t.passed:7} "
                f"{t.pass_rate:7.1%} {t.uncontested:7} {t.uncontested_pass_rate:7.1%} {t.refused:7}"
            )
        if args.misses:
            for family, items in misses.items():
                if args.misses in family:
                    for kind, item in items:
                        if hasattr(item, "view"):
                            v = as_served(item)
                            if v is None:
                                print(kind, item.name.rpartition("/")[2], "refused by the HTTP server")
                                continue
                            fired = [f"{m.rule.id}@{m.hit.part}" for m in waf.evaluate(v, all_matches=True).matches]
                            print(
                                kind,
                                item.name.rpartition("/")[2],
                                fired,
                                v.method,
                                v.path,
                                v.query[:150],
                                v.body[:150],
                                [h for h in v.headers if h[0] not in ("host", "accept", "user-agent")][:3],
                            )
                        else:
                            v = libinjection_request(item)
                            print(kind, [m.rule.id for m in waf.evaluate(v, all_matches=True).matches], item[:200])
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
