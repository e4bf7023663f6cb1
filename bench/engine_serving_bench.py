"""Engine serving-path benchmark: the same greedy workloads in-process and through the engine's OpenAI API.

    .venv/bin/python -m bench.engine_serving_bench --compute int8 float32 --threads 2 --pairs 2

For each compute mode and pair, back to back: `engine_bench.py`'s engine in a child process (single-stream decode of
128 tokens after "Once upon a time", TTFT excluded; 32 distinct 32-token prompts x 64 new tokens, wall time including
prefill), then `portcullis engine serve` with the same settings, driven over loopback by a lean asyncio client
(/v1/completions, token-id prompts, stream on, ignore_eos): the same two figures, counted from the stream's usage and
timed at the client. Each figure comes with the CPU seconds the engine's process spent per output token, which a
shared machine moves less than wall time, and the API side with its event-loop thread's CPU per token (the HTTP
server's own share: parsing, hand-over, SSE chunks, socket writes). The ratio API / in-process is what the serving
path keeps.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

from bench.engine_bench import DECODE_TOKENS, ROOT, SHORT, STREAM_TOKENS, model_path, stream_prompts

STREAMS = 32
SETTINGS = {"kv_cache_bytes": 1 << 30, "max_num_seqs": 64, "max_num_batched_tokens": 512}


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main_thread_cpu_seconds(pid: int) -> float:
    """CPU time of a process's main thread so far, to the nanosecond (the scheduler's own count)."""
    return int(Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()[0]) / 1e9


# --- in-process ---------------------------------------------------------------------------------------


def in_process(threads: int, compute: str) -> dict:
    sys.path.insert(0, str(ROOT))
    from backend_engine.config import EngineConfig
    from backend_engine.engine import LLMEngine
    from backend_engine.sequence import SamplingParams

    eng = LLMEngine(EngineConfig(device="cpu", compute=compute, threads=threads, model=model_path(), **SETTINGS))
    greedy = lambda n: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)  # noqa: E731
    eng.generate([SHORT], greedy(4))
    c0 = time.process_time()
    seq = eng.generate([SHORT], greedy(DECODE_TOKENS))[0]
    single = (DECODE_TOKENS - 1) / (seq.last_token_time - seq.first_token_time)
    single_cpu = (time.process_time() - c0) / DECODE_TOKENS
    c0, t0 = time.process_time(), time.perf_counter()
    seqs = eng.generate(stream_prompts(STREAMS), greedy(STREAM_TOKENS))
    wall = time.perf_counter() - t0
    tokens = sum(s.num_output_tokens for s in seqs)
    return {
        "single_tok_s": single,
        "single_cpu_ms_per_tok": 1000 * single_cpu,
        "streams_tok_s": tokens / wall,
        "streams_cpu_ms_per_tok": 1000 * (time.process_time() - c0) / tokens,
    }


# --- through the API ------------------------------------------------------------------------------------


async def stream_completion(port: int, prompt: list[int], max_tokens: int) -> tuple[int, float | None, float]:
    """(completion tokens, time of the first text, time of the last text) of one streamed completion; plain
    HTTP/1.1 over asyncio so the client costs the shared cores as little as possible."""
    body = json.dumps(
        {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\nconnection: close\r\n"
        + f"content-length: {len(body)}\r\n\r\n".encode()
        + body
    )
    first = last = None
    tokens = 0
    buf = b""
    try:
        while True:
            data = await reader.read(65536)
            if not data:
                raise RuntimeError("the stream ended without [DONE]")
            now = time.perf_counter()
            buf += data
            *lines, buf = buf.split(b"\n")
            for line in lines:
                if not line.startswith(b"data: {"):
                    if line.startswith(b"data: [DONE]"):
                        return tokens, first, last or now
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    raise RuntimeError(f"stream error: {event['error']}")
                if any(c.get("text") for c in event["choices"]):
                    first = first or now
                    last = now
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
    finally:
        writer.close()


def start_server(threads: int, compute: str) -> tuple[subprocess.Popen, int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "backend_engine.cli", "engine", "serve", "--port", str(port)]
    cmd += ["--model", model_path(), "--compute", compute, "--threads", str(threads), "--log-level", "warning"]
    cmd += ["--kv-cache-bytes", str(SETTINGS["kv_cache_bytes"]), "--max-num-seqs", str(SETTINGS["max_num_seqs"])]
    cmd += ["--max-num-batched-tokens", str(SETTINGS["max_num_batched_tokens"])]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit("the engine server did not start")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                break
        except OSError:
            time.sleep(0.3)
    return proc, port


def through_api(threads: int, compute: str) -> dict:
    proc, port = start_server(threads, compute)
    try:
        asyncio.run(stream_completion(port, SHORT, 4))  # warm-up
        c0, loop0 = cpu_seconds(proc.pid), main_thread_cpu_seconds(proc.pid)
        tokens, first, last = asyncio.run(stream_completion(port, SHORT, DECODE_TOKENS))
        single_cpu = (cpu_seconds(proc.pid) - c0) / tokens
        single_loop = (main_thread_cpu_seconds(proc.pid) - loop0) / tokens
        assert tokens == DECODE_TOKENS and first is not None

        async def many() -> int:
            done = await asyncio.gather(*(stream_completion(port, p, STREAM_TOKENS) for p in stream_prompts(STREAMS)))
            return sum(n for n, _, _ in done)

        c0, loop0, t0 = cpu_seconds(proc.pid), main_thread_cpu_seconds(proc.pid), time.perf_counter()
        total = asyncio.run(many())
        wall = time.perf_counter() - t0
        return {
            "single_tok_s": (tokens - 1) / (last - first),
            "single_cpu_ms_per_tok": 1000 * single_cpu,
            "single_event_loop_us_per_tok": 1e6 * single_loop,
            "streams_tok_s": total / wall,
            "streams_cpu_ms_per_tok": 1000 * (cpu_seconds(proc.pid) - c0) / total,
            "streams_event_loop_us_per_tok": 1e6 * (main_thread_cpu_seconds(proc.pid) - loop0) / total,
        }
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# --- side by side -----------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compute", nargs="+", choices=["float32", "int8"], default=["int8", "float32"])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--pairs", type=int, default=1, help="in-process / API pairs per compute mode, back to back")
    ap.add_argument("--side", choices=["in-process", "api"], help=argparse.SUPPRESS)  # one side, JSON to stdout
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    if args.side:
        side = in_process if args.side == "in-process" else through_api
        print(json.dumps(side(args.threads, args.compute[0])))
        return 0
    out: dict = {"threads": args.threads, "loadavg_before": os.getloadavg()[0], "runs": {}}
    for compute in args.compute:
        rows = out["runs"][compute] = []
        for _ in range(args.pairs):
            pair = {}
            for side in ("in-process", "api"):
                cmd = [sys.executable, "-m", "bench.engine_serving_bench", "--side", side, "--compute", compute]
                cmd += ["--threads", str(args.threads)]
                p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False)
                if p.returncode != 0:
                    raise SystemExit(f"{side} {compute} failed:\n{p.stderr[-3000:]}")
                pair[side] = json.loads(p.stdout.strip().splitlines()[-1])
            rows.append(pair)
            print(compute, json.dumps(pair), file=sys.stderr)
    out["loadavg_after"] = os.getloadavg()[0]
    print(table(out))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, indent=2))
    return 0


def table(out: dict) -> str:
    """Median over pairs of each figure, and of each pair's API / in-process ratio."""
    lines = ["| compute | figure | in-process | API | API / in-process |", "|---|---|---:|---:|---:|"]
    for compute, rows in out["runs"].items():
        for key, label in [
            ("single_tok_s", "1 stream, decode tok/s"),
            ("streams_tok_s", f"{STREAMS} streams, tok/s"),
            ("single_cpu_ms_per_tok", "1 stream, CPU ms / token"),
            ("streams_cpu_ms_per_tok", f"{STREAMS} streams, CPU ms / token"),
        ]:
            a = median(r["in-process"][key] for r in rows)
            b = median(r["api"][key] for r in rows)
            ratio = median(r["api"][key] / r["in-process"][key] for r in rows)
            lines.append(f"| {compute} | {label} | {a:.1f} | {b:.1f} | {ratio:.2f} |")
        for key, label in [
            ("single_event_loop_us_per_tok", "1 stream"),
            ("streams_event_loop_us_per_tok", f"{STREAMS} streams"),
        ]:
            loop_cpu = median(r["api"][key] for r in rows)
            lines.append(f"| {compute} | {label}, event-loop thread CPU us / token | | {loop_cpu:.0f} | |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
