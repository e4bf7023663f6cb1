"""How a request of one shape travels to a pool of one API, and its answer back: the upstream path, the translation
between the two APIs (gateway/apis/translation.py), and the format the pool answers in. `_EXCHANGES` is the registry,
one line a pair of request shape and pool API; `POOL_APIS` says how each pool API is addressed.

| request shape | `openai` pool | `anthropic` pool |
|---|---|---|
| chat, completions, responses, embeddings | as sent | refused (400): the pool speaks Messages only |
| messages | translated to chat completions, answer translated back | as sent |
| count_tokens | answered by the gateway from its own count | as sent |
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.apis.answers import AnswerFormat, MessagesFormat, ResponsesFormat, TokenCountFormat
from gateway.apis.anthropic.chat_pool import CountedHere, MessagesToChat
from gateway.apis.anthropic.pool_api import AnthropicPoolApi
from gateway.apis.pool_api import PoolApi
from gateway.apis.shape import Api
from gateway.apis.translation import AS_SENT, Translation
from gateway.errors import invalid_request


@dataclass(frozen=True, slots=True)
class Exchange:
    path: str  # on the upstream
    answers: AnswerFormat  # what the upstream answers in
    translation: Translation = AS_SENT  # between the client's API and the pool's
    asks_usage: bool = False  # OpenAI chat and completions streams report usage only when asked (stream_options)

    def client_answers(self, payload: dict[str, Any]) -> AnswerFormat:
        """Where the generated text the client gets is, for the output guard (the translation's say)."""
        return self.translation.client_answers(payload, self.answers)


_CHAT = AnswerFormat()
_EXCHANGES: dict[tuple[str, str], Exchange] = {
    ("chat", "openai"): Exchange("/v1/chat/completions", _CHAT, asks_usage=True),
    ("completions", "openai"): Exchange("/v1/completions", _CHAT, asks_usage=True),
    ("embeddings", "openai"): Exchange("/v1/embeddings", _CHAT),
    ("responses", "openai"): Exchange("/v1/responses", ResponsesFormat()),
    ("messages", "openai"): Exchange("/v1/chat/completions", _CHAT, MessagesToChat()),
    ("messages", "anthropic"): Exchange("/v1/messages", MessagesFormat()),
    ("count_tokens", "openai"): Exchange("", TokenCountFormat(), CountedHere()),
    ("count_tokens", "anthropic"): Exchange("/v1/messages/count_tokens", TokenCountFormat()),
}
POOL_APIS: dict[str, PoolApi] = {"openai": PoolApi(), "anthropic": AnthropicPoolApi()}


def exchange_for(api: Api, pool_api: str, pool: str) -> Exchange:
    """The way between a request shape and a pool; a 400 where there is none."""
    found = _EXCHANGES.get((api.name, pool_api))
    if found is None:
        raise invalid_request(
            f"pool {pool!r} speaks the {pool_api} API, which does not serve {api.path}: send this model's requests "
            "to /v1/messages",
            code="unsupported_route_for_model",
        )
    return found
