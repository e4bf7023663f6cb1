"""Between the engine's per-choice output streams and the HTTP response: merging, collecting, closing.

A stream left unclosed keeps its sequence running until garbage collection, so everything here closes
what it opened however it ends: a client disconnect aborts the sequences at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse

from backend_engine.engine import RequestOutput
from backend_engine.openai_protocol.errors import APIError

log = logging.getLogger("portcullis.engine.server")
T = TypeVar("T")


class ClosingStreamingResponse(StreamingResponse):
    """Closes its body generator however the response ends, so a client disconnect aborts the
    sequence immediately (instead of whenever the abandoned generator is garbage-collected)."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


async def merge_choices(
    gens: list[AsyncGenerator[RequestOutput, None]],
) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """Interleave several choices' outputs as they arrive, tagged with the choice index; closing this
    aborts the rest."""
    if len(gens) == 1:
        try:
            async for o in gens[0]:
                yield 0, o
        finally:
            await gens[0].aclose()  # a closed stream must abort its sequence now, not at GC
        return
    q: asyncio.Queue[tuple[int, RequestOutput | Exception | None]] = asyncio.Queue()

    async def pump(i: int, g: AsyncIterator[RequestOutput]) -> None:
        try:
            async for o in g:
                await q.put((i, o))
            await q.put((i, None))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            await q.put((i, e))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(gens)
        while remaining:
            i, item = await q.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def generation_error(e: Exception) -> APIError:
    """What a failed generation tells the client: 400 for a request the engine rejected, else 500."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, ValueError):
        return APIError(400, str(e))
    return APIError(500, f"generation failed: {e}", "server_error", "internal_error")


async def outputs_or_error(
    gens: list[AsyncGenerator[RequestOutput, None]], request_id: str
) -> AsyncGenerator[tuple[int, RequestOutput] | APIError, None]:
    """The choices' outputs as `merge_choices` interleaves them; a failure is logged and becomes the last item,
    so a streamed response reports it instead of ending silently. Closing this aborts the sequences."""
    merged = merge_choices(gens)
    try:
        async for item in merged:
            yield item
    except Exception as e:  # noqa: BLE001 - handed to the stream as its last item
        log.exception("stream %s failed", request_id)
        yield generation_error(e)
    finally:
        await merged.aclose()


async def until_disconnect(request: Request, work: Awaitable[T]) -> T | None:
    """`work`'s result, or None if the client disconnects first (then `work` is cancelled)."""

    async def disconnected() -> None:
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                return

    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(disconnected())
    done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        watch.cancel()
        return task.result()
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, APIError):
        pass
    return None


async def collect_or_disconnect(
    request: Request, gens: list[AsyncGenerator[RequestOutput, None]]
) -> list[list[RequestOutput]] | None:
    """Every choice's outputs once all finish, or None if the client disconnects first (the sequences
    are aborted). A failed generation raises its `generation_error`."""
    merged = merge_choices(gens)

    async def collect() -> list[list[RequestOutput]]:
        per: list[list[RequestOutput]] = [[] for _ in gens]
        try:
            async for i, o in merged:
                per[i].append(o)
        except Exception as e:  # noqa: BLE001
            raise generation_error(e) from e
        return per

    try:
        return await until_disconnect(request, collect())
    finally:
        await merged.aclose()
