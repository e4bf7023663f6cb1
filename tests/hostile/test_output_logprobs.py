"""Logprobs read as a client reconstructs text from them, through the gateway and hostile upstream of
tests/hostile/test_output_inventory.py, for the tenant that redacts secrets.

An answer whose text holds a key spells it again in its logprobs: in one token, split across tokens, or only in the
tokens' `bytes`. The key in the text is redacted, but a logprobs entry cannot be rewritten consistently, so the answer
must be refused: what is checked is that no reconstruction a client can make (the tokens run together, the bytes
decoded and run together, every string) holds the key, and that the refusal is explicit. A clean answer's logprobs
reach the client as sent.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import Process
from tests.hostile.test_output_inventory import KEY, ask, assert_blocked, frames, gw, readable, received
from tests.integration.test_guard_gateway import bearer

__all__ = ["gw"]  # the module's gateway, shared with the output inventory's fixture

BEFORE, AFTER = "The key is ", ", keep it safe."
TEXT = BEFORE + KEY + AFTER


def tokens_of(text: str, case: str) -> list[str]:
    """The answer's tokens: the key in one token, split across tokens, or hidden (each token `?`, its bytes the
    text's)."""
    if case == "one_token":
        return [BEFORE, KEY, AFTER]
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)]
    return pieces if case == "split" else ["?"] * len(pieces)


def entries(text: str, case: str) -> list[dict[str, Any]]:
    """Chat's and Responses' logprobs entries for `text`: each token with its bytes and an alternative."""
    tokens = tokens_of(text, case)
    spelled = [BEFORE, KEY, AFTER] if case == "one_token" else [text[i : i + 3] for i in range(0, len(text), 3)]
    return [
        {
            "token": token,
            "logprob": -0.5,
            "bytes": list(piece.encode()),
            "top_logprobs": [{"token": token, "logprob": -0.5, "bytes": list(piece.encode())}],
        }
        for token, piece in zip(tokens, spelled, strict=True)
    ]


def halves(items: list[Any]) -> list[list[Any]]:
    """Items as two stream events carry them."""
    return [items[: len(items) // 2], items[len(items) // 2 :]]


def chat(stream: bool, text: str, case: str) -> Any:
    if not stream:
        message = {"role": "assistant", "content": text}
        choice = {"index": 0, "message": message, "logprobs": {"content": entries(text, case)}, "finish_reason": "stop"}
        return {"id": "c1", "object": "chat.completion", "model": "test-model", "choices": [choice]}
    content, logprobs = halves(list(text)), halves(entries(text, case))
    chunks = [
        {
            "id": "c1",
            "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": {"content": "".join(c)}, "logprobs": {"content": lp}}],
        }
        for c, lp in zip(content, logprobs, strict=True)
    ]
    end = {"index": 0, "delta": {}, "finish_reason": "stop"}
    return [*chunks, {"id": "c1", "object": "chat.completion.chunk", "choices": [end]}, "[DONE]"]


def completions(stream: bool, text: str, case: str) -> Any:
    tokens = tokens_of(text, case)

    def choice(piece: str, tokens: list[str]) -> dict[str, Any]:
        top = [{" alt": -2.5} for _ in tokens]  # (an alternative is an object's key: an identifier, read as one)
        logprobs = {"tokens": tokens, "token_logprobs": [-0.5] * len(tokens), "top_logprobs": top}
        return {"index": 0, "text": piece, "logprobs": logprobs, "finish_reason": None}

    if not stream:
        return {"id": "c1", "object": "text_completion", "model": "test-model", "choices": [choice(text, tokens)]}
    parts = zip(halves(list(text)), halves(tokens), strict=True)
    chunks = [{"id": "c1", "object": "text_completion", "choices": [choice("".join(p), t)]} for p, t in parts]
    return [*chunks, "[DONE]"]


def responses(stream: bool, text: str, case: str) -> Any:
    logprobs = entries(text, case)
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}
    item = {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed", "content": [part]}
    response = {"id": "resp_1", "object": "response", "status": "completed", "model": "test-model", "output": [item]}
    if not stream:
        return response
    at = {"item_id": "msg_1", "output_index": 0, "content_index": 0}
    deltas = [
        {"type": "response.output_text.delta", **at, "delta": "".join(d), "logprobs": lp}
        for d, lp in zip(halves(list(text)), halves(logprobs), strict=True)
    ]
    return [
        {"type": "response.created", "response": {**response, "status": "in_progress", "output": []}},
        {"type": "response.output_item.added", "output_index": 0, "item": {**item, "content": []}},
        {"type": "response.content_part.added", **at, "part": {**part, "text": "", "logprobs": []}},
        *deltas,
        {"type": "response.output_text.done", **at, "text": text, "logprobs": logprobs},
        {"type": "response.content_part.done", **at, "part": part},
        {"type": "response.output_item.done", "output_index": 0, "item": item},
        {"type": "response.completed", "response": response},
    ]


ANSWERS = {"chat": chat, "completions": completions, "responses": responses}


def asked(gw: Process, route: str, stream: bool, upstream: Any) -> httpx.Response:
    """A request of the redacting tenant on `route` whose upstream answers `upstream`."""
    if route != "completions":
        return ask(gw, route, stream, upstream, key="sk-redact")
    if stream:
        spec = {"behaviour": "written", "events": frames(upstream, named=False), "gap": 0}
    else:
        spec = {"behaviour": "garbage", "status": 200, "body": json.dumps(upstream), "content_type": "application/json"}
    body = {"model": "test-model", "prompt": "hi", "logprobs": 1, "stream": stream, "hostile": spec}
    return httpx.post(gw.url + "/v1/completions", json=body, headers=bearer("sk-redact"), timeout=30)


def logprob_lists(value: Any) -> Iterator[list[Any]]:
    """Every list of logprobs entries (or of completions' tokens) in a value, in document order."""
    if isinstance(value, dict):
        for key, child in value.items():
            if key == "logprobs" and isinstance(child, list):
                yield child
            elif key == "logprobs" and isinstance(child, dict):
                yield from (child[k] for k in ("content", "refusal", "tokens") if isinstance(child.get(k), list))
            else:
                yield from logprob_lists(child)
    elif isinstance(value, list):
        for child in value:
            yield from logprob_lists(child)


def reconstructed(values: list[Any]) -> tuple[str, str]:
    """What a client rebuilds from the logprobs it got, as one stream of entries: the tokens run together, and the
    bytes decoded and run together."""
    tokens, raw = [], bytearray()
    for found in (found for value in values for found in logprob_lists(value)):
        for entry in found:
            if isinstance(entry, str):
                tokens.append(entry)
            elif isinstance(entry, dict):
                tokens.append(str(entry.get("token", "")))
                raw += bytes(entry.get("bytes") or [])
    return "".join(tokens), raw.decode("utf-8", "replace")


# completions' logprobs carry no bytes
CASES = [(route, case) for route in ANSWERS for case in ("one_token", "split", "bytes_only") if route != "completions"]
CASES += [("completions", "one_token"), ("completions", "split")]


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
@pytest.mark.parametrize("route, case", CASES)
def test_a_key_spelled_by_the_logprobs_never_reaches_a_redacting_client(
    gw: Process, route: str, stream: bool, case: str
) -> None:
    response = asked(gw, route, stream, ANSWERS[route](stream, TEXT, case))
    values = received(response, stream)
    tokens, spelt = reconstructed(values)
    assert KEY not in tokens and KEY not in spelt and KEY not in readable(values), (tokens, spelt)
    assert_blocked(response, stream)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
@pytest.mark.parametrize("route", ["chat", "responses"])
def test_an_alternative_token_that_holds_a_key_blocks(gw: Process, route: str, stream: bool) -> None:
    """The key only as an alternative at each position, never in the text: read as an identifier, it blocks.
    (Completions' alternatives are objects' keys, read as identifiers with every key.)"""
    text = "Nothing to see here at all."
    upstream = ANSWERS[route](stream, text, "split")
    values = upstream if stream else [upstream]
    for found in (found for value in values for found in logprob_lists(value)):
        for entry in found:
            if isinstance(entry, dict):
                entry["top_logprobs"] = [{"token": KEY, "logprob": -9.0, "bytes": list(KEY.encode())}]
    assert_blocked(asked(gw, route, stream, upstream), stream)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
@pytest.mark.parametrize("route", list(ANSWERS))
def test_clean_logprobs_reach_the_client_as_sent(gw: Process, route: str, stream: bool) -> None:
    text = "Nothing to see here at all."
    upstream = ANSWERS[route](stream, text, "split")
    response = asked(gw, route, stream, upstream)
    assert response.status_code == 200, response.text
    sent = [value for value in (upstream if stream else [upstream]) if isinstance(value, dict)]
    assert reconstructed(received(response, stream)) == reconstructed(sent)
    assert text in reconstructed(sent)[0]
