"""The upstream-client floor: what one Python process pays per upstream call (httpx as the gateway configures it,
aiohttp, a raw asyncio client) against the static upstream, with nothing else around it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

from bench.harness.gateways import LITELLM_VENV

CLIENT_MICRO = r"""
import asyncio, json, sys, time
client, port, conc, duration = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
body = json.dumps({"model": "bench-model", "messages": [{"role": "user", "content": "hi"}]}).encode()
url = f"http://127.0.0.1:{port}/v1/chat/completions"

async def main():
    if client == "httpx":  # configured as gateway/routing/pool.py configures it
        import httpx
        c = httpx.AsyncClient(limits=httpx.Limits(max_connections=256, max_keepalive_connections=256), trust_env=False)
        async def one():
            r = await c.send(c.build_request("POST", url, content=body, headers={"content-type": "application/json"}),
                             stream=True)
            await r.aread()
            await r.aclose()
        close = c.aclose
    elif client == "aiohttp":
        import aiohttp
        c = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256))
        async def one():
            async with c.post(url, data=body, headers={"content-type": "application/json"}) as r:
                await r.read()
        close = c.close
    else:  # raw: a minimal keep-alive HTTP/1.1 client on asyncio streams, one connection per worker
        conns = asyncio.Queue()
        req = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body
        for _ in range(conc):
            conns.put_nowait(await asyncio.open_connection("127.0.0.1", port))
        async def one():
            r, w = await conns.get()
            w.write(req)
            head = await r.readuntil(b"\r\n\r\n")
            length = next(int(l.split(b":")[1]) for l in head.split(b"\r\n") if l.lower().startswith(b"content-length"))
            await r.readexactly(length)
            conns.put_nowait((r, w))
        async def close():
            while not conns.empty():
                conns.get_nowait()[1].close()
    count = 0
    async def worker(until):
        nonlocal count
        while time.perf_counter() < until:
            await one()
            count += 1
    await asyncio.gather(*(worker(time.perf_counter() + 1.0) for _ in range(conc)))  # warm up
    count = 0
    cpu0, t0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker(t0 + duration) for _ in range(conc)))
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
    await close()
    print("CLIENTJSON " + json.dumps({"client": client, "connections": conc, "requests": count,
                                      "rps": count / wall, "cpu_us_per_request": cpu / count * 1e6}))

try:
    import uvloop
    uvloop.run(main())
except ImportError:
    asyncio.run(main())
"""


def client_floor(port: int, duration: float) -> list[dict]:
    """Per-request CPU of the upstream call alone (httpx as the gateway uses it, aiohttp, a raw asyncio client)."""
    seconds = max(2.0, min(duration, 5.0))
    runs = [("httpx", sys.executable), ("raw", sys.executable)]
    aiohttp_python = next(
        (
            py
            for py in (sys.executable, str(LITELLM_VENV / "bin" / "python"))
            if Path(py).exists() and subprocess.run([py, "-c", "import aiohttp"], capture_output=True).returncode == 0
        ),
        None,
    )
    if aiohttp_python:
        runs.insert(1, ("aiohttp", aiohttp_python))
    out = []
    for client, python in runs:
        for conc in (1, 32):
            print(f"[{time.strftime('%H:%M:%S')}] client floor: {client} x{conc}", file=sys.stderr, flush=True)
            proc = subprocess.run(
                [python, "-c", CLIENT_MICRO, client, str(port), str(conc), str(seconds)],
                capture_output=True,
                text=True,
                timeout=seconds + 60,
            )
            match = re.search(r"^CLIENTJSON (\{.*\})$", proc.stdout, re.MULTILINE)
            if not match:
                print(f"note: client floor {client} failed: {proc.stderr[-500:]}", file=sys.stderr)
                continue
            row = json.loads(match.group(1))
            if client == "aiohttp":
                row["python"] = python
            out.append(row)
    return out
