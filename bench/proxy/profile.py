"""`--profile-dir`: py-spy records the gateway under load; its stacks summed up as self time by function and package."""

from __future__ import annotations

import collections
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.harness.gateways import REPO
from bench.harness.processes import Service
from bench.harness.wrk import run_wrk

TOOLS_VENV = REPO / ".bench" / "tools-venv"


CATEGORIES = {  # first path component of a py-spy frame's file -> package group
    "gateway": "gateway",
    "opentelemetry": "opentelemetry",
    "prometheus_client": "prometheus_client",
    "logging": "logging",
    "json": "json",
    "httpx": "httpx",
    "httpcore": "httpcore/h11",
    "h11": "httpcore/h11",
    "anyio": "anyio",
    "sniffio": "anyio",
    "starlette": "starlette",
    "uvicorn": "uvicorn",
    "httptools": "uvicorn",
    "asyncio": "asyncio/uvloop",
    "contextvars": "asyncio/uvloop",
    "uvloop": "asyncio/uvloop",
    "pydantic": "pydantic",
}


def categorise(frame: str) -> str:
    """`func (httpcore/_async/http11.py:283)` -> "httpcore/h11"; single-file stdlib modules -> "stdlib other"."""
    m = re.search(r"\(([^()]*?):\d+\)$", frame) or re.search(r"\(([^()]*)\)$", frame)
    path = m.group(1) if m else frame
    if "/gateway/" in path and "site-packages" not in path:
        return "gateway"
    path = re.sub(r"^.*/(site-packages|lib/python3\.\d+)/", "", path)
    head = path.split("/", 1)[0]
    if head in CATEGORIES:
        return CATEGORIES[head]
    if "/" not in path and path.endswith(".py"):
        return "stdlib other"
    return "other"


INCLUSIVE = {"opentelemetry", "prometheus_client", "logging", "json", "httpx", "httpcore/h11", "anyio", "gateway"}


def summarise_profile(raw: Path, top: int = 15) -> dict:
    """Self time from py-spy's collapsed (`-f raw`) output: the leaf frame of each stack gets its samples."""
    by_func: collections.Counter[str] = collections.Counter()
    by_cat: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        leaf = frames[-1]
        by_func[_short(leaf)] += n
        by_cat[categorise(leaf)] += n
        cats = {categorise(f) for f in frames}
        for cat in cats & INCLUSIVE:
            inclusive[cat] += n
        if cats & {"httpx", "httpcore/h11"}:
            inclusive["upstream client (any httpx/httpcore frame)"] += n
    pct = (lambda n: round(100.0 * n / total, 1)) if total else (lambda n: 0.0)
    return {
        "samples": total,
        "self_by_function": [{"function": f, "pct": pct(n)} for f, n in by_func.most_common(top)],
        "self_by_package": [{"package": c, "pct": pct(n)} for c, n in by_cat.most_common()],
        "inclusive_pct": {c: pct(n) for c, n in inclusive.most_common()},
    }


def _short(frame: str) -> str:
    """`func (/long/path/site-packages/pkg/mod.py:123)` -> `func (pkg/mod.py:123)`."""
    m = re.match(r"(.*) \((.*)\)$", frame)
    if not m:
        return frame
    func, where = m.groups()
    where = re.sub(r"^.*/(site-packages|lib/python3\.\d+)/", "", where)
    where = re.sub(r"^.*/(gateway/)", r"\1", where)
    return f"{func} ({where})"


def profile_gateway(service: Service, lua: Path, duration: float, out_dir: Path) -> dict | None:
    py_spy = os.environ.get("PY_SPY") or str(TOOLS_VENV / "bin" / "py-spy")
    if not Path(py_spy).exists() and not shutil.which(py_spy):
        print(f"note: py-spy not found at {py_spy}; profile skipped", file=sys.stderr)
        return None
    out_dir.mkdir(parents=True, exist_ok=True)
    raw = out_dir / f"{service.name}.collapsed.txt"
    seconds = max(3, round(duration))
    print(
        f"[{time.strftime('%H:%M:%S')}] profiling {service.name} (pid {service.proc.pid}) for {seconds}s under c32",
        file=sys.stderr,
        flush=True,
    )
    spy = subprocess.Popen(
        [
            py_spy,
            "record",
            "--pid",
            str(service.proc.pid),
            "-d",
            str(seconds),
            "-r",
            "250",
            "-f",
            "raw",
            "-o",
            str(raw),
            "--nonblocking",
            "--full-filenames",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(0.5)
    load = run_wrk(service.port, lua, 32, seconds + 1)
    _, err = spy.communicate(timeout=seconds + 30)
    if spy.returncode != 0 or not raw.exists():
        print(f"note: py-spy failed ({spy.returncode}): {err[-1000:]}", file=sys.stderr)
        return None
    summary = summarise_profile(raw)
    summary["rps_while_profiling"] = round(load["rps"], 1)
    summary["collapsed_stacks"] = str(raw)
    return summary
