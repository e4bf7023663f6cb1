"""A stored answer as the stream a streaming client asks for, in the upstream's own stream format (the format the
relay reads, so the output guard and the Messages translation read a replay as they read an upstream's stream).

The cache keeps the non-streamed form of every answer (gateway/cache/assemble.py builds it from a stream); replayed,
each text goes out whole, in one delta, framed by the events its format opens and closes it with:
- chat and completions: a chunk per choice with its whole message (or text), a chunk with the finish reasons, the
  usage chunk where the client asked for it (`stream_options.include_usage`), then [DONE] (platform.openai.com's
  chat-completions streaming reference);
- Responses: response.created, in_progress, each output item added and done (a message's content parts added, their
  text in one delta, done), then response.completed with the stored Response (its streaming events reference);
- Messages: message_start, each content block started, its text, thinking, signature or input JSON in one delta,
  stopped, then message_delta with the stop reason and usage, and message_stop (docs.anthropic.com "Streaming
  Messages").
"""

from __future__ import annotations

import itertools
from typing import Any

import orjson

from gateway.streaming.sse import DONE, typed_event

CHAT, COMPLETIONS, RESPONSES, MESSAGES = "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"


def replayed(path: str, answer: dict[str, Any], include_usage: bool) -> list[bytes]:
    """The stream events of `answer`, an answer of the upstream route `path`."""
    if path == RESPONSES:
        return _responses(answer)
    if path == MESSAGES:
        return _messages(answer)
    return _chunks(answer, path == CHAT, include_usage)


def _data(chunk: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


def _chunks(answer: dict[str, Any], chat: bool, include_usage: bool) -> list[bytes]:
    base: dict[str, Any] = {k: answer[k] for k in ("id", "created", "model", "system_fingerprint") if k in answer}
    base["object"] = "chat.completion.chunk" if chat else "text_completion"
    choices = [c for c in answer.get("choices") or () if isinstance(c, dict)]
    events = []
    for number, choice in enumerate(choices):
        index = choice.get("index", number)
        if chat:
            part: dict[str, Any] = {"delta": _delta(choice.get("message"))}
        else:
            part = {"text": choice.get("text") or ""}
        if choice.get("logprobs") is not None:
            part["logprobs"] = choice["logprobs"]
        events.append(_data({**base, "choices": [{"index": index, **part, "finish_reason": None}]}))
    ends = [
        {"index": choice.get("index", number), **({"delta": {}} if chat else {"text": ""}), **_finish(choice)}
        for number, choice in enumerate(choices)
    ]
    events.append(_data({**base, "choices": ends}))
    if include_usage and isinstance(answer.get("usage"), dict):
        events.append(_data({**base, "choices": [], "usage": answer["usage"]}))
    events.append(DONE)
    return events


def _finish(choice: dict[str, Any]) -> dict[str, Any]:
    """A choice's finish reason, and vLLM's stop_reason beside it where the answer had one."""
    ended = {"finish_reason": choice.get("finish_reason")}
    if "stop_reason" in choice:
        ended["stop_reason"] = choice["stop_reason"]
    return ended


def _delta(message: Any) -> dict[str, Any]:
    """A chat message as one delta: its fields but the empty ones, its tool calls numbered as a stream numbers
    them."""
    if not isinstance(message, dict):
        return {}
    delta = {key: value for key, value in message.items() if value is not None and key != "tool_calls"}
    calls = message.get("tool_calls")
    if isinstance(calls, list) and calls:
        delta["tool_calls"] = [{"index": j, **call} for j, call in enumerate(calls) if isinstance(call, dict)]
    return delta


def _responses(answer: dict[str, Any]) -> list[bytes]:
    numbers = itertools.count()
    events: list[bytes] = []

    def event(kind: str, **fields: Any) -> None:
        events.append(typed_event({"type": kind, **fields, "sequence_number": next(numbers)}))

    opened = {**answer, "status": "in_progress", "output": [], "usage": None}
    event("response.created", response=opened)
    event("response.in_progress", response=opened)
    for index, item in enumerate(answer.get("output") or ()):
        if not isinstance(item, dict) or item.get("type") != "message":
            event("response.output_item.added", output_index=index, item=item)
            event("response.output_item.done", output_index=index, item=item)
            continue
        event("response.output_item.added", output_index=index, item={**item, "status": "in_progress", "content": []})
        for part_index, part in enumerate(item.get("content") or ()):
            at = {"item_id": item.get("id"), "output_index": index, "content_index": part_index}
            kind = part.get("type") if isinstance(part, dict) else None
            key = {"output_text": "text", "refusal": "refusal"}.get(kind) if isinstance(kind, str) else None
            if key is None or not isinstance(part.get(key), str):
                event("response.content_part.added", **at, part=part)
                event("response.content_part.done", **at, part=part)
                continue
            logprobs: dict[str, Any] = {"logprobs": []} if key == "text" else {}
            event("response.content_part.added", **at, part={**part, key: ""})
            event(f"response.{kind}.delta", **at, delta=part[key], **logprobs)
            event(f"response.{kind}.done", **at, **{key: part[key]}, **logprobs)
            event("response.content_part.done", **at, part=part)
        event("response.output_item.done", output_index=index, item=item)
    event("response.completed", response=answer)
    return events


_BLOCK_DELTAS = {"text": ("text", "text_delta"), "thinking": ("thinking", "thinking_delta")}


def _messages(answer: dict[str, Any]) -> list[bytes]:
    usage: dict[str, Any] = answer["usage"] if isinstance(answer.get("usage"), dict) else {}
    started = {**answer, "content": [], "stop_reason": None, "stop_sequence": None, "usage": {**usage}}
    events: list[dict[str, Any]] = [{"type": "message_start", "message": started}]
    for index, block in enumerate(answer.get("content") or ()):
        if not isinstance(block, dict):
            continue
        kind = block.get("type")
        deltas: list[dict[str, Any]] = []
        start = dict(block)
        if kind in _BLOCK_DELTAS:
            key, delta_type = _BLOCK_DELTAS[kind]
            start[key] = ""
            deltas.append({"type": delta_type, key: block.get(key) or ""})
            if kind == "thinking":
                start["signature"] = ""
                deltas.append({"type": "signature_delta", "signature": block.get("signature") or ""})
        elif "input" in block:
            start["input"] = {}
            deltas.append({"type": "input_json_delta", "partial_json": orjson.dumps(block["input"]).decode()})
        events.append({"type": "content_block_start", "index": index, "content_block": start})
        events += ({"type": "content_block_delta", "index": index, "delta": delta} for delta in deltas)
        events.append({"type": "content_block_stop", "index": index})
    stop = {"stop_reason": answer.get("stop_reason"), "stop_sequence": answer.get("stop_sequence")}
    events.append({"type": "message_delta", "delta": stop, "usage": {"output_tokens": usage.get("output_tokens", 0)}})
    events.append({"type": "message_stop"})
    return [typed_event(e) for e in events]
