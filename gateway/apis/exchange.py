"""How a request of one shape travels to a pool of one API, and its answer back: the upstream path, whether the
body is translated (Anthropic Messages to an OpenAI-compatible pool), and the format the answer comes in.

| request shape | `openai` pool | `anthropic` pool |
|---|---|---|
| chat, completions, responses, embeddings | as sent | refused (400): the pool speaks Messages only |
| messages | translated to chat completions, answer translated back | as sent |
| count_tokens | answered by the gateway from its own count | as sent |

The output guard reads the answer as the client gets it (`client_answers`): a translated answer's reasoning only
where the Messages request asked for thinking, the one case the translation keeps it (as thinking blocks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.apis.answers import AnswerFormat, MessagesFormat, ResponsesFormat, TokenCountFormat
from gateway.apis.anthropic.to_chat import asks_thinking
from gateway.apis.shape import Api
from gateway.errors import invalid_request


@dataclass(frozen=True, slots=True)
class Exchange:
    path: str  # on the upstream
    answers: AnswerFormat  # what the upstream answers in
    translated: bool = False  # Anthropic Messages in, OpenAI chat to the pool, and back
    local: bool = False  # the gateway answers itself (nothing to ask the pool)
    asks_usage: bool = False  # OpenAI chat and completions streams report usage only when asked (stream_options)

    def client_answers(self, payload: dict[str, Any]) -> AnswerFormat:
        """Where the generated text the client gets is, for the output guard: a translated answer's reasoning is
        dropped unless the request asked for thinking, and scanning it then could only block what nobody sees."""
        if self.translated and not asks_thinking(payload):
            return _CHAT_WITHOUT_REASONING
        return self.answers


_CHAT = AnswerFormat()
_CHAT_WITHOUT_REASONING = AnswerFormat(reasoning=False)
_EXCHANGES: dict[tuple[str, str], Exchange] = {
    ("chat", "openai"): Exchange("/v1/chat/completions", _CHAT, asks_usage=True),
    ("completions", "openai"): Exchange("/v1/completions", _CHAT, asks_usage=True),
    ("embeddings", "openai"): Exchange("/v1/embeddings", _CHAT),
    ("responses", "openai"): Exchange("/v1/responses", ResponsesFormat()),
    ("messages", "openai"): Exchange("/v1/chat/completions", _CHAT, translated=True),
    ("messages", "anthropic"): Exchange("/v1/messages", MessagesFormat()),
    ("count_tokens", "openai"): Exchange("", TokenCountFormat(), local=True),
    ("count_tokens", "anthropic"): Exchange("/v1/messages/count_tokens", TokenCountFormat()),
}


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
