"""OpenAI's Responses API on the engine, text in and text out: request bodies in, response objects and SSE events out.

The prompt is `responses_messages` rendered by the chat template, the same path as chat completions. The engine
stores nothing: `previous_response_id` is refused and every response says `"store": false`. It runs no tools: an
empty `tools` list is accepted (clients send one), any tool is refused.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import orjson

from backend_engine.async_engine import ChoiceOutputs
from backend_engine.engine import RequestOutput
from backend_engine.http.openai_protocol.errors import APIError
from backend_engine.http.openai_protocol.requests import RequestParser, field, known_fields
from backend_engine.http.openai_protocol.responses_input import responses_messages
from backend_engine.http.streaming import outputs_or_error, per_choice
from backend_engine.model.prompt import PromptError
from backend_engine.sequence import SamplingParams

REQUEST_FIELDS = frozenset(
    {
        "model",
        "input",
        "instructions",
        "max_output_tokens",
        "temperature",
        "top_p",
        "stream",
        "metadata",
        "user",
        "store",
        "text",
        "previous_response_id",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
    }
)
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512  # OpenAI's limits
MAX_USER_CHARS = 256


@dataclass(frozen=True)
class ResponsesRequest:
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    echo: dict[str, Any]  # the request's settings as every response object repeats them


def parse_responses_request(body: dict[str, Any], parser: RequestParser) -> ResponsesRequest:
    """A /v1/responses body checked against the engine's model, template and limits; 400 (OpenAI's shape) when not."""
    known_fields(body, REQUEST_FIELDS)
    parser.check_model(body)
    if body.get("previous_response_id") is not None:
        raise APIError(
            400,
            "previous_response_id is not supported: this engine stores no responses; send the whole conversation "
            "in 'input'",
            param="previous_response_id",
            code="previous_response_not_found",
        )
    if field(body, "tools", list, []):
        raise APIError(400, "tools are not supported by this engine", param="tools")
    tool_choice = field(body, "tool_choice", str, "auto")
    if tool_choice not in ("auto", "none"):
        raise APIError(400, "tool_choice must be 'auto' or 'none': this engine runs no tools", param="tool_choice")
    field(body, "store", bool, False)
    _check_text(field(body, "text", dict, {}))
    metadata = _metadata(field(body, "metadata", dict, {}))
    user = field(body, "user", str, None)
    if user is not None and len(user) > MAX_USER_CHARS:
        raise APIError(400, f"'user' must be at most {MAX_USER_CHARS} characters", param="user")
    instructions = field(body, "instructions", str, None)
    try:
        ids = parser.renderer.chat_ids(responses_messages(body), max_chars=parser.max_prompt_chars)
    except PromptError as e:
        raise APIError(400, str(e), param=e.param) from None
    max_output_tokens = field(body, "max_output_tokens", int, None)
    params = SamplingParams(
        max_tokens=max_output_tokens if max_output_tokens is not None else parser.room(ids),
        temperature=field(body, "temperature", float, 1.0),
        top_p=field(body, "top_p", float, 1.0),
    )
    parser.check_job(ids, params, "max_output_tokens" if max_output_tokens is not None else None)
    echo = {
        "instructions": instructions,
        "max_output_tokens": max_output_tokens,
        "metadata": metadata,
        "parallel_tool_calls": field(body, "parallel_tool_calls", bool, True),
        "previous_response_id": None,
        "reasoning": {"effort": None, "summary": None},
        "store": False,
        "temperature": params.temperature,
        "text": {"format": {"type": "text"}},
        "tool_choice": tool_choice,
        "tools": [],
        "top_p": params.top_p,
        "truncation": "disabled",
        "user": user,
    }
    return ResponsesRequest(ids, params, field(body, "stream", bool, False), echo)


def _check_text(text: dict[str, Any]) -> None:
    for key in text:
        if key != "format":
            raise APIError(400, f"Unknown parameter: 'text.{key}'.", param=f"text.{key}", code="unknown_parameter")
    fmt = field(text, "format", dict, {"type": "text"})
    if fmt.get("type") != "text" or len(fmt) != 1:
        raise APIError(400, "this engine supports only text.format {'type': 'text'}", param="text.format")


def _metadata(metadata: dict[str, Any]) -> dict[str, str]:
    if len(metadata) > MAX_METADATA_PAIRS:
        raise APIError(400, f"'metadata' holds at most {MAX_METADATA_PAIRS} pairs", param="metadata")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY or not isinstance(value, str) or len(value) > MAX_METADATA_VALUE:
            raise APIError(
                400,
                f"metadata keys must be at most {MAX_METADATA_KEY} characters and values strings of at most "
                f"{MAX_METADATA_VALUE}",
                param=f"metadata.{key[:MAX_METADATA_KEY]}",
            )
    return metadata


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _status(last: RequestOutput) -> str:
    return "incomplete" if last.finish_reason == "length" else "completed"


@dataclass
class ResponseDraft:
    """One response as it is built: its ids, its creation time and the request settings it repeats."""

    model: str
    echo: dict[str, Any]
    id: str = dataclasses.field(default_factory=lambda: "resp_" + uuid.uuid4().hex)
    message_id: str = dataclasses.field(default_factory=lambda: "msg_" + uuid.uuid4().hex)
    created_at: int = dataclasses.field(default_factory=lambda: int(time.time()))

    def message(self, status: str, text: str | None) -> dict[str, Any]:
        """The output message item; without text (None) it has no content part yet, as when streaming starts."""
        content = [] if text is None else [_output_text(text)]
        return {"id": self.message_id, "type": "message", "role": "assistant", "status": status, "content": content}

    def body(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": self.model,
            "output": output,
            "usage": usage,
            **self.echo,
        }

    def finished(self, text: str, last: RequestOutput) -> dict[str, Any]:
        """The whole response once generation ends: the non-streaming body and the last streamed event's."""
        status = _status(last)
        usage = {
            "input_tokens": last.num_prompt_tokens,
            "input_tokens_details": {"cached_tokens": last.num_cached_tokens},
            "output_tokens": last.num_output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": last.num_prompt_tokens + last.num_output_tokens,
        }
        return self.body(status, [self.message(status, text)], usage)


def final_response(draft: ResponseDraft, outputs: list[RequestOutput]) -> dict[str, Any]:
    return draft.finished("".join(o.new_text for o in outputs), outputs[-1])


async def response_events(draft: ResponseDraft, outputs: AsyncGenerator[ChoiceOutputs, None]) -> AsyncIterator[bytes]:
    """The streamed response as OpenAI sends it: created, in_progress, the message item and its text part opened,
    one text delta per engine step that adds text (the steps a slow reader missed joined into one), then each
    closed and `response.completed` (or `response.incomplete`). A failure ends the stream with an `error` event
    and `response.failed`."""
    numbers = itertools.count()

    def event(type_: str, **fields: Any) -> bytes:
        data = orjson.dumps({"type": type_, "sequence_number": next(numbers), **fields})
        return b"event: " + type_.encode() + b"\ndata: " + data + b"\n\n"

    where = {"item_id": draft.message_id, "output_index": 0, "content_index": 0}
    yield b"".join(
        [
            event("response.created", response=draft.body("in_progress", [])),
            event("response.in_progress", response=draft.body("in_progress", [])),
            event("response.output_item.added", output_index=0, item=draft.message("in_progress", None)),
            event("response.content_part.added", **where, part=_output_text("")),
        ]
    )
    pieces: list[str] = []
    last: RequestOutput | None = None
    async with aclosing(outputs_or_error(outputs, draft.id)) as batches:
        async for batch in batches:
            if isinstance(batch, APIError):
                failure = {
                    "code": "server_error" if batch.status >= 500 else "invalid_prompt",
                    "message": batch.message,
                }
                yield event("error", code=batch.code or batch.type, message=batch.message, param=batch.param) + event(
                    "response.failed", response=draft.body("failed", [], error=failure)
                )
                return
            ((_, last),) = per_choice(batch)
            if last.new_text:
                pieces.append(last.new_text)
                yield event("response.output_text.delta", **where, delta=last.new_text, logprobs=[])
    assert last is not None, "a generation that ends without failing has a finished output"
    text = "".join(pieces)
    response = draft.finished(text, last)
    yield b"".join(
        [
            event("response.output_text.done", **where, text=text, logprobs=[]),
            event("response.content_part.done", **where, part=_output_text(text)),
            event("response.output_item.done", output_index=0, item=draft.message(_status(last), text)),
            event(f"response.{response['status']}", response=response),
        ]
    )
