"""`portcullis` command line: `serve` runs the gateway, `config check` validates its portcullis.yaml; `engine`, `bench`
and more register their own subcommands."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from backend_engine import cli as engine_cli
from gateway.admin import cli as keys_cli
from gateway.bench import cli as bench_cli
from gateway.config import CONFIG_ENV, ConfigError, GatewayConfig, load_config
from gateway.guard import cli as guard_cli
from gateway.mcp import cli as mcp_cli
from gateway.observability import log_format, log_writer
from gateway.observability.version import VERSION
from gateway.ops import config_cli, up, workers
from gateway.policy import cli as policy_cli


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="portcullis", description=__doc__)
    parser.add_argument("--version", action="version", version=f"portcullis {VERSION}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_serve(commands)
    up.add_subcommand(commands)
    config_cli.add_subcommands(commands)
    policy_cli.add_subcommands(commands)
    engine_cli.add_subcommands(commands)
    bench_cli.add_subcommands(commands)
    guard_cli.add_subcommands(commands)
    keys_cli.add_subcommands(commands)
    mcp_cli.add_subcommands(commands)
    args = parser.parse_args(argv)
    return args.func(args)


def _add_serve(commands: argparse._SubParsersAction) -> None:
    serve = commands.add_parser("serve", help="run the gateway")
    serve.add_argument("--config", help=f"portcullis.yaml (default: ${CONFIG_ENV}, else embedded defaults)")
    serve.add_argument("--host", help="override listen.host")
    serve.add_argument("--port", type=int, help="override listen.port")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    log_format.add_argument(serve)
    # set by the supervisor when it starts a worker (gateway/ops/workers.py), never by hand
    serve.add_argument("--worker-index", type=int, help=argparse.SUPPRESS)
    serve.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)
    serve.add_argument("--supervisor-pid", type=int, help=argparse.SUPPRESS)
    serve.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    """One process serving, as a gateway of its own or as one of a supervisor's workers; or, with `listen.workers`
    above 1, the supervisor of that many workers."""
    from gateway.app import build_app
    from gateway.edge.http_server import serve
    from gateway.policy.loader import PolicyError
    from gateway.reload.config import ConfigSource

    worker = args.worker_index
    log_writer.configure_logging(args.log_level, args.log_format, {} if worker is None else {"worker": worker})
    if worker is not None:
        workers.follow_supervisor(args.supervisor_pid)

    def prepared(config: GatewayConfig) -> GatewayConfig:
        """What this process makes of the file, at start and at each reload: the command line's listener, and a
        worker's share."""
        listen = {
            "host": args.host or config.listen.host,
            "port": args.port if args.port is not None else config.listen.port,
        }
        config = config.model_copy(update={"listen": config.listen.model_copy(update=listen)})
        return workers.without_admin(config) if worker else config

    path = args.config or os.environ.get(CONFIG_ENV)
    source = ConfigSource(Path(path), prepared) if path else None
    try:
        config = prepared(load_config(path))
    except ConfigError as exc:
        return _cannot_start(exc)
    if worker is None and config.listen.worker_count() > 1:
        return workers.Supervisor(config, args.log_level, source).run()
    try:
        app = build_app(config, reload=source)
    except (ConfigError, PolicyError) as exc:
        return _cannot_start(exc)
    on_started = None if worker is None else workers.report_serving(args.ready_fd)
    try:
        serve(app, config, config.listen.host, config.listen.port, reuse_port=worker is not None, on_started=on_started)
    except OSError as exc:  # a listener that cannot bind (port in use, address not local)
        print(f"portcullis: cannot listen: {exc}", file=sys.stderr)
        return workers.START_FAILED
    return 0


def _cannot_start(exc: Exception) -> int:
    print(f"portcullis: {exc}", file=sys.stderr)
    return workers.START_FAILED


if __name__ == "__main__":
    sys.exit(main())
