"""An independent check of the WAF: attack payloads from scanners' own lists, which no rule was written from, sent
where an attacker puts them in a chat request, and benign prompts sent as chat messages, through the same compiled
WAF the gateway runs (every built-in pack, `protocol` and `llm` included, at each paranoia level).

The lists are third-party (GPL-2.0 and MIT) and are not committed: fetch them once into a folder, then point
`--corpus` at it. Nothing is downloaded here.

    mkdir -p DIR && cd DIR
    apt-get download wfuzz=3.1.0-2 sqlmap=1.7.2-1         # Debian bookworm, GPL-2.0
    pip download --no-deps wapiti3==3.2.3 brs-kb==4.0.2   # GPL-2.0, MIT
    for d in *.deb; do dpkg-deb -x "$d" .; done; for w in *.whl; do unzip -qo "$w"; done
    python -m tests.waf_corpus.independent --corpus DIR [--level 1 2] [--json FILE] [--misses sqli]

Families and where their payloads come from (scanner placeholders filled as the scanner fills them):
- sqli: sqlmap's detection payloads (data/xml/payloads, every test's request payload after a numeric, a quoted and
  a commented boundary), wfuzz's Injections/SQL.txt and vulns/sql_inj.txt, wapiti's blindSQLPayloads.ini;
- xss: wfuzz's Injections/XSS.txt, wapiti's xssPayloads.ini, brs-kb's payloads for an HTML context;
- traversal: wfuzz's Injections/Traversal.txt and vulns/dirTraversal*.txt, wapiti's fileHandlingPayloads.ini
  (local files);
- cmdi: wapiti's execPayloads.ini (shell commands and code evaluation);
- rfi-ssrf: wapiti's remote inclusions (fileHandlingPayloads.ini) and its SSRF probe URL;
- template: brs-kb's template-injection payloads that carry template delimiters.
A payload that is one bare word (`id`, `env`, `A`) is left out: a scanner sends it for a parameter that is already
run as a command, and it is no different from a benign value.

Each payload goes, one request each, into a query argument (`?q=`, percent-encoded), the chat body's `user` field
and the User-Agent header of an otherwise ordinary `POST /v1/chat/completions`; a payload counts as caught in a
place when the WAF blocks that request. Benign traffic: the label-0 rows of ../shared/datasets/prompt_injection
(S-Labs, neuralchemy) and guard_models/data/hard_negatives.jsonl as the user message; a row blocked is a false
positive. The web-attack packs do not read the prompt, so the same rows are also sent as arguments, where those
packs do read them (natural language and code as a client's free-text parameter): each row once in the query
argument and once in the body's `user` field of an ordinary chat request, with the rules that blocked it counted.
"""

from __future__ import annotations

import argparse
import configparser
import csv
import json
import re
import sys
import time
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import quote

from bench.waf_bench import HEADERS  # an OpenAI SDK client's headers
from gateway.waf.engine import CompiledWaf
from gateway.waf.model import WafSpec
from gateway.waf.packs import builtin_packs, compile_waf, pack_rules
from gateway.waf.parts import RequestView

ROOT = Path(__file__).resolve().parents[2]
BENIGN = ROOT.parent / "shared" / "datasets" / "prompt_injection"
HARD_NEGATIVES = ROOT / "guard_models" / "data" / "hard_negatives.jsonl"
WFUZZ = "usr/share/wfuzz/wordlist"
SQLMAP = "usr/share/sqlmap/data/xml/payloads"
WAPITI = "wapitiCore/data/attacks"
PLACES = ("query", "json", "header")
ARGUMENT_PLACES = ("query", "json")  # where a benign row goes as an argument (a header carries no line breaks)
BARE_WORD = re.compile(r"\w*")

# What each scanner puts in place of its placeholders (wapiti: the parameter's own value, its external endpoint).
WAPITI_FILL = {
    "[VALUE]": "report",
    "[DIRVALUE]": "docs",
    "[EXTVALUE]": "txt",
    "[FILE_NAME]": "index.php",
    "[NULL]": "\0",
    "[LF]": "\n",
    "[TAB]": "\t",
    "[FF]": "\f",
    "[SPACE]": " ",
    "[TIME]": "6",
    "[ATTR_SEP]": " ",
    "[VALUE_SEP]": '"',
    "[EXTERNAL_ENDPOINT]": "http://wapiti3.ovh/",
    "[PROTO_ENDPOINT]": "wapiti3.ovh/",
    "__XSS__": "w1k9x3",
}
WFUZZ_FILL = {"{FILE}": "etc/passwd"}  # dirTraversal.txt: "replace {FILE} with ... a local resource"
SQLMAP_FILL = {
    "[RANDNUM]": "4821",
    "[RANDNUM1]": "7310",
    "[RANDSTR]": "qZvX",
    "[SLEEPTIME]": "5",
    "[DELIMITER_START]": "qvkpq",
    "[DELIMITER_STOP]": "qbjzq",
    "[INFERENCE]": "4821=4821",
    "[ORIGVALUE]": "1",
    "[GENERIC_SQL_COMMENT]": "-- -",
    "[SPACE_REPLACE]": " ",
    "[DOLLAR_REPLACE]": "$",
    "[AT_REPLACE]": "@",
    "[HASH_REPLACE]": "#",
}
SQLMAP_BOUNDARIES = [("1 ", ""), ("1' ", " AND 'qZvX'='qZvX"), ("1') ", "-- -")]


def fill(text: str, values: dict[str, str]) -> str:
    for placeholder, value in values.items():
        text = text.replace(placeholder, value)
    return text


def lines(path: Path) -> Iterator[str]:
    for line in path.read_text(errors="replace").splitlines():
        if line.strip() and not line.startswith("#"):
            yield fill(line, WFUZZ_FILL)


def wapiti(path: Path, keep: Callable[[str], bool] = lambda section: True) -> Iterator[str]:
    ini = configparser.ConfigParser(interpolation=None)
    ini.read(path)
    for section in ini.sections():
        payload = ini[section].get("payload", "None")
        if payload != "None" and keep(section):
            yield fill(payload, WAPITI_FILL)


def sqlmap(folder: Path) -> Iterator[str]:
    for path in sorted(folder.glob("*.xml")):
        for test in ET.parse(path).getroot().iter("test"):
            payload = test.findtext("request/payload") or ""
            if not payload and test.findtext("vector") == "[UNION]":
                char = test.findtext("request/char") or "NULL"
                table = test.findtext("request/fromTable") or ""
                concat = "CONCAT('[DELIMITER_START]','qZvX','[DELIMITER_STOP]')"
                payload = f"UNION ALL SELECT {char},{char},{concat}{table}[GENERIC_SQL_COMMENT]"
            if not payload:
                continue
            payload = fill(fill(payload, SQLMAP_FILL).replace("[CHAR]", "NULL"), SQLMAP_FILL)
            for prefix, suffix in SQLMAP_BOUNDARIES:
                yield prefix + payload + suffix


def brs_kb(corpus: Path, keep: Callable[[list[str], str], bool]) -> Iterator[str]:
    sys.path.insert(0, str(corpus))
    try:
        from brs_kb.payloads import FULL_PAYLOAD_DATABASE  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(corpus))
    for entry in FULL_PAYLOAD_DATABASE.values():
        if keep(list(entry.contexts), entry.payload):
            yield entry.payload


def is_remote(section: str) -> bool:
    return "remote" in section or "http" in section


TEMPLATE_DELIMITERS = re.compile(r"\{\{|\{%|\$\{|#\{|<%")


def families(corpus: Path) -> dict[str, dict[str, list[str]]]:
    """Payloads by family and source, each once, bare words left out."""
    sources: dict[str, dict[str, Iterator[str]]] = {
        "sqli": {
            "sqlmap 1.7.2": sqlmap(corpus / SQLMAP),
            "wfuzz 3.1.0": (p for f in ("Injections/SQL.txt", "vulns/sql_inj.txt") for p in lines(corpus / WFUZZ / f)),
            "wapiti3 3.2.3": wapiti(corpus / WAPITI / "blindSQLPayloads.ini"),
        },
        "xss": {
            "wfuzz 3.1.0": lines(corpus / WFUZZ / "Injections/XSS.txt"),
            "wapiti3 3.2.3": wapiti(corpus / WAPITI / "xssPayloads.ini"),
            "brs-kb 4.0.2": brs_kb(corpus, lambda contexts, p: "html_content" in contexts and "<" in p),
        },
        "traversal": {
            "wfuzz 3.1.0": (
                p
                for f in ("Injections/Traversal.txt", "vulns/dirTraversal.txt", "vulns/dirTraversal-nix.txt")
                for p in lines(corpus / WFUZZ / f)
            ),
            "wfuzz 3.1.0 (windows)": lines(corpus / WFUZZ / "vulns/dirTraversal-win.txt"),
            "wapiti3 3.2.3": wapiti(corpus / WAPITI / "fileHandlingPayloads.ini", lambda s: not is_remote(s)),
        },
        "cmdi": {"wapiti3 3.2.3": wapiti(corpus / WAPITI / "execPayloads.ini")},
        "rfi-ssrf": {
            "wapiti3 3.2.3": wapiti(corpus / WAPITI / "fileHandlingPayloads.ini", is_remote),
            "wapiti3 3.2.3 (ssrf)": iter(["http://wapiti3.ovh/ssrf/1a2b3c4d/71/75736572/"]),
        },
        "template": {
            "brs-kb 4.0.2": brs_kb(
                corpus,
                lambda contexts, p: "template_injection" in contexts and TEMPLATE_DELIMITERS.search(p) is not None,
            )
        },
    }
    out: dict[str, dict[str, list[str]]] = {}
    for family, by_source in sources.items():
        seen: set[str] = set()
        out[family] = {}
        for source, payloads in by_source.items():
            kept = [p for p in payloads if not BARE_WORD.fullmatch(p.strip()) and p not in seen]
            seen.update(kept)
            out[family][source] = kept
    return out


def gateway_waf(level: int) -> CompiledWaf:
    """Every built-in pack at one paranoia level, as policies/examples/waf.yaml enables them."""
    spec = WafSpec(paranoia_level=level, packs=sorted(builtin_packs()[0]))
    return compile_waf(spec, pack_rules({}), "independent")


def chat_request(prompt: str = "Summarise this paragraph for me.", place: str = "", payload: str = "") -> RequestView:
    body: dict = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": prompt}]}
    headers = list(HEADERS)
    query = ""
    if place == "query":
        query = "q=" + quote(payload, safe="")
    elif place == "json":
        body["user"] = payload
    elif place == "header":
        headers = [(name, payload if name == "user-agent" else value) for name, value in headers]
    raw = json.dumps(body).encode()
    return RequestView(
        method="POST",
        path="/v1/chat/completions",
        query=query,
        headers=headers + [("content-length", str(len(raw)))],
        body=raw,
        payload=body,
        route="chat",
        model=body["model"],
    )


def header_safe(payload: str) -> bool:
    """A value a client can send as a header (HTTP forbids CR, LF and NUL there)."""
    return not any(c in payload for c in "\r\n\0")


def benign_prompts() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for name in ("s-labs-train.csv", "s-labs-validation.csv"):
        with open(BENIGN / name, newline="") as f:
            out.setdefault("S-Labs", []).extend(r["text"] for r in csv.DictReader(f) if r["label"] == "0")
    for name in ("neuralchemy-core-train.jsonl", "neuralchemy-core-validation.jsonl"):
        rows = (json.loads(line) for line in (BENIGN / name).read_text().splitlines() if line.strip())
        out.setdefault("neuralchemy", []).extend(r["text"] for r in rows if r["label"] == 0)
    rows = (json.loads(line) for line in HARD_NEGATIVES.read_text().splitlines() if line.strip())
    out["hard negatives"] = [r["text"] for r in rows if r["label"] == 0]
    return out


def measure_attacks(waf: CompiledWaf, corpus: dict[str, dict[str, list[str]]], misses: dict) -> dict:
    """Per family and place: payloads sent, caught; misses[family] lists (place, payload) not caught."""
    out: dict[str, dict[str, list[int]]] = {}
    for family, by_source in corpus.items():
        tally = out[family] = defaultdict(lambda: [0, 0])
        for payload in (p for ps in by_source.values() for p in ps):
            for place in PLACES:
                if place == "header" and not header_safe(payload):
                    continue
                blocked = waf.evaluate(chat_request(place=place, payload=payload)).blocked
                tally[place][0] += 1
                tally[place][1] += blocked
                if not blocked:
                    misses.setdefault(family, []).append((place, payload))
    return {f: dict(t) for f, t in out.items()}


def measure_benign(waf: CompiledWaf, prompts: dict[str, list[str]], fps: dict) -> dict[str, list[int]]:
    out = {}
    for name, texts in prompts.items():
        blocked = [t for t in texts if waf.evaluate(chat_request(prompt=t)).blocked]
        fps[name] = blocked
        out[name] = [len(texts), len(blocked)]
    return out


def measure_benign_args(waf: CompiledWaf, prompts: dict[str, list[str]], fps: dict) -> dict:
    """Per place: rows sent and blocked per dataset, and per rule the rows it fired on among those blocked;
    fps[place] lists (dataset, rules fired, text) for each row blocked."""
    out = {}
    for place in ARGUMENT_PLACES:
        by_rule: Counter[str] = Counter()
        sent = {}
        for name, texts in prompts.items():
            blocked = 0
            for text in texts:
                view = chat_request(place=place, payload=text)
                if waf.evaluate(view).blocked:
                    blocked += 1
                    fired = sorted({m.rule.id for m in waf.evaluate(view, all_matches=True).matches})
                    by_rule.update(fired)
                    fps.setdefault(place, []).append((name, fired, text))
            sent[name] = [len(texts), blocked]
        out[place] = {"rows": sent, "rules": dict(by_rule.most_common())}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", type=Path, required=True, help="the folder the lists were unpacked into")
    parser.add_argument("--level", type=int, nargs="*", default=[1, 2])
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--misses",
        help="print the misses of this family (benign rows blocked: 'benign', as arguments: 'benign-args')",
    )
    args = parser.parse_args(argv)
    corpus = families(args.corpus)
    prompts = benign_prompts()
    print("sources:", {f: {s: len(p) for s, p in by.items()} for f, by in corpus.items()})
    results = {}
    for level in args.level:
        waf = gateway_waf(level)
        misses: dict = {}
        fps: dict = {}
        started = time.perf_counter()
        attacks = measure_attacks(waf, corpus, misses)
        benign = measure_benign(waf, prompts, fps)
        arg_fps: dict = {}
        benign_args = measure_benign_args(waf, prompts, arg_fps)
        results[level] = {"attacks": attacks, "benign": benign, "benign_args": benign_args}
        print(f"\nparanoia level {level}: {len(waf.rules)} rules, {time.perf_counter() - started:.1f}s")
        print(f"{'family':12} " + " ".join(f"{p:>22}" for p in PLACES))
        for family, tally in attacks.items():
            cells = [f"{c}/{n} {c / n:6.1%}" if n else "-" for n, c in (tally.get(p, [0, 0]) for p in PLACES)]
            print(f"{family:12} " + " ".join(f"{cell:>22}" for cell in cells))
        for name, (n, blocked) in benign.items():
            print(f"benign {name:18} {blocked}/{n} blocked {blocked / n:6.2%}")
        for place, tally in benign_args.items():
            for name, (n, blocked) in tally["rows"].items():
                print(f"benign as {place:5} {name:14} {blocked}/{n} blocked {blocked / n:6.2%}")
            print(f"benign as {place:5} rules: {tally['rules']}")
        if args.misses == "benign":
            for name, texts in fps.items():
                for text in texts:
                    fired = [m.rule.id for m in waf.evaluate(chat_request(prompt=text), all_matches=True).matches]
                    print("fp", name, fired, repr(text[:160]))
        elif args.misses == "benign-args":
            for place, rows in arg_fps.items():
                for name, fired, text in rows:
                    print("fp", place, name, fired, repr(text[:160]))
        elif args.misses:
            for place, payload in misses.get(args.misses, []):
                print("miss", place, repr(payload[:200]))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
