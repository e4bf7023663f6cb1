"""Bodies with very many JSON values are judged against the limits in a worker process before this one decodes them.

Decoding is one C call that holds the interpreter lock: orjson spends ~100 ms on 3 MB of 100k short messages, and
no other thread, the event loop included, runs meanwhile; moving the decode to a thread spares the loop nothing. A
few such bodies a second, sent before auth, would stall every connection. So a body with more commas than
`limits.gate_min_commas` (a body holds about as many values as commas) is first parsed and checked by a worker
process, which answers only whether it fits the limits and the schema. A body it refuses is refused without this
process decoding it; one it admits is decoded here, at a cost bounded by `limits.max_json_values`.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import multiprocessing.connection
import os
import threading
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import numpy as np

from gateway.config import LimitsConfig
from gateway.errors import GatewayError

_Refusal = tuple[int, str, str, str | None, str | None]  # a GatewayError's fields: exceptions do not pickle whole
# The parse stage's whole check of a body (gateway/stages/parse.py's parse_body), raising its GatewayError to refuse:
# a module-level function, which a worker process imports by name.
Parse = Callable[[str, bytes, LimitsConfig], object]


def _exit_with_parent() -> None:
    """In each worker: exit when the gateway does, however it ends (a signal skips its executor's own shutdown)."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(0)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def judge(parse: Parse, route: str, body: bytes, limits: LimitsConfig) -> _Refusal | None:
    """In the worker: the refusal the parse stage would give this body, or None when it would accept it."""
    try:
        parse(route, body, limits)
    except GatewayError as err:
        return err.status, err.message, err.type, err.code, err.param
    return None


def _commas(body: bytes) -> int:
    """numpy counts a 4 MB body's commas in ~0.3 ms, bytes.count in ~1.5 ms: this runs on the event loop."""
    return int(np.count_nonzero(np.frombuffer(body, dtype=np.uint8) == ord(",")))


class ShapeGate:
    def __init__(self, limits: LimitsConfig, parse: Parse) -> None:
        self._limits = limits
        self._parse = parse
        self._pool = self._new_pool()

    def _new_pool(self) -> ProcessPoolExecutor:
        # spawn: the gateway runs threads (ONNX Runtime, the offload pool) that a fork would copy mid-state
        return ProcessPoolExecutor(
            max_workers=self._limits.offload_workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_exit_with_parent,
        )

    def warm(self) -> None:
        """Start the workers now (each imports the parse stage, about a second), not on the first big body."""
        for _ in range(self._limits.offload_workers):
            self._pool.submit(judge, self._parse, "chat", b"{}", self._limits)

    async def check(self, route: str, body: bytes) -> None:
        """Raise the parse stage's refusal for a body with many values, judged out of process; small bodies pass."""
        if len(body) <= self._limits.gate_min_commas or _commas(body) <= self._limits.gate_min_commas:
            return
        try:
            refusal = await asyncio.wrap_future(self._pool.submit(judge, self._parse, route, body, self._limits))
        except BrokenProcessPool:  # a worker died (killed, out of memory): start afresh, let the client retry
            self._pool = self._new_pool()
            raise GatewayError(
                503,
                "the gateway could not check this body; retry",
                type="server_error",
                code="body_check_unavailable",
                headers={"retry-after": "1"},
            ) from None
        if refusal is not None:
            status, message, kind, code, param = refusal
            raise GatewayError(status, message, type=kind, code=code, param=param)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)  # milliseconds: a worker finishes at most one body
