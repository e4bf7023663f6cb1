"""The translations for a Messages client of a pool that speaks OpenAI chat completions (gateway/apis/translation.py):
the request through `to_chat`, the answer and the stream back through `from_chat`, so that an `anthropic` SDK client
cannot tell; and its count_tokens, answered by the gateway."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import orjson

from gateway.apis.answers import AnswerFormat
from gateway.apis.anthropic.checks import MessagesRequestError
from gateway.apis.anthropic.from_chat import ChatStreamToMessages, chat_to_message
from gateway.apis.anthropic.to_chat import asks_thinking, messages_to_chat
from gateway.apis.translation import Translation, read_pool_answer
from gateway.errors import invalid_request
from gateway.streaming.sse import event_data

_POOL_ANSWER = "chat completion"
_WITHOUT_REASONING = AnswerFormat(reasoning=False)


class MessagesToChat(Translation):
    """Messages in, chat completions to the pool, a Message (or Anthropic's stream events) back."""

    encodes_request = True
    asks_stream_usage = True  # messages_to_chat asks a stream for its usage: the final message_delta carries it

    def request(self, payload: dict[str, Any], as_sent: Callable[[], bytes]) -> bytes:
        """The chat-completions request; a 400 naming the field that has none (a server tool, a file source)."""
        try:
            return orjson.dumps(messages_to_chat(payload))
        except MessagesRequestError as exc:
            raise invalid_request(str(exc), param=exc.param) from None

    def answer(self, body: bytes, payload: dict[str, Any], model: str) -> bytes:
        stops, thinking = payload.get("stop_sequences") or (), asks_thinking(payload)
        message = read_pool_answer(
            lambda: chat_to_message(orjson.loads(body), model, stop_sequences=stops, thinking=thinking), _POOL_ANSWER
        )
        return orjson.dumps(message)

    def media_type(self, pool_media_type: str) -> str | None:
        return None

    def stream(self, payload: dict[str, Any], model: str) -> ChatEventsToMessages:
        stops, thinking = payload.get("stop_sequences") or (), asks_thinking(payload)
        return ChatEventsToMessages(ChatStreamToMessages(model, stop_sequences=stops, thinking=thinking))

    def client_answers(self, payload: dict[str, Any], answers: AnswerFormat) -> AnswerFormat:
        """The chat answer less its reasoning, unless the request asked for thinking: only then does the client get
        it (as thinking blocks)."""
        return answers if asks_thinking(payload) else _WITHOUT_REASONING


class CountedHere(Translation):
    """count_tokens, which a chat pool does not serve: the gateway answers it from the tokenize stage's count, exact
    for the pool's tokenizer (the count is of the chat the request translates to, gateway/apis/messages.py)."""

    def local_answer(self, prompt_tokens: int) -> bytes:
        return orjson.dumps({"input_tokens": prompt_tokens})


class ChatEventsToMessages:
    """A chat stream's framed events as the Anthropic events they make; its [DONE] closes the message (and carries
    the usage over)."""

    def __init__(self, chunks: ChatStreamToMessages) -> None:
        self._chunks = chunks

    def feed(self, events: list[bytes]) -> list[bytes]:
        out: list[bytes] = []
        for event in events:
            data = event_data(event)
            if data == b"[DONE]":
                out += read_pool_answer(self._chunks.finish, _POOL_ANSWER)
            elif data is not None and isinstance(chunk := _json(data), dict):
                out += read_pool_answer(functools.partial(self._chunks.feed, chunk), _POOL_ANSWER)
        return out


def _json(data: bytes) -> Any:
    """An event's data parsed, None where it is not JSON (an event the chat format has, that carries no chunk)."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
