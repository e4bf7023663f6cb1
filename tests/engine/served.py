"""An engine server for tests that look inside the engine while its API serves: in a thread of the test process."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from backend_engine.http.server import EngineServer, http_server

MODEL = "SmolLM2-135M-Instruct"


@contextmanager
def running_server(server: EngineServer) -> Iterator[str]:
    """The engine's app served as `portcullis engine serve` serves it, on a loopback socket, in a thread of this
    process (so a test can look at the engine's blocks); yields the base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    uv = http_server(server.app(), log_level="warning")
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        uv.should_exit = True
        thread.join(timeout=30)
        sock.close()


def wait_idle(server: EngineServer) -> None:
    """Until the engine runs nothing and every KV block is free again (or fail)."""
    engine = server.engine
    deadline = time.monotonic() + 30
    while engine.has_unfinished() or engine.block_manager.usage() > 0:
        assert time.monotonic() < deadline, "the engine kept sequences or blocks"
        time.sleep(0.05)
