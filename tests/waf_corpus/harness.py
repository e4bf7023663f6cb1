"""Evaluation harness over ../shared/corpora/waf: the OWASP CRS regression tests and libinjection's lists, decided
by the same WAF engine the gateway runs, on synthetic requests (no proxy in between).

Mapping (see docs/benchmarks.md): each go-ftw stage's method, uri (path and query), headers and data become a
RequestView; a body without Content-Type or form-encoded is parsed as form arguments, JSON into its leaves,
multipart into fields, XML into attribute values and text, any other type is one argument. Only the web-attack
packs run (not the gateway's own protocol pack, which would refuse every non-`POST /v1/...` request). An attack
stage (go-ftw `expect_ids`) counts as caught when the WAF blocks it (anomaly score >= 5); a stage expecting no
match (`no_expect_ids`) counts as passed when the WAF does not block it. libinjection lines are URL-encoded query
values: `GET /?x=<line>`.

    python -m tests.waf_corpus.harness [--level 1 2] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from gateway.waf.cases import load_cases
from gateway.waf.engine import CompiledWaf
from gateway.waf.model import WafSpec
from gateway.waf.packs import compile_waf, pack_rules
from gateway.waf.parts import from_raw_http

CORPUS = Path(__file__).resolve().parents[2].parent / "shared" / "corpora" / "waf"
CRS = CORPUS / "crs-regression-tests"
LIBINJECTION = CORPUS / "libinjection"
WEB_PACKS = ["scanners", "protocol-attack", "lfi", "rce", "xss", "sqli"]


@dataclass
class Tally:
    attacks: int = 0
    caught: int = 0
    benign: int = 0
    passed: int = 0

    @property
    def catch_rate(self) -> float:
        return self.caught / self.attacks if self.attacks else float("nan")

    @property
    def pass_rate(self) -> float:
        return self.passed / self.benign if self.benign else float("nan")


def web_waf(level: int) -> CompiledWaf:
    spec = WafSpec(paranoia_level=level, packs=WEB_PACKS)
    return compile_waf(spec, pack_rules({}), "harness")


def crs_families(waf: CompiledWaf, misses: dict | None = None) -> dict[str, Tally]:
    out: dict[str, Tally] = {}
    for family in sorted(p for p in CRS.iterdir() if p.is_dir() and p.name.startswith("REQUEST-")):
        tally = out[family.name] = Tally()
        for case in load_cases(family):
            if not case.expect_ids and not case.no_expect_ids:
                continue  # status-only or log-regex stages: nothing about detection to compare
            blocked = waf.evaluate(case.view).blocked
            if case.expect_ids:
                tally.attacks += 1
                tally.caught += blocked
                if not blocked and misses is not None:
                    misses.setdefault(family.name, []).append(("miss", case))
            else:
                tally.benign += 1
                tally.passed += not blocked
                if blocked and misses is not None:
                    misses.setdefault(family.name, []).append(("fp", case))
    return out


def libinjection_lists(waf: CompiledWaf, misses: dict | None = None) -> dict[str, Tally]:
    out: dict[str, Tally] = defaultdict(Tally)
    for path in sorted(LIBINJECTION.glob("*.txt")):
        kind = "false_positives" if path.name == "false_positives.txt" else path.name.split("-")[0]
        tally = out[kind]
        for line in path.read_text(errors="replace").splitlines():
            if not line.strip() or line.startswith("#"):
                continue
            view = from_raw_http("GET", "/?x=" + line.replace("&", "%26"), [("Host", "localhost")], b"")
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
    args = parser.parse_args(argv)
    if not CRS.is_dir():
        print(f"corpus not found at {CORPUS}", file=sys.stderr)
        return 2
    results = {}
    for level in args.level:
        waf = web_waf(level)
        misses: dict = {}
        started = time.perf_counter()
        tallies = {**crs_families(waf, misses), **{f"libinjection {k}": v for k, v in
                                                    libinjection_lists(waf, misses).items()}}
        elapsed = time.perf_counter() - started
        results[level] = {k: vars(v) for k, v in tallies.items()}
        print(f"\nparanoia level {level}: {len(waf.rules)} rules, {elapsed:.1f}s")
        print(f"{'family':48} {'attacks':>8} {'caught':>8} {'rate':>7} {'benign':>7} {'passed':>7} {'rate':>7}")
        for name, t in tallies.items():
            print(f"{name:48} {t.attacks:8} {t.caught:8} {t.catch_rate:7.1%} {t.benign:7} {t.passed:7} "
                  f"{t.pass_rate:7.1%}")
        if args.misses:
            for family, items in misses.items():
                if args.misses in family:
                    for kind, item in items:
                        if hasattr(item, "view"):
                            v = item.view
                            fired = [f"{m.rule.id}@{m.hit.part}" for m in waf.evaluate(v, all_matches=True).matches]
                            print(kind, item.name.rpartition("/")[2], fired, v.method, v.path, v.query[:150],
                                  v.body[:150], [h for h in v.headers if h[0] not in ("host", "accept",
                                                                                      "user-agent")][:3])
                        else:
                            from gateway.waf.parts import from_raw_http as raw
                            v = raw("GET", "/?x=" + item.replace("&", "%26"), [], b"")
                            print(kind, [m.rule.id for m in waf.evaluate(v, all_matches=True).matches], item[:200])
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
