"""Secrets an upstream hides in its answer from the output guard, through a real gateway on every answer route.

The hostile upstream answers what each test gives it, as a chat, Responses or Messages answer (streamed or whole):
a key written as JSON `\\u` escapes in a tool call's arguments (the client's `json.loads` turns it back into the
key), joined by a zero-width character, or in base64, in the answer's text or in its arguments; a Responses
`.done` event whose text is not what its clean deltas said; an event type or field no table names. Each is
relayed to a Messages client both from an Anthropic pool (as sent) and from a chat pool (translated).

What is checked is what the client can read: every string of every event it got, with JSON escapes decoded and
invisible characters removed, holds neither the key nor its base64; a tenant that blocks secrets gets the stream
ended by an explicit error event naming the guard's rule (a whole answer: a 502), and one that redacts them gets
arguments that are still valid JSON with the placeholder where the key was.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import Launcher, Process, pool
from tests.hostile.conftest import start_hostile_upstream
from tests.integration.test_guard_gateway import bearer, guard_policy, keys

KEY = "AKIAIOSFODNN7EXAMPLE"
ESCAPED = "\\u0041\\u004B\\u0049\\u0041IOSFODNN7EXAMPLE"  # as JSON text: each of the first four letters escaped
ZERO_WIDTH = "AKIA\u200dIOSFODNN7EXAMPLE"
BASE64 = base64.b64encode(KEY.encode()).decode()
CLAUDE = "claude-test"
ROUTES = ("chat", "responses", "messages", "translated")  # translated: a Messages client of a chat pool


@pytest.fixture(scope="module")
def gw(module_launcher: Launcher) -> Process:
    """One gateway for the module, in front of one hostile upstream as a chat pool and as an Anthropic pool; the
    tenant `block` has secrets blocked (the default), `redact` has them and PII redacted."""
    upstream = start_hostile_upstream(module_launcher)
    output = {"enabled": True, "secrets": "block", "hold_back": 16, "scan_every": 8}
    policies = guard_policy(
        module_launcher.directory / "output-inventory",
        {"enabled": True, "injection": {"enabled": False}, "output": output},
        {"redact": {"output": {"secrets": "redact", "pii": "redact"}}},
    )
    pools = [
        pool("chat", upstream.url, models=["test-model"]),
        pool("claude", upstream.url, models=[CLAUDE], api="anthropic"),
    ]
    return module_launcher.gateway(
        {"pools": pools, "policy_dir": policies, "auth": keys(block="sk-block", redact="sk-redact")}
    )


# ---- the answers the upstream gives -------------------------------------------------------------------------------


def pieces(text: str, size: int = 5) -> list[str]:
    """Text as a stream sends it: an escape sequence is cut in two as often as not."""
    return [text[i : i + size] for i in range(0, len(text), size)]


def chat_answer(stream: bool, content: str | None = None, arguments: str | None = None, **extra: Any) -> Any:
    """A chat answer with `content` or a tool call with these `arguments`; `extra` fields in its delta/message."""
    if not stream:
        message: dict[str, Any] = {"role": "assistant", "content": content, **extra}
        if arguments is not None:
            message["tool_calls"] = [
                {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": arguments}}
            ]
        return {
            "id": "c1",
            "object": "chat.completion",
            "model": "test-model",
            "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
        }
    deltas: list[dict[str, Any]] = [{"role": "assistant", **extra}]
    if content is not None:
        deltas += [{"content": piece} for piece in pieces(content)]
    if arguments is not None:
        start = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": ""}}
        deltas.append({"tool_calls": [start]})
        deltas += [{"tool_calls": [{"index": 0, "function": {"arguments": p}}]} for p in pieces(arguments)]
    chunks = [{"id": "c1", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": d}]} for d in deltas]
    chunks.append(
        {"id": "c1", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
    )
    return [*chunks, "[DONE]"]


def responses_answer(
    stream: bool,
    content: str | None = None,
    arguments: str | None = None,
    *,
    done: str | None = None,
    item: dict | None = None,
    unknown: list[dict] | None = None,
) -> Any:
    """A Response with a message of `content` or a function call of `arguments`; `done`: the text its `.done` event
    (and the item's and response's copies) say instead; `item`: an output item of its own; `unknown`: events of
    their own before the end."""
    if arguments is not None:
        whole = {
            "type": "function_call",
            "id": "fc_1",
            "call_id": "call_1",
            "name": "f",
            "status": "completed",
            "arguments": done if done is not None else arguments,
        }
    else:
        text = done if done is not None else content
        whole = {
            "type": "message",
            "id": "msg_1",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": []}],
        }
    output = [item] if item is not None else [whole]
    response = {
        "id": "resp_1",
        "object": "response",
        "status": "completed",
        "model": "test-model",
        "output": output,
        "usage": {"input_tokens": 1, "output_tokens": 1, "total_tokens": 2},
    }
    if not stream:
        return response
    events: list[dict[str, Any]] = [
        {"type": "response.created", "response": {**response, "status": "in_progress", "output": []}}
    ]
    if item is None and arguments is not None:
        events.append({"type": "response.output_item.added", "output_index": 0, "item": {**whole, "arguments": ""}})
        events += [
            {"type": "response.function_call_arguments.delta", "item_id": "fc_1", "output_index": 0, "delta": p}
            for p in pieces(arguments)
        ]
        events.append(
            {
                "type": "response.function_call_arguments.done",
                "item_id": "fc_1",
                "output_index": 0,
                "arguments": whole["arguments"],
            }
        )
    elif item is None:
        events.append({"type": "response.output_item.added", "output_index": 0, "item": {**whole, "content": []}})
        part = {"type": "output_text", "text": "", "annotations": []}
        events.append(
            {
                "type": "response.content_part.added",
                "item_id": "msg_1",
                "output_index": 0,
                "content_index": 0,
                "part": part,
            }
        )
        events += [
            {
                "type": "response.output_text.delta",
                "item_id": "msg_1",
                "output_index": 0,
                "content_index": 0,
                "delta": p,
            }
            for p in pieces(content or "")
        ]
        events.append(
            {
                "type": "response.output_text.done",
                "item_id": "msg_1",
                "output_index": 0,
                "content_index": 0,
                "text": text,
            }
        )
        events.append(
            {
                "type": "response.content_part.done",
                "item_id": "msg_1",
                "output_index": 0,
                "content_index": 0,
                "part": whole["content"][0],
            }
        )
    events += unknown or []
    if item is None:
        events.append({"type": "response.output_item.done", "output_index": 0, "item": whole})
    events.append({"type": "response.completed", "response": response})
    return events


def messages_answer(
    stream: bool, content: str | None = None, arguments: str | None = None, *, block: dict | None = None
) -> Any:
    """A Message with a text block of `content` or a tool_use block whose input streams as `arguments`; `block`: a
    content block of its own (a whole answer) or the delta of one (a stream)."""
    usage = {"input_tokens": 1, "output_tokens": 1}
    message = {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": CLAUDE,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": usage,
    }
    if not stream:
        if block is not None:
            content_blocks = [block]
        elif arguments is not None:
            content_blocks = [{"type": "tool_use", "id": "toolu_1", "name": "f", "input": json.loads(arguments)}]
        else:
            content_blocks = [{"type": "text", "text": content}]
        return {**message, "content": content_blocks, "stop_reason": "end_turn"}
    if block is not None:
        start, deltas = {"type": "text", "text": ""}, [block]
    elif arguments is not None:
        start = {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}
        deltas = [{"type": "input_json_delta", "partial_json": p} for p in pieces(arguments)]
    else:
        start, deltas = {"type": "text", "text": ""}, [{"type": "text_delta", "text": p} for p in pieces(content or "")]
    return [
        {"type": "message_start", "message": message},
        {"type": "content_block_start", "index": 0, "content_block": start},
        *({"type": "content_block_delta", "index": 0, "delta": d} for d in deltas),
        {"type": "content_block_stop", "index": 0},
        {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None}, "usage": usage},
        {"type": "message_stop"},
    ]


def answer(route: str, stream: bool, content: str | None = None, arguments: str | None = None) -> Any:
    """The upstream's answer on `route` with this content or these arguments."""
    if route == "responses":
        return responses_answer(stream, content, arguments)
    if route == "messages":
        return messages_answer(stream, content, arguments)
    return chat_answer(stream, content, arguments)


# ---- asking, and what the client read ------------------------------------------------------------------------


def frames(events: list[Any], named: bool) -> list[str]:
    """A stream's events as the upstream writes them: an object as an event's data (named by its `type` where the
    route's events are named), a string as the data it is (`[DONE]`)."""
    out = []
    for event in events:
        data = event if isinstance(event, str) else json.dumps(event)
        name = f"event: {event['type']}\n" if named and isinstance(event, dict) else ""
        out.append(f"{name}data: {data}\n\n")
    return out


def ask(
    gw: Process, route: str, stream: bool, upstream: Any, key: str = "sk-block", spec: dict | None = None
) -> httpx.Response:
    """A request on `route` whose upstream answers `upstream` (an event list for a stream, else a body), or as the
    hostile upstream's `spec` says."""
    if spec is None and stream:
        spec = {"behaviour": "written", "events": frames(upstream, named=route in ("responses", "messages")), "gap": 0}
    elif spec is None:
        spec = {"behaviour": "garbage", "status": 200, "body": json.dumps(upstream), "content_type": "application/json"}
    if route == "chat":
        path, body = "/v1/chat/completions", {"model": "test-model", "messages": [{"role": "user", "content": "hi"}]}
    elif route == "responses":
        path, body = "/v1/responses", {"model": "test-model", "input": "hi"}
    else:
        path = "/v1/messages"
        body = {
            "model": CLAUDE if route == "messages" else "test-model",
            "max_tokens": 64,
            "messages": [{"role": "user", "content": "hi"}],
        }
    if route == "translated":
        body["metadata"] = {"user_id": json.dumps(spec)}  # the translation keeps no `hostile`
    else:
        body["hostile"] = spec
    return httpx.post(gw.url + path, json={**body, "stream": stream}, headers=bearer(key), timeout=30)


def received(response: httpx.Response, stream: bool) -> list[Any]:
    """The JSON values the client got: each event's data, or the body."""
    if not stream:
        return [response.json()]
    data = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    return [json.loads(d) for d in data if d != "[DONE]"]


def strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for child in value.values():
            yield from strings(child)
    elif isinstance(value, list):
        for child in value:
            yield from strings(child)


_ESCAPE = re.compile(r"\\u([0-9a-fA-F]{4})")
_INVISIBLE = re.compile("[\u200b-\u200f\u2060-\u2064\ufeff]")


def readable(values: list[Any]) -> str:
    """Every string the client got, run together per place as its parser reads them (JSON escapes decoded, the
    invisible characters gone)."""
    text = "\n".join(s for value in values for s in strings(value))
    return _INVISIBLE.sub("", _ESCAPE.sub(lambda m: chr(int(m.group(1), 16)), text))


def assert_blocked(response: httpx.Response, stream: bool) -> None:
    """The answer reached the client without the key, and ended in an explicit refusal."""
    values = received(response, stream)
    seen = readable(values)
    assert KEY not in seen and BASE64 not in seen, seen
    if stream:
        assert response.status_code == 200
        assert "guard.output.secret" in json.dumps(values[-1]), response.text
    else:
        assert response.status_code == 502 and "guard.output.secret" in response.text, response.text


# ---- the walk-arounds -----------------------------------------------------------------------------------------

CASES = {
    "escaped key in arguments": {"arguments": f'{{"key": "{ESCAPED}"}}'},
    "zero-width joined key in arguments": {"arguments": json.dumps({"note": f"use {ZERO_WIDTH} now"})},
    "base64 key in arguments": {"arguments": json.dumps({"note": BASE64})},
    "zero-width joined key in text": {"content": f"The key is {ZERO_WIDTH}, keep it safe."},
    "base64 key in text": {"content": f"The key is {BASE64} in base64."},
}


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("case", CASES)
def test_a_key_written_so_its_reader_decodes_it_is_blocked(gw: Process, route: str, stream: bool, case: str) -> None:
    assert_blocked(ask(gw, route, stream, answer(route, stream, **CASES[case])), stream)


def arguments_read(route: str, stream: bool, values: list[Any]) -> list[str]:
    """The tool call's arguments as the client reads them, from each place that carries them whole."""
    if not stream:
        body = values[0]
        if route == "chat":
            return [body["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]]
        if route == "responses":
            return [body["output"][0]["arguments"]]
        return [json.dumps(body["content"][0]["input"])]
    if route == "chat":
        calls = [c for v in values for ch in v.get("choices", []) for c in ch["delta"].get("tool_calls") or []]
        return ["".join(c["function"].get("arguments") or "" for c in calls)]
    if route == "responses":
        deltas = "".join(v["delta"] for v in values if v["type"] == "response.function_call_arguments.delta")
        done = next(v["arguments"] for v in values if v["type"] == "response.function_call_arguments.done")
        final = next(v["response"]["output"][0]["arguments"] for v in values if v["type"] == "response.completed")
        return [deltas, done, final]
    return ["".join(v["delta"]["partial_json"] for v in values if v.get("delta", {}).get("type") == "input_json_delta")]


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
@pytest.mark.parametrize("route", ROUTES)
def test_a_redacted_escaped_key_leaves_the_arguments_valid_json(gw: Process, route: str, stream: bool) -> None:
    arguments = f'{{"key": "{ESCAPED}", "region": "us-east-1"}}'
    response = ask(gw, route, stream, answer(route, stream, arguments=arguments), key="sk-redact")
    assert response.status_code == 200, response.text
    values = received(response, stream)
    for read in arguments_read(route, stream, values):
        assert json.loads(read) == {"key": "[REDACTED:AWS_ACCESS_KEY]", "region": "us-east-1"}, read
    assert KEY not in readable(values)


@pytest.mark.parametrize("where", ["text", "arguments"])
def test_a_done_event_that_differs_from_its_clean_deltas_is_read_whole(gw: Process, where: str) -> None:
    """Clean deltas, then a `.done` (and the item's and response's copies) carrying the key as plain text."""
    if where == "text":
        upstream = responses_answer(True, "The key is in the vault.", done=f"The key is {KEY}.")
    else:
        upstream = responses_answer(True, arguments='{"key": "in the vault"}', done=json.dumps({"key": KEY}))
    assert_blocked(ask(gw, "responses", True, upstream), stream=True)
    redacted = received(ask(gw, "responses", True, upstream, key="sk-redact"), stream=True)
    assert KEY not in readable(redacted) and "[REDACTED:AWS_ACCESS_KEY]" in readable(redacted)
    assert redacted[-1]["type"] == "response.completed"


UNKNOWN = {
    "chat": lambda stream: chat_answer(stream, "Here it is.", hologram=f"key {KEY}"),
    "responses": lambda stream: responses_answer(
        stream,
        "Here it is.",
        item={"type": "hologram", "id": "h_1", "transcript": f"key {KEY}"},
        unknown=[{"type": "response.hologram.delta", "output_index": 0, "delta": p} for p in pieces(f"key {KEY}")],
    ),
    "messages": lambda stream: messages_answer(
        stream, block={"type": "hologram" if not stream else "hologram_delta", "hologram": f"key {KEY}"}
    ),
}


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
@pytest.mark.parametrize("route", UNKNOWN)
def test_an_event_type_or_field_no_table_names_is_read_not_skipped(gw: Process, route: str, stream: bool) -> None:
    assert_blocked(ask(gw, route, stream, UNKNOWN[route](stream)), stream)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
@pytest.mark.parametrize("route", ROUTES)
def test_clean_answers_pass_unchanged(gw: Process, route: str, stream: bool) -> None:
    """The same shapes without a key: every event reaches the client, none refused or rewritten."""
    upstream = answer(route, stream, arguments=json.dumps({"city": "Paris", "note": "\u00e9t\u00e9 \u2014 ok"}))
    response = ask(gw, route, stream, upstream)
    assert response.status_code == 200, response.text
    values = received(response, stream)
    assert "guard.output" not in response.text
    for read in arguments_read(route, stream, values):
        assert json.loads(read) == {"city": "Paris", "note": "\u00e9t\u00e9 \u2014 ok"}


@pytest.mark.parametrize(
    "route, line",
    [("chat", f"event: key {KEY}")]  # a typed stream's event of another name ends the stream unrelayed
    + [(route, line) for route in ("chat", "responses", "messages") for line in (f": key {KEY}", f"id: {KEY}")],
)
def test_an_events_lines_other_than_its_data_are_read(gw: Process, route: str, line: str) -> None:
    """A comment, an id, a chat event's name: bytes the client gets, read as text."""
    upstream = answer(route, True, content="Here it is.")
    frames = [
        f"data: {e}" if isinstance(e, str) else f"event: {e.get('type')}\ndata: {json.dumps(e)}" for e in upstream
    ]
    frames[1] = f"{line}\n{frames[1]}"
    spec = {
        "behaviour": "garbage",
        "status": 200,
        "body": "\n\n".join(frames) + "\n\n",
        "content_type": "text/event-stream",
    }
    assert_blocked(ask(gw, route, True, upstream, spec=spec), stream=True)


def with_identifier(route: str, stream: bool, value: str) -> Any:
    """A clean answer whose id (a chat chunk's, a Response item's, a Message's) is `value`."""
    upstream = answer(route, stream, content="Here it is.")
    if not stream:
        return {**upstream, "id": value}
    for event in upstream:
        if isinstance(event, dict) and route == "chat":
            event["id"] = value
        elif isinstance(event, dict) and "item_id" in event:
            event["item_id"] = value
        elif isinstance(event, dict) and event["type"] == "message_start":
            event["message"]["id"] = value
    return upstream


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
@pytest.mark.parametrize("route", ["chat", "responses", "messages"])
def test_a_key_in_an_identifier_is_blocked(gw: Process, route: str, stream: bool) -> None:
    """Ids are read too (once per value, for secrets): a redaction would break what refers to them, so a key in one
    blocks even where the policy redacts."""
    for key in ("sk-block", "sk-redact"):
        assert_blocked(ask(gw, route, stream, with_identifier(route, stream, f"id-{KEY}"), key=key), stream)
    clean = ask(gw, route, stream, with_identifier(route, stream, "id-bob@example.org-0042"), key="sk-redact")
    assert clean.status_code == 200 and "id-bob@example.org-0042" in clean.text, "an id is not searched for PII"
