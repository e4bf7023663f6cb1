"""Answer carriers probed the way a hostile upstream would, through the gateway and hostile upstream of
tests/hostile/test_output_inventory.py (tenant `block` blocks secrets, `redact` redacts them): fields and framings
its cases do not name. What is checked is what the client can read, joined as its reader joins it.
"""

from __future__ import annotations

import html
from typing import Any
from urllib.parse import unquote

import pytest

from tests.conftest import Process
from tests.hostile.test_output_inventory import (
    KEY,
    ask,
    assert_blocked,
    chat_answer,
    frames,
    gw,
    messages_answer,
    readable,
    received,
    responses_answer,
)

__all__ = ["gw"]  # the module's gateway, shared with the output inventory's fixture

TEXT = f"The key is {KEY}, keep it safe."


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_a_key_in_an_audio_transcript_or_glued_into_a_tool_name_is_read(gw: Process, stream: bool) -> None:
    """A tool's name is an identifier: a key glued into it (`f_AKIA…`) is still the key to the client."""
    for field in ("audio", "tool_name"):
        if field == "audio":
            audio = {"id": "audio_1", "data": "", "expires_at": 0, "transcript": TEXT}
            upstream = chat_answer(stream, "Here it is.", audio=audio if not stream else {"transcript": TEXT})
        else:
            upstream = chat_answer(stream, None, arguments="{}")
            if stream:
                upstream[1]["choices"][0]["delta"]["tool_calls"][0]["function"]["name"] = f"f_{KEY}"
            else:
                upstream["choices"][0]["message"]["tool_calls"][0]["function"]["name"] = f"f_{KEY}"
        assert_blocked(ask(gw, "chat", stream, upstream), stream)


def spec_with_between(route: str, events: list[Any], between: str) -> dict[str, Any]:
    """A stream whose every event is followed by `between` (a comment, a ping, an event of no known type)."""
    written = frames(events, named=route != "chat")
    return {"behaviour": "written", "events": [f for e in written for f in (e, between)], "gap": 0}


BETWEEN = {
    "chat": [": ping\n\n", 'data: {"id": "c1", "object": "chat.completion.chunk", "choices": []}\n\n'],
    "messages": ['event: ping\ndata: {"type": "ping"}\n\n', ": keep-alive\n\n"],
}


@pytest.mark.parametrize("route, between", [(route, between) for route, lines in BETWEEN.items() for between in lines])
def test_a_key_split_across_deltas_with_other_events_between_is_read(gw: Process, route: str, between: str) -> None:
    events = chat_answer(True, TEXT) if route == "chat" else messages_answer(True, TEXT)
    assert_blocked(ask(gw, route, True, events, spec=spec_with_between(route, events, between)), stream=True)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
@pytest.mark.parametrize("route", ["chat", "messages"])
def test_a_key_in_a_json_key_of_an_answer_is_read(gw: Process, route: str, stream: bool) -> None:
    """A field's name is text its client reads (and logs): a server-added field named with a key, its value a
    number, is read as an identifier is, and blocks."""
    named = {f"note_{KEY}": 1}
    if route == "chat":
        upstream = chat_answer(stream, "Here it is.", **named)
    else:
        upstream = messages_answer(stream, "Here it is.")
        if stream:
            upstream[2]["delta"].update(named)
        else:
            upstream["content"][0].update(named)
    for key in ("sk-block", "sk-redact"):
        assert_blocked(ask(gw, route, stream, upstream, key=key), stream)


ENCODED = {
    "character references": "".join(f"&#{ord(c)};" for c in KEY[:6]) + KEY[6:],
    "percent-escapes": "".join(f"%{ord(c):02X}" for c in KEY[:8]) + KEY[8:],
    "string escapes": "\\u0041\\x4b" + KEY[2:],
}


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
@pytest.mark.parametrize("route", ["chat", "messages"])
@pytest.mark.parametrize("encoding", ENCODED)
def test_a_key_in_escapes_its_reader_undoes_is_blocked(gw: Process, route: str, stream: bool, encoding: str) -> None:
    """An answer a browser renders or a program unescapes: `&#65;KIA…`, `%41KIA…`, `\\u0041KIA…` are the key to
    its reader."""
    text = f"The key is {ENCODED[encoding]}, keep it safe."
    upstream = chat_answer(stream, text) if route == "chat" else messages_answer(stream, text)
    response = ask(gw, route, stream, upstream)
    seen = readable(received(response, stream))
    assert all(KEY not in view for view in (html.unescape(seen), unquote(seen), seen.replace("\\x4b", "K")))
    assert_blocked(response, stream)


def split_answer(route: str) -> tuple[Any, Any]:
    """A whole answer with TEXT split across two parts in a row, and how to read the parts back from what the
    client got."""
    halves = [TEXT[:18], TEXT[18:]]
    if route == "messages":
        upstream = messages_answer(False, "x")
        upstream["content"] = [{"type": "text", "text": half} for half in halves]
        return upstream, lambda body: [block["text"] for block in body["content"]]
    message = {
        "type": "message",
        "id": "msg_1",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": half, "annotations": []} for half in halves],
    }
    return responses_answer(False, item=message), lambda body: [p["text"] for p in body["output"][0]["content"]]


@pytest.mark.parametrize("key", ["sk-block", "sk-redact"])
@pytest.mark.parametrize("route", ["messages", "responses"])
def test_a_key_split_across_parts_in_a_row_of_a_whole_answer_is_read(gw: Process, route: str, key: str) -> None:
    """A client reads a message's text blocks (a Response message's output_text parts) one after another: a key
    split across two is whole to it."""
    upstream, parts = split_answer(route)
    response = ask(gw, route, False, upstream, key=key)
    if key == "sk-block":
        assert_blocked(response, stream=False)
        return
    assert response.status_code == 200, response.text
    joined = "".join(parts(response.json()))
    assert KEY not in joined and "[REDACTED:AWS_ACCESS_KEY]" in joined, joined
