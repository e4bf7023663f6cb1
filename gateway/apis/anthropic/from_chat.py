"""A chat pool's answer as a Messages client reads it: a chat completion as a Message, a chat stream's chunks as
Anthropic's stream events (docs.anthropic.com "Streaming Messages"; vLLM's `stop_reason`, `reasoning_content` or
`reasoning`). Reasoning comes back as thinking blocks only when the request asked for thinking, with an empty
signature (the gateway cannot sign it)."""

from __future__ import annotations

import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.apis.answers import token_count
from gateway.apis.anthropic.errors import anthropic_error_type
from gateway.apis.chat_calls import StreamedCalls
from gateway.apis.streamed_json import StreamedJson
from gateway.streaming.sse import typed_event

# --- response: chat -> Message ---------------------------------------------------------------------------------


def _message_id(upstream_id: Any) -> str:
    """ "msg_" and the upstream's id (its alphanumerics), so a log line joins both; a fresh one without it."""
    tail = "".join(c for c in str(upstream_id or "").removeprefix("chatcmpl-") if c.isalnum())
    return f"msg_{tail or uuid.uuid4().hex}"


def _stop(finish_reason: Any, stop_reason: Any, stop_sequences: Sequence[str], tool_calls: bool) -> tuple[str, Any]:
    """(stop_reason, stop_sequence) for a chat finish: length -> max_tokens, tool_calls -> tool_use (as is a stop
    after tool calls: vLLM says "stop" when tool_choice forced them), content_filter -> refusal, a stop on one of
    the request's sequences (vLLM names it in the choice's `stop_reason`) -> stop_sequence, else end_turn."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "content_filter":
        return "refusal", None
    if tool_calls or finish_reason in ("tool_calls", "function_call"):
        return "tool_use", None
    if isinstance(stop_reason, str) and stop_reason in stop_sequences:
        return "stop_sequence", stop_reason
    return "end_turn", None


def _usage(usage: Any) -> dict[str, int]:
    """Anthropic usage from chat usage: the cached prompt tokens are cache reads, the rest are input tokens; a
    pool's prefix cache writes nothing anyone is billed for, so cache_creation_input_tokens is 0."""
    usage = usage if isinstance(usage, dict) else {}
    prompt = _count(usage, "prompt_tokens")
    cached = _count(usage.get("prompt_tokens_details"), "cached_tokens")
    return {
        "input_tokens": max(prompt - cached, 0),
        "output_tokens": _count(usage, "completion_tokens"),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }


def _count(fields: Any, key: str) -> int:
    """A usage count as charging takes it (token_count); 0 where the upstream reported none."""
    return (token_count(fields.get(key)) if isinstance(fields, dict) else None) or 0


def _text(value: Any) -> str:
    """An upstream's text field: "" where it is not a string, so no block carries what Anthropic's types cannot
    hold (and the output guard, which reads strings only, never saw)."""
    return value if isinstance(value, str) else ""


def _reasoning(fields: dict[str, Any]) -> str:
    """vLLM's reasoning text: `reasoning_content`, or `reasoning` as newer releases name it."""
    return _text(fields.get("reasoning_content")) or _text(fields.get("reasoning"))


def _tool_input(arguments: Any) -> dict[str, Any]:
    """A tool call's arguments as the object Anthropic's `input` must be; {} when the model wrote no object."""
    try:
        value = orjson.loads(_text(arguments) or "{}")
    except orjson.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def chat_to_message(
    body: dict[str, Any], model: str, *, stop_sequences: Sequence[str] = (), thinking: bool = False
) -> dict[str, Any]:
    """A non-streaming chat completion -> an Anthropic Message. `stop_sequences` are the request's (to tell a
    stop_sequence from an end_turn); `thinking` whether it asked for thinking blocks."""
    choices = body.get("choices") or [{}]
    choice = choices[0]
    message = choice.get("message") or {}
    content: list[dict[str, Any]] = []
    if thinking and _reasoning(message):
        content.append({"type": "thinking", "thinking": _reasoning(message), "signature": ""})
    text = _text(message.get("content")) or _text(message.get("refusal"))
    if text:
        content.append({"type": "text", "text": text})
    calls = message.get("tool_calls") or []
    for call in calls:
        function = call.get("function") or {}
        call_id, name = _text(call.get("id")) or _tool_use_id(), _text(function.get("name"))
        content.append(
            {"type": "tool_use", "id": call_id, "name": name, "input": _tool_input(function.get("arguments"))}
        )
    stop_reason, stop_sequence = _stop(
        choice.get("finish_reason"), choice.get("stop_reason"), stop_sequences, bool(calls)
    )
    return {
        "id": _message_id(body.get("id")),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": _usage(body.get("usage")),
    }


def _tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex}"


def _arguments_delta(block: int, arguments: str) -> dict[str, Any]:
    return {
        "type": "content_block_delta",
        "index": block,
        "delta": {"type": "input_json_delta", "partial_json": arguments},
    }


@dataclass(slots=True, eq=False)
class _ToolCall:
    """A streamed tool call: its tool_use block's id and name, its arguments so far, its block index once started.
    Each is its own call (no equality by value): two calls may carry the same fields."""

    id: str
    name: str
    arguments: StreamedJson = field(default_factory=StreamedJson)
    block: int | None = None


@dataclass(slots=True)
class _Piece:
    """Text or thinking that arrived while a tool call's arguments were not whole: it waits for its block."""

    kind: str  # "text" or "thinking": the block's type, and its delta's text field
    text: str


# The block each kind of piece opens, and its delta's type.
# Text and thinking held back behind one call whose arguments are not yet whole JSON. A pool whose call never parses
# (Python-dict arguments, a broken stream) would otherwise hold the rest of its answer in memory to the end; past
# this the stream ends with an error event: the call's block cannot stop before its input is whole (the client
# reads the input at the stop), and nothing may follow the block's stop for it.
MAX_HELD_CHARS = 1 << 20


class _CallNeverWhole(Exception):
    """MAX_HELD_CHARS of the answer arrived behind a call whose arguments are still not JSON."""


_PIECE_BLOCKS = {
    "thinking": ({"type": "thinking", "thinking": "", "signature": ""}, "thinking_delta"),
    "text": ({"type": "text", "text": ""}, "text_delta"),
}


# --- stream: chat chunks -> Anthropic events -------------------------------------------------------------------


class ChatStreamToMessages:
    """Chat-completion chunks in, Anthropic stream events out (docs.anthropic.com "Streaming Messages").

    message_start goes out with the first chunk; then one content block at a time: text, thinking (when asked for),
    and one tool_use block per tool call in the order the calls start, its arguments as input_json_delta. A block
    stops when the next one starts or the stream ends. Anthropic's blocks are sequential, while a chat stream may
    interleave a call's argument fragments with another call's (index 0, 1, 0, 1) or with text: while the open block
    is a call whose arguments are not yet whole JSON, whatever else arrives (another call, text, thinking) is held,
    in order, and goes out once they are whole (or at the end). So a call's block never stops before its input is
    whole (a client reads the input at the stop), every delta comes between its own block's start and stop, and
    nothing is dropped; text that interrupted a call comes after it, in a block of its own, the one place
    Anthropic's stream has for it. A fragment's call is found by its `index` or its `id`, as servers other than
    OpenAI and vLLM need (gateway/apis/chat_calls.py), the way the output guard finds it. The upstream sends usage
    in its last chunk only (`include_usage`), after message_start has gone, so message_start counts 0 and the final
    message_delta carries the real input, cache-read and output counts: the SDK's accumulator takes each one it
    finds there.
    Only choice 0 is read: a Messages request asks for one answer.
    """

    def __init__(self, model: str, *, stop_sequences: Sequence[str] = (), thinking: bool = False) -> None:
        self.model = model
        self.stop_sequences = tuple(stop_sequences)
        self.thinking = thinking
        self._started = False
        self._closed = False
        self._blocks = 0  # content blocks started so far: the next one's index
        self._open: str | _ToolCall | None = None  # the open block: "text", "thinking", or a tool call
        self._calls: list[_ToolCall] = []  # every tool call seen, in the order they started
        self._numbers = StreamedCalls()  # which of them a fragment belongs to
        self._held: deque[_ToolCall | _Piece] = deque()  # what waits for the open call to be whole, in order
        self._held_chars = 0  # of the text and thinking in it
        self._finish_reason: Any = None
        self._stop_reason: Any = None
        self._usage: Any = None

    def feed(self, chunk: dict[str, Any]) -> list[bytes]:
        """One parsed chat chunk -> the events it makes (none once the stream closed). An upstream error chunk
        (`{"error": {...}}`, as vLLM and the bundled engine send mid-stream) becomes the error event."""
        if self._closed:
            return []
        if isinstance(chunk.get("error"), dict):
            return [self._upstream_error(chunk["error"])]
        events = self._start(chunk)
        if chunk.get("usage"):
            self._usage = chunk["usage"]
        try:
            for choice in chunk.get("choices") or ():
                if choice.get("index", 0) == 0:
                    events += self._choice(choice)
        except _CallNeverWhole:
            message = f"a tool call's arguments were still not JSON after {MAX_HELD_CHARS} more characters"
            return [typed_event(e) for e in events] + [self.error("api_error", message)]
        return [typed_event(e) for e in events]

    def finish(self) -> list[bytes]:
        """At the upstream's [DONE]: the open block's content_block_stop, message_delta (stop reason, usage) and
        message_stop; nothing when the stream already closed (finished, or ended by an error)."""
        if self._closed:
            return []
        events = self._start({})
        events += self._release(to_the_end=True)
        events += self._close_block()
        stop_reason, stop_sequence = _stop(
            self._finish_reason, self._stop_reason, self.stop_sequences, bool(self._calls)
        )
        usage = _usage(self._usage)
        delta_usage = usage if self._usage else {"output_tokens": 0}
        events.append(
            {
                "type": "message_delta",
                "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                "usage": delta_usage,
            }
        )
        events.append({"type": "message_stop"})
        self._closed = True
        return [typed_event(e) for e in events]

    def error(self, error_type: str, message: str) -> bytes:
        """The `error` event for a stream that breaks after it started; the stream is closed after it."""
        self._closed = True
        return typed_event({"type": "error", "error": {"type": error_type, "message": message}})

    def _upstream_error(self, error: dict[str, Any]) -> bytes:
        code = str(error.get("code") or "")
        status = int(code) if code.isascii() and code.isdigit() else 500
        return self.error(anthropic_error_type(status), str(error.get("message") or "upstream error"))

    def _start(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        if self._started:
            return []
        self._started = True
        usage = _usage(chunk.get("usage"))
        message: dict[str, Any] = {
            "id": _message_id(chunk.get("id")),
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {**usage, "output_tokens": 0},
        }
        return [{"type": "message_start", "message": message}]

    def _choice(self, choice: dict[str, Any]) -> list[dict[str, Any]]:
        delta = choice.get("delta") or {}
        events: list[dict[str, Any]] = []
        reasoning = _reasoning(delta)
        if reasoning and self.thinking:
            events += self._piece(_Piece("thinking", reasoning))
        text = _text(delta.get("content")) or _text(delta.get("refusal"))
        if text:
            events += self._piece(_Piece("text", text))
        for call in delta.get("tool_calls") or ():
            events += self._tool_call(call)
        if choice.get("finish_reason"):
            self._finish_reason = choice["finish_reason"]
            self._stop_reason = choice.get("stop_reason")
        return events

    def _tool_call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        """A tool-call fragment: the call's first names it (id and name come first, as OpenAI and vLLM send them) and
        queues its tool_use block; an arguments fragment is an input_json_delta on that call's block once it started,
        kept with the call until then."""
        function = call.get("function") or {}
        number, starts = self._numbers.number(call)
        if starts:
            self._calls.append(_ToolCall(_text(call.get("id")) or _tool_use_id(), _text(function.get("name"))))
            self._held.append(self._calls[-1])
        entry = self._calls[number]
        arguments = _text(function.get("arguments"))
        entry.arguments.append(arguments)
        events: list[dict[str, Any]] = []
        if entry.block is not None and arguments:
            events.append(_arguments_delta(entry.block, arguments))
        return events + self._release()

    def _piece(self, piece: _Piece) -> list[dict[str, Any]]:
        """Text or thinking: a delta on its block, or held behind a call whose arguments are not yet whole (its
        block cannot stop yet, and no other block may start before it stops)."""
        if not self._call_in_progress():
            return self._unhold(piece)
        if self._held_chars + len(piece.text) > MAX_HELD_CHARS:
            raise _CallNeverWhole()
        self._held.append(piece)
        self._held_chars += len(piece.text)
        return []

    def _release(self, to_the_end: bool = False) -> list[dict[str, Any]]:
        """What was held, in order, up to a call whose arguments are still not whole (`to_the_end`: all of it)."""
        events: list[dict[str, Any]] = []
        while self._held and (to_the_end or not self._call_in_progress()):
            held = self._held.popleft()
            if isinstance(held, _Piece):
                self._held_chars -= len(held.text)
            events += self._unhold(held)
        return events

    def _call_in_progress(self) -> bool:
        """Whether the open block is a tool call whose arguments are not yet a whole JSON value."""
        call = self._open
        return isinstance(call, _ToolCall) and not call.arguments.whole()

    def _unhold(self, held: _ToolCall | _Piece) -> list[dict[str, Any]]:
        """A held piece's delta on its block; a held call's block, started with the arguments it gathered."""
        if isinstance(held, _Piece):
            start, delta_type = _PIECE_BLOCKS[held.kind]
            events = self._open_block(held.kind, {**start})
            events.append(self._delta({"type": delta_type, held.kind: held.text}))
            return events
        block = {"type": "tool_use", "id": held.id, "name": held.name, "input": {}}
        events = self._open_block(held, block)
        held.block = self._blocks - 1
        if held.arguments:
            events.append(_arguments_delta(held.block, str(held.arguments.text)))
        return events

    def _open_block(self, key: str | _ToolCall, block: dict[str, Any]) -> list[dict[str, Any]]:
        """Start a block unless it is the open one, stopping the open one first."""
        if self._open == key:
            return []
        events = self._close_block()
        events.append({"type": "content_block_start", "index": self._blocks, "content_block": block})
        self._open = key
        self._blocks += 1
        return events

    def _close_block(self) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        self._open = None
        return [{"type": "content_block_stop", "index": self._blocks - 1}]

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self._blocks - 1, "delta": delta}
