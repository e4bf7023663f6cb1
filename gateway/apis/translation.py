"""The seam between the API a client speaks and the API its pool speaks: one `Translation` per pair.

A translation owns everything that differs between the two sides of one pair: the body the pool is sent, the
non-streamed answer and its media type, the stream event by event, which part of the answer the client reads (so the
output guard reads what the client gets), and the answer the gateway gives itself where the pool's API has no
counterpart. The upstream call (gateway/relay/upstream.py) knows only this interface;
gateway/apis/exchange.py lists which translation each pair of client API and pool API takes.

The base class is the identity, for a client and a pool of the same API: the body as the request's stages left it,
the answer and the stream as the pool sent them. A pair of different APIs subclasses it (one module per pair, beside
the client API's other code) and overrides what differs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from gateway.apis.answers import AnswerFormat
from gateway.errors import GatewayError

T = TypeVar("T")


class StreamTranslation(Protocol):
    """One stream's translation: the pool's framed SSE events in, the client's out. It may hold state from event to
    event (an open block, usage seen so far), so each stream gets its own."""

    def feed(self, events: list[bytes]) -> list[bytes]: ...


class Translation:
    """The identity: a client and a pool of the same API."""

    # request() makes a new body from the payload (so a big one is encoded off the event loop, as a rewritten one is)
    encodes_request = False
    # the body request() makes asks the pool's stream for its usage (so a stream replayed from the cache has it too)
    asks_stream_usage = False

    def local_answer(self, prompt_tokens: int) -> bytes | None:
        """The answer's body where the gateway answers the request itself from what its stages know (`prompt_tokens`:
        the tokenize stage's exact count); None asks the pool."""
        return None

    def request(self, payload: dict[str, Any], as_sent: Callable[[], bytes]) -> bytes:
        """The body the pool is sent, from the request's payload; `as_sent` is the client's own body as the stages
        left it. A GatewayError (400) where the request has no translation."""
        return as_sent()

    def answer(self, body: bytes, payload: dict[str, Any], model: str) -> bytes:
        """A non-streamed 200's body as the client gets it; `payload` is the client's request, `model` the one
        that served it. A GatewayError (502) where the pool's answer is not what its API answers."""
        return body

    def media_type(self, pool_media_type: str) -> str | None:
        """The media type of the client's non-streamed answer, from the pool's; None sends none."""
        return pool_media_type

    def stream(self, payload: dict[str, Any], model: str) -> StreamTranslation | None:
        """A fresh translation for one stream; None relays the pool's events as they are."""
        return None

    def client_answers(self, payload: dict[str, Any], answers: AnswerFormat) -> AnswerFormat:
        """Where, in the pool's answer (`answers`: its format), is the generated text the client gets: the output
        guard reads that, and only that (scanning what the translation drops could only block what nobody sees)."""
        return answers


AS_SENT = Translation()


def read_pool_answer(translate: Callable[[], T], pool_answer: str) -> T:
    """A translation of a pool's answer; a 502 where the answer is not the `pool_answer` (a chat completion...) it
    claims to be."""
    try:
        return translate()
    except (AttributeError, TypeError, ValueError, KeyError) as exc:
        raise GatewayError(
            502,
            f"the upstream's answer is not a {pool_answer} the gateway can translate ({type(exc).__name__})",
            type="upstream_error",
            code="upstream_bad_response",
        ) from None
