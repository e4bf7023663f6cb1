"""The gateway's app for an ASGI server other than its own (bench/http_server_bench.py): the config and app that
`portcullis serve` runs, without gateway/edge/http_server.py's protocol and the bounds it enforces.

    PORTCULLIS_CONFIG=portcullis.yaml granian --interface asgi --factory bench.proxy.asgi_app:app
"""

from __future__ import annotations

import os

from starlette.types import ASGIApp

from gateway.app import build_app
from gateway.cli import configure_logging
from gateway.config import CONFIG_ENV, load_config


def app() -> ASGIApp:
    """A factory: each server calls it in the process that serves, after its own start-up."""
    configure_logging("warning", None)
    return build_app(load_config(os.environ[CONFIG_ENV]))


def __getattr__(name: str) -> ASGIApp:
    """`served`: the app itself, built when first asked for, for a server that takes no factory (socketify)."""
    if name != "served":
        raise AttributeError(name)
    return app()
