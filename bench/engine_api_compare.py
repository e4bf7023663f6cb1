"""The engine's headline table: `portcullis engine serve` and llama.cpp's native `llama-server` (parallel slots,
continuous batching) on the same GGUF, measured the way users meet them — streamed through their OpenAI APIs with
`portcullis bench serve`, the same request sequence against both, one cell after the other in one run.

    .venv/bin/python -m bench.engine_api_compare --llama-server .bench/llama-build/bin/llama-server \\
        --compute int8 --threads 2 [--engine portcullis= --engine stall-off="--max-decode-stall 0"] [--json out.json]

llama-server is built from the llama.cpp sources the llama-cpp-python sdist vendors (docs/benchmarks.md, "Engine
through its API"). Cells: 1 stream (128 tokens), 8 / 32 / 64 concurrent streams (64 tokens each), one cold
~1,000-token prompt at a time (its TTFT), and a shared-prefix workload (tenants' long system prompts, multi-turn
conversations). Greedy decoding, EOS ignored so both produce every token asked for. Every server stays up for the
whole run; an idle one costs no CPU. `--engine` (repeatable) names engine configurations to measure side by side,
each with its extra `engine serve` arguments.
"""

from __future__ import annotations

import argparse
import json
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from backend_engine.config import default_model_path

ROOT = Path(__file__).resolve().parents[1]

# (cell name, bench serve arguments)
CELLS = [
    ("1 stream", ["--concurrency", "1", "--num-requests", "4", "--output-len", "128", "--input-len", "32"]),
    ("8 streams", ["--concurrency", "8", "--num-requests", "32", "--output-len", "64", "--input-len", "32"]),
    ("32 streams", ["--concurrency", "32", "--num-requests", "64", "--output-len", "64", "--input-len", "32"]),
    ("64 streams", ["--concurrency", "64", "--num-requests", "128", "--output-len", "64", "--input-len", "32"]),
    # TTFT of a ~1,000-token prompt (960 of the user's tokens and the chat template's), each prompt new to both
    ("1,000-token prompt", ["--concurrency", "1", "--num-requests", "3", "--output-len", "2", "--input-len", "960"]),
    (
        "shared prefix, 16 streams",
        [
            "--workload", "shared-prefix", "--concurrency", "16", "--tenants", "4", "--system-prompt-len", "600",
            "--conversations", "16", "--turns", "3", "--user-len", "40", "--output-len", "48",
        ],
    ),
]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(name: str, url: str, proc: subprocess.Popen, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{name} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{name} at {url} did not come up in {timeout:.0f}s")


def engine_configs(specs: list[str] | None) -> dict[str, list[str]]:
    """`NAME=ARGS` specs as {name: extra `engine serve` arguments}; none: one engine as configured by default."""
    configs: dict[str, list[str]] = {}
    for spec in specs or ["portcullis="]:
        name, sep, extra = spec.partition("=")
        if not sep or not name or name == "llama-server" or name in configs:
            raise SystemExit(f"--engine wants a new NAME=ARGS, got {spec!r}")
        configs[name] = shlex.split(extra)
    return configs


def start_servers(args: argparse.Namespace, gguf: Path, logs: Path) -> tuple[dict[str, str], list[subprocess.Popen]]:
    urls: dict[str, str] = {}
    procs: list[subprocess.Popen] = []
    for name, extra in engine_configs(args.engine).items():
        port = free_port()
        command = [sys.executable, "-m", "gateway.cli", "engine", "serve", "--model", str(gguf), "--port", str(port)]
        command += ["--compute", args.compute, "--threads", str(args.threads), "--max-num-seqs", str(args.slots)]
        log = open(logs / f"engine-{name}.log", "w")
        procs.append(subprocess.Popen(command + extra, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT))
        urls[name] = f"http://127.0.0.1:{port}"
    llama_port = free_port()
    procs.append(
        subprocess.Popen(
            [args.llama_server, "-m", str(gguf), "--port", str(llama_port), "-t", str(args.threads)]
            + ["-np", str(args.slots), "-c", str(args.slots * args.ctx_per_slot), "--cont-batching", "-b", "2048"],
            stdout=open(logs / "llama-server.log", "w"),
            stderr=subprocess.STDOUT,
        )
    )
    urls["llama-server"] = f"http://127.0.0.1:{llama_port}"
    for (name, url), proc in zip(urls.items(), procs):
        wait_ready(name, url, proc)
    return urls, procs


def warm_up(urls: dict[str, str]) -> None:
    """One short completion per server before the cells: the first request after a start pays one-off costs
    (memory arenas, first-touch of the weights) that would otherwise land in the first cell's figures."""
    for url in urls.values():
        body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8, "temperature": 0}
        httpx.post(url + "/v1/chat/completions", json=body, timeout=60).raise_for_status()


def run_cell(urls: dict[str, str], cell_args: list[str], out: Path) -> dict:
    runs = [f"{name}={url}" for name, url in urls.items()]
    command = [sys.executable, "-m", "gateway.cli", "bench", "serve", "--runs", *runs, "--ignore-eos"]
    command += ["--temperature", "0", "--no-request-rows", "--json", str(out), *cell_args]
    subprocess.run(command, cwd=ROOT, check=False, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())["runs"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-server", required=True, help="path to the llama-server binary")
    ap.add_argument("--gguf", type=Path, help="default: the bundled SmolLM2-135M")
    ap.add_argument("--compute", default="int8", choices=["int8", "float32"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--slots", type=int, default=64, help="llama-server -np and the engine's --max-num-seqs")
    ap.add_argument("--ctx-per-slot", type=int, default=1024, help="llama-server context per slot")
    ap.add_argument(
        "--engine", action="append", metavar="NAME=ARGS", help="an engine configuration: its name, extra arguments"
    )
    ap.add_argument("--cells", nargs="+", metavar="NAME", help="only the cells whose names start with these")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    gguf = args.gguf or Path(default_model_path())
    with tempfile.TemporaryDirectory() as tmp:
        urls, procs = start_servers(args, gguf, Path(tmp))
        table: dict[str, dict] = {}
        try:
            warm_up(urls)
            for name, cell_args in CELLS:
                if args.cells and not any(name.startswith(c) for c in args.cells):
                    continue
                table[name] = run_cell(urls, cell_args, Path(tmp) / "cell.json")
                print(
                    f"{name}: " + ", ".join(f"{n} {r['output_throughput']:.1f} tok/s" for n, r in table[name].items())
                )
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(timeout=30)
    print("\n| cell | " + " | ".join(f"{n}: tok/s, TTFT p50, TPOT p50" for n in urls) + " |")
    print("|---|" + "---|" * len(urls))
    for name, runs in table.items():
        cells = [
            f"{r['output_throughput']:.1f}, {r['ttft_ms']['p50']:.0f} ms, {r['tpot_ms']['p50']:.1f} ms"
            if r.get("completed")
            else f"failed ({r.get('errors')})"
            for r in (runs.get(n, {}) for n in urls)
        ]
        print(f"| {name} | " + " | ".join(cells) + " |")
    if args.json:
        args.json.write_text(json.dumps(table, indent=2))


if __name__ == "__main__":
    main()
