"""What an answer's logprobs spell, read as a client reconstructs text from them.

A client that asked for logprobs gets each generated token again beside the answer's text: chat's
`logprobs.content[]` and `logprobs.refusal[]` entries (`token`, and `bytes`: the token's UTF-8 bytes as numbers),
completions' `logprobs.tokens`, a Responses output_text part's `logprobs` (and its `.delta` and `.done` events'), each
entry with its `top_logprobs` alternatives. A client joins a choice's tokens, or decodes its bytes, to get the text
back, so a secret split across tokens, or written only in bytes, is as readable there as in the answer.

`spelled()` gives what a logprobs value spells: its tokens run together, and its bytes decoded as UTF-8 and run
together, each on a `Logprobs` channel (a stream's deltas run together across events, as the client joins them), and
each alternative (a token, and its bytes decoded) as an identifier-like string, read once: a key spelled by
alternatives at successive positions is unlikely, but an alternative may hold one whole. It marks the tokens' places
known, so the untrusted walk (gateway/apis/untrusted.py) does not read them a second time.

A logprobs entry cannot be rewritten consistently with its figures and its neighbours, so the output guard never
redacts a `Logprobs` channel: a finding in one blocks (gateway/guard/output.py).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from typing import Any

from gateway.apis.untrusted import Identifier, Place, Untrusted

ENTRY_LISTS = ("content", "refusal")  # a chat choice's logprobs: one list per text


@dataclass(frozen=True, slots=True)
class Logprobs(Untrusted):
    """A channel of what a text's logprobs spell (`path` ends in `tokens` or `bytes`): read, never rewritten."""


def spelled(kind: str, where: str, value: Any, known: set[Place]) -> Iterator[tuple[Hashable, str]]:
    """(channel, text) of what the logprobs `value` at `where` spells (see the module's docstring), in an event of
    type `kind` ("" for a chat or completions event and a whole answer); the tokens' places are added to `known`."""
    if isinstance(value, list):
        yield from _entries(kind, where, value, known)
    elif isinstance(value, dict):
        for name in ENTRY_LISTS:
            if isinstance(value.get(name), list):
                yield from _entries(kind, f"{where}.{name}", value[name], known)
        tokens = value.get("tokens")  # completions: the tokens alone (its alternatives are objects' keys: identifiers)
        if isinstance(tokens, list):
            strings = [(i, token) for i, token in enumerate(tokens) if isinstance(token, str)]
            known.update((id(tokens), i) for i, _ in strings)
            if strings:
                yield Logprobs(kind, f"{where}.tokens"), "".join(token for _, token in strings)


def _entries(kind: str, where: str, entries: list[Any], known: set[Place]) -> Iterator[tuple[Hashable, str]]:
    """A list of logprobs entries ({token, bytes, top_logprobs}): their tokens and bytes, and their alternatives."""
    tokens: list[str] = []
    raw = bytearray()
    alternatives = Identifier(kind, f"{where} top_logprobs")
    for entry in entries:
        if not isinstance(entry, dict):
            continue
        if isinstance(entry.get("token"), str):
            tokens.append(entry["token"])
            known.add((id(entry), "token"))
        raw += _bytes(entry.get("bytes"))
        found = entry.get("top_logprobs")
        for alternative in found if isinstance(found, list) else ():
            if not isinstance(alternative, dict):
                continue
            if isinstance(alternative.get("token"), str):
                known.add((id(alternative), "token"))
                yield alternatives, alternative["token"]
            if spelt := _bytes(alternative.get("bytes")):
                yield alternatives, spelt.decode("utf-8", "replace")
    if tokens:
        yield Logprobs(kind, f"{where} tokens"), "".join(tokens)
    if raw:
        yield Logprobs(kind, f"{where} bytes"), raw.decode("utf-8", "replace")


def _bytes(value: Any) -> bytes:
    """A token's `bytes` as the bytes they are; none where it is not a list of byte values."""
    if not isinstance(value, list) or not all(type(b) is int and 0 <= b < 256 for b in value):
        return b""
    return bytes(value)
