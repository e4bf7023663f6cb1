"""A streamed answer assembled, as it passes, into the non-streamed answer the cache keeps (what the upstream would
have answered without `stream`), in the upstream's format; gateway/cache/replay.py is the way back.

Only what can be rebuilt exactly is assembled: a chat or completions choice's text, reasoning, refusal and tool
calls (their fragments joined by index), its finish reason, the usage chunk; a Responses stream's final Response
(response.completed carries it whole); a Messages stream's message, its blocks' text, thinking, signature and tool
input (input JSON fragments joined, then parsed). Anything else a stream carries (logprobs, an event of a type not
listed here, a tool input that is not JSON) leaves the answer unassembled: not stored, never stored wrong. The
events it keeps are counted as they come (their data's bytes, framing and all: a bound a little below the answer's
own size): past `max_bytes` the assembly stops, and nothing is stored.
"""

from __future__ import annotations

from typing import Any

import orjson

from gateway.cache.replay import CHAT, COMPLETIONS, MESSAGES, RESPONSES

# finish reasons of an answer that ended as its model meant it to: not cut by a token bound or a content filter
_NORMAL_FINISH = frozenset({"stop", "tool_calls", "function_call", "end_turn", "stop_sequence", "tool_use"})
_CHAT_TEXTS = ("content", "reasoning_content", "reasoning", "refusal")


def complete(path: str, answer: dict[str, Any]) -> bool:
    """Whether a whole answer ended normally, so it may be served again: every choice stopped (chat, completions),
    the Response completed, the message ended its turn; an embeddings answer has its data."""
    if path == RESPONSES:
        return answer.get("status") == "completed"
    if path == MESSAGES:
        return answer.get("stop_reason") in _NORMAL_FINISH
    if path in (CHAT, COMPLETIONS):
        choices = answer.get("choices")
        return (
            isinstance(choices, list)
            and bool(choices)
            and all(isinstance(c, dict) and c.get("finish_reason") in _NORMAL_FINISH for c in choices)
        )
    return isinstance(answer.get("data"), list)


class Assembly:
    """One stream's answer, assembled from its parsed events (`feed`), whole once it ended (`answer`)."""

    def __init__(self, path: str, max_bytes: int) -> None:
        self._path = path
        self._left = max_bytes
        self._failed = False
        self._top: dict[str, Any] = {}
        self._choices: dict[int, dict[str, Any]] = {}  # chat, completions: by index
        self._final: dict[str, Any] | None = None  # Responses: response.completed's
        self._message: dict[str, Any] | None = None  # Messages
        self._blocks: dict[int, dict[str, Any]] = {}
        self._inputs: dict[int, list[str]] = {}

    def feed(self, event: dict[str, Any], size: int) -> None:
        if self._failed:
            return
        if self._path != RESPONSES or event.get("type") == "response.completed":  # what it keeps
            self._left -= size
        if self._left < 0:
            self._failed = True
            return
        try:
            if self._path == RESPONSES:
                self._response_event(event)
            elif self._path == MESSAGES:
                self._message_event(event)
            else:
                self._chunk(event)
        except (TypeError, ValueError, KeyError, AttributeError):  # a field of a shape no client reads either
            self._failed = True

    def answer(self) -> dict[str, Any] | None:
        """The whole answer; None where the stream held what this cannot rebuild."""
        if self._failed:
            return None
        if self._path == RESPONSES:
            return self._final
        try:
            return self._whole_message() if self._path == MESSAGES else self._whole_completion()
        except (TypeError, ValueError, KeyError):  # a tool input that never became JSON, indexes that do not sort
            return None

    # ---- chat and completions --------------------------------------------------------------------------------
    def _chunk(self, chunk: dict[str, Any]) -> None:
        if "error" in chunk:
            self._failed = True
            return
        for key in ("id", "created", "model", "system_fingerprint"):
            if key in chunk and key not in self._top:
                self._top[key] = chunk[key]
        if isinstance(chunk.get("usage"), dict):
            self._top["usage"] = chunk["usage"]
        for choice in chunk.get("choices") or ():
            if choice.get("logprobs") is not None:
                self._failed = True
                return
            whole = self._choices.setdefault(choice.get("index", 0), {"message": {}, "text": ""})
            if isinstance(choice.get("text"), str):
                whole["text"] += choice["text"]
            self._delta(whole["message"], choice.get("delta") or {})
            if choice.get("finish_reason") is not None:
                whole["finish_reason"] = choice["finish_reason"]
            if "stop_reason" in choice:
                whole["stop_reason"] = choice["stop_reason"]

    def _delta(self, message: dict[str, Any], delta: dict[str, Any]) -> None:
        for key, value in delta.items():
            if key in _CHAT_TEXTS and isinstance(value, str):
                message[key] = message.get(key, "") + value
            elif key == "role" and isinstance(value, str):
                message["role"] = value
            elif key == "tool_calls" and isinstance(value, list):
                calls = message.setdefault("tool_calls", {})
                for fragment in value:
                    call = calls.setdefault(fragment["index"], {"function": {"arguments": ""}})
                    for field in ("id", "type"):
                        if fragment.get(field):
                            call[field] = fragment[field]
                    function = fragment.get("function") or {}
                    if function.get("name"):
                        call["function"]["name"] = function["name"]
                    call["function"]["arguments"] += function.get("arguments") or ""
            elif value is not None:  # a field this cannot join (a legacy function_call, audio...)
                raise ValueError(key)

    def _whole_completion(self) -> dict[str, Any] | None:
        chat = self._path == CHAT
        choices = []
        for index in sorted(self._choices):
            whole = self._choices[index]
            choice: dict[str, Any] = {"index": index}
            if chat:
                message = {"role": "assistant", "content": None, **whole["message"]}
                if "tool_calls" in message:
                    message["tool_calls"] = [message["tool_calls"][i] for i in sorted(message["tool_calls"])]
                choice["message"] = message
            else:
                choice["text"] = whole["text"]
            choice["finish_reason"] = whole.get("finish_reason")
            if "stop_reason" in whole:
                choice["stop_reason"] = whole["stop_reason"]
            choices.append(choice)
        if not choices:
            return None
        obj = "chat.completion" if chat else "text_completion"
        return {**self._top, "object": obj, "choices": choices}

    # ---- Responses -------------------------------------------------------------------------------------------
    def _response_event(self, event: dict[str, Any]) -> None:
        if event.get("type") == "response.completed" and isinstance(event.get("response"), dict):
            self._final = event["response"]

    # ---- Messages --------------------------------------------------------------------------------------------
    def _message_event(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        if kind == "message_start":
            self._message = dict(event["message"])
        elif kind == "content_block_start":
            self._blocks[event["index"]] = dict(event["content_block"])
        elif kind == "content_block_delta":
            block, delta = self._blocks[event["index"]], event["delta"]
            field = {"text_delta": "text", "thinking_delta": "thinking", "signature_delta": "signature"}.get(
                delta["type"]
            )
            if field is not None:
                block[field] = block.get(field, "") + delta[field]
            elif delta["type"] == "input_json_delta":
                self._inputs.setdefault(event["index"], []).append(delta["partial_json"])
            else:
                raise ValueError(delta["type"])
        elif kind == "message_delta" and self._message is not None:
            self._message.update(event.get("delta") or {})
            self._message["usage"] = {**(self._message.get("usage") or {}), **(event.get("usage") or {})}
        elif kind not in ("content_block_stop", "message_stop", "ping"):
            raise ValueError(kind)

    def _whole_message(self) -> dict[str, Any] | None:
        if self._message is None:
            return None
        for index, parts in self._inputs.items():
            self._blocks[index]["input"] = orjson.loads("".join(parts))  # a ValueError: never whole JSON
        return {**self._message, "content": [self._blocks[i] for i in sorted(self._blocks)]}
