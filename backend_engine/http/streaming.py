"""Between a request's output stream and the HTTP response: joining a choice's outputs, collecting, closing.

A stream left unclosed keeps its sequence running until garbage collection, so everything here closes
what it opened however it ends: a client disconnect aborts the sequences at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncGenerator, Awaitable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse

from backend_engine.async_engine import ChoiceOutputs
from backend_engine.engine import RequestOutput
from backend_engine.http.openai_protocol.errors import APIError

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


def per_choice(outputs: ChoiceOutputs) -> list[tuple[int, RequestOutput]]:
    """One output per choice, in the order the choices first appear: a choice's outputs from several steps (a
    reader that fell behind) joined into one, so the client gets one event for them instead of one per token."""
    joined: dict[int, RequestOutput] = {}
    for index, out in outputs:
        prev = joined.get(index)
        joined[index] = out if prev is None else joined_output(prev, out)
    return list(joined.items())


def joined_output(first: RequestOutput, then: RequestOutput) -> RequestOutput:
    """`first` followed by `then`: their tokens, text and logprobs together, `then`'s finish and counts."""
    return dataclasses.replace(
        then,
        new_token_ids=first.new_token_ids + then.new_token_ids,
        new_text=first.new_text + then.new_text,
        logprobs=first.logprobs + then.logprobs,
    )


def generation_error(e: Exception) -> APIError:
    """What a failed generation tells the client: 400 for a request the engine rejected, else 500."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, ValueError):
        return APIError(400, str(e))
    return APIError(500, f"generation failed: {e}", "server_error", "internal_error")


async def outputs_or_error(
    outputs: AsyncGenerator[ChoiceOutputs, None], request_id: str
) -> AsyncGenerator[ChoiceOutputs | APIError, None]:
    """The request's outputs as the engine hands them over; a failure is logged and becomes the last item, so a
    streamed response reports it instead of ending silently. Closing this aborts the sequences."""
    try:
        async for batch in outputs:
            yield batch
    except Exception as e:  # noqa: BLE001 - handed to the stream as its last item
        log.exception("stream %s failed", request_id)
        yield generation_error(e)
    finally:
        await outputs.aclose()


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
    request: Request, outputs: AsyncGenerator[ChoiceOutputs, None], num_choices: int
) -> list[list[RequestOutput]] | None:
    """Every choice's outputs once all finish, or None if the client disconnects first (the sequences
    are aborted). A failed generation raises its `generation_error`."""

    async def collect() -> list[list[RequestOutput]]:
        per: list[list[RequestOutput]] = [[] for _ in range(num_choices)]
        try:
            async for batch in outputs:
                for i, o in batch:
                    per[i].append(o)
        except Exception as e:  # noqa: BLE001
            raise generation_error(e) from e
        return per

    try:
        return await until_disconnect(request, collect())
    finally:
        await outputs.aclose()
