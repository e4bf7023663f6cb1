"""Decode a request body as JSON within the operator's limits, before any stage walks the payload.

Every later stage (WAF, tokenize, guard) walks the payload, and the WAF does it before auth, so the shape of a body
bounds what an anonymous client can make the gateway spend. orjson decodes: strict UTF-8 (no lone surrogates), no
NaN or Infinity, numbers beyond 64 bits as floats and out-of-range ones refused (never Python's int-string
conversion limit as a crash), and its own recursion stops at 1024 levels. One iterative walk then checks depth,
the total count of values and every string's length, and stops at the first breach, so the walk is bounded too.

An object with the same key twice is refused: orjson keeps the last value, while a body that goes upstream as sent
meets parsers that keep the first (cJSON, simdjson's lookups, gjson) or refuse it (serde), so the guard and the WAF
would judge one value and the model read another.
"""

from __future__ import annotations

from typing import Any

import orjson

from gateway.config import LimitsConfig
from gateway.errors import GatewayError, invalid_request
from gateway.json_path import dotted

# orjson's own nesting cap (a constant of the library): deeper input fails to decode before our walk can see it.
DECODER_MAX_DEPTH = 1024


def decode(body: bytes, limits: LimitsConfig) -> Any:
    """The decoded body, or a 400: not JSON, nested beyond what the decoder itself takes, or an object with a key
    twice (fewer pairs decoded than keys sent)."""
    return decode_encoded(body, limits)[0]


def decode_encoded(body: bytes, limits: LimitsConfig) -> tuple[Any, bytes | None]:
    """`decode`'s payload and that payload encoded again (None where it nests deeper than orjson encodes): compact,
    every key it holds spelled `"key":` whatever escapes the body spelled it with, so a key is found in it by one
    search of its bytes (gateway/stages/parse.py, gateway/tenancy/references.py), where the body's own bytes need a
    second search for escapes."""
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        if "depth limit" in str(exc):
            raise _too_deep(limits.max_json_depth, None) from None
        raise invalid_request(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if type(payload) is not dict and type(payload) is not list:
        return payload, None
    try:
        encoded: bytes | None = orjson.dumps(payload)
    except orjson.JSONEncodeError:  # deeper than orjson's 254 levels
        encoded = None
    if _repeats_a_key(body, payload, encoded):
        raise invalid_request(
            "request body holds a JSON object with the same key twice: send each key once",
            code="duplicate_json_key",
        )
    return payload, encoded


def _repeats_a_key(body: bytes, payload: dict | list, encoded: bytes | None) -> bool:
    """Whether the body sent some object's key twice (orjson kept one of the pairs).

    Where the body has no \\u escape, every ':' in the decoded strings was one in the body, so the payload encoded
    again spells as many ':' as the body exactly when no pair was dropped (a dropped pair takes its key's ':' with
    it): one pass in C, where counting the decoded pairs walks every container in Python. Otherwise, or where the
    payload is nested deeper than orjson encodes, the pairs are counted against the keys the body spells."""
    colons = body.count(b":")
    if encoded is not None and body.find(b"\\u") < 0:
        return encoded.count(b":") != colons
    members = _members(payload)
    return colons != members and _keys_sent(body) != members


def _keys_sent(body: bytes) -> int:
    """How many keys a valid JSON body spells: its ':' outside strings. Escaped backslashes, then escaped quotes, are
    dropped (a run of backslashes starts an escape, so pairs from its left are whole escapes), which leaves every
    string's content between two quotes: the even pieces of a split on '"' are what lies outside strings."""
    unescaped = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    return b"".join(unescaped.split(b'"')[::2]).count(b":")


def _members(payload: dict | list) -> int:
    """How many key-value pairs the decoded objects hold, all levels (the walk is bounded by the decoder's depth and
    the body's size; the shape limits are checked after)."""
    count = 0
    stack: list[Any] = [payload]
    push = stack.append
    while stack:  # a plain loop: it runs on every request, and a generator per container costs twice the time
        node = stack.pop()
        if type(node) is dict:
            count += len(node)
            node = node.values()
        for child in node:
            if type(child) is dict or type(child) is list:
                push(child)
    return count


def within_limits_unwalked(body: bytes, limits: LimitsConfig) -> int:
    """For a body that cannot break a shape limit, an upper bound on its values (0: walk it with check_shape).

    Most requests are small: a body no longer than the string limit holds no longer string, one shorter than the
    value limit holds fewer values, one with fewer braces and brackets than the depth limit nests no deeper. Byte
    counts answer that in well under a microsecond for a chat request, where the walk takes ~10 µs. The bound: every
    value but the outermost is the first member of its array or object (one `[` or `{`) or follows a comma.
    """
    size = len(body)
    if size > limits.max_string_chars or size >= limits.max_json_values:
        return 0
    containers = body.count(b"{") + body.count(b"[")
    if containers > limits.max_json_depth:
        return 0
    return containers + body.count(b",") + 1


def check_shape(payload: dict | list, limits: LimitsConfig) -> int:
    """How many JSON values a decoded body holds; a 400 or 413 naming the first limit it breaks and its JSON path."""
    max_depth, max_values, max_chars = limits.max_json_depth, limits.max_json_values, limits.max_string_chars
    values = 1
    stack: list[tuple[tuple, Any]] = [((), payload)]  # containers only: scalars are checked where they are met
    while stack:
        loc, node = stack.pop()
        if len(loc) >= max_depth:
            raise _too_deep(max_depth, loc)
        values += len(node)
        if values > max_values:  # before looking at the members: the walk never goes past the limit
            raise GatewayError(
                413,
                f"request body holds more than {max_values} JSON values (limits.max_json_values)",
                code="too_many_json_values",
                param=_param(loc) or None,
            )
        items = node.items() if type(node) is dict else enumerate(node)
        for key, child in items:
            if type(key) is str and len(key) > max_chars:
                raise _string_too_long(loc, len(key), max_chars, "a key in ")
            kind = type(child)
            if kind is str:
                if len(child) > max_chars:
                    raise _string_too_long((*loc, key), len(child), max_chars)
            elif kind is dict or kind is list:
                stack.append(((*loc, key), child))
    return values


def array_too_long(param: str, length: int, limit: int, setting: str) -> GatewayError:
    """OpenAI's own wording and code for an array over its maximum length."""
    return invalid_request(
        f"Invalid '{param}': array too long. Expected an array with maximum length {limit}, but got "
        f"an array with length {length} instead ({setting}).",
        param=param,
        code="array_above_max_length",
    )


def _string_too_long(loc: tuple, length: int, limit: int, what: str = "") -> GatewayError:
    param = _param(loc)
    return invalid_request(
        f"Invalid {what}'{param}': string too long. Expected a string with maximum length {limit}, "
        f"but got a string with length {length} instead (limits.max_string_chars).",
        param=param or None,
        code="string_above_max_length",
    )


def _too_deep(limit: int, loc: tuple | None) -> GatewayError:
    param = _param(loc) if loc else None
    where = f"'{param}' is" if param else "request body is"
    return invalid_request(
        f"{where} nested deeper than {limit} levels (limits.max_json_depth)", param=param, code="json_too_deep"
    )


def _param(loc: tuple) -> str:
    """The JSON path as OpenAI writes it (`messages[3].content`), long keys cut short: errors never echo a body."""
    return dotted(tuple(k[:61] + "..." if isinstance(k, str) and len(k) > 64 else k for k in loc))
