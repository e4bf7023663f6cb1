"""Fake hosted-provider upstreams for gateway tests: Anthropic's Messages API and OpenAI's Responses API (and the
OpenAI chat completions a Messages request is translated into), run as a real process on a loopback port.

A fake because the real APIs cannot be reached from here. The shapes follow the public references:
docs.anthropic.com "Messages" API reference, "Streaming Messages" guide (message_start, content_block_start, ping,
content_block_delta text_delta, content_block_stop, message_delta with stop_reason and usage, message_stop; the
`error` event) and "Errors" page (`{"type": "error", "error": {"type", "message"}}`, 429 rate_limit_error, 529
overloaded_error), "Token counting" (`POST /v1/messages/count_tokens` -> `{"input_tokens": n}`); and
platform.openai.com's Responses API reference and its streaming events (response.created, response.in_progress,
response.output_item.added, response.content_part.added, response.output_text.delta, response.output_text.done,
response.content_part.done, response.output_item.done, response.completed). Recorded examples of the Anthropic
shapes are in tests/api_reference/.

What it answers is the test's choice: the text of the last user message, or `fake.reply` where the body has a `fake`
object (`{"reply": "...", "chunk": 6, "delay": 0.002, "status": 529, "error_after": 2, "cache_read": 100,
"cache_creation": 20}`); streams send the text in pieces of `chunk` characters, `delay` seconds apart. With
`fake.reasoning`, the model reasons before it answers, in each API's shape: chat's `reasoning_content` (or the field
`fake.reasoning_field` names: newer vLLM says `reasoning`), a Messages thinking block, a Responses reasoning item
with a summary; streamed in pieces like the answer. With `fake.tool_call` (`{"name": "...", "arguments": "<JSON
text>"}`), the model calls a tool after its text: chat's `tool_calls` (arguments in `function.arguments` fragments
when streamed), a Messages tool_use block (`input`, or input_json_delta fragments), a Responses function_call item
(function_call_arguments deltas). `fake.tool_call.type` picks another kind of call where the API has one: a Messages
`server_tool_use` or `mcp_tool_use` block (a tool Anthropic runs, streamed as tool_use is), a Responses
`custom_tool_call` item (its `input` is the arguments text as free text, in custom_tool_call_input deltas), an
`mcp_call` item (its `arguments`, in mcp_call_arguments deltas), a `code_interpreter_call` item (its `code` is the
arguments text, in code_interpreter_call_code deltas), or a call that runs a command, the arguments text being the
command: a `shell_call` item (its one command, in shell_call_command events), an `apply_patch_call` item (the diff of
the file it creates, in apply_patch_call_operation_diff deltas), a `local_shell_call` item (`bash -lc` the command) or
a `computer_call` item (a `type` action's `text`), both not streamed: added whole, as OpenAI's streams add them.
`fake.tool_stream` streams chat's calls as some OpenAI-compatible servers do (`{"repeat": n, "unindexed": true,
"interrupt": "text"}`: the call made n times, each with its own id; fragments without `index`; text sent as `content`
between the call's first two argument pieces). With `fake.refusal`, a chat or Responses model refuses instead of
answering: chat's `refusal`, a Responses `refusal` content part (refusal deltas). With `fake.cut_after: n`, a
Responses stream ends after its first n events, as a broken connection does. A Messages request translated to
chat keeps no member it does not translate, so there the `fake` object rides as JSON in `metadata.user_id`, which
reaches chat as `user`. Like the providers, it refuses a request without its key (`--api-key`, given once or more:
`x-api-key` on the Anthropic routes, `Authorization: Bearer` on the OpenAI ones). It keeps OpenAI's Files, stored
Responses, Containers, Batches, fine-tuning jobs and the models they make (below) per key, as the provider keeps them
per organization; a fine-tuned model is callable (chat, Responses, embeddings) by its organization only; any other
`/v1/` path is OpenAI's 404.
`GET /_received` returns every request it got (path, headers, body), for assertions on the upstream side of the wire.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import functools
import json
import operator
import time
import uuid
from collections.abc import AsyncIterator, Callable
from email.parser import BytesParser
from email.policy import HTTP
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

# docs.anthropic.com "Errors": the error type each status carries
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}


def input_tokens(body: dict[str, Any]) -> int:
    """What this fake counts a prompt as (characters over four, as a rough tokenizer would)."""
    return 1 + len(json.dumps([body.get("system"), body.get("messages"), body.get("input")])) // 4


def reasoning_text(body: dict[str, Any]) -> str:
    """What the model reasons before its answer, where the test asked for reasoning (`fake.reasoning`)."""
    reasoning = (body.get("fake") or {}).get("reasoning")
    return reasoning if isinstance(reasoning, str) else ""


def tool_call(body: dict[str, Any]) -> dict[str, str] | None:
    """The tool call the model makes after its text, where the test asked for one (`fake.tool_call`): its name and
    its arguments, as the JSON text chat carries them in."""
    call = (body.get("fake") or {}).get("tool_call")
    return {"name": str(call["name"]), "arguments": str(call["arguments"])} if isinstance(call, dict) else None


def tool_kind(body: dict[str, Any], default: str) -> str:
    """The kind of the tool call the test asked for (`fake.tool_call.type`), `default` (the API's plain call) if it
    named none."""
    call = (body.get("fake") or {}).get("tool_call")
    return str(call.get("type", default)) if isinstance(call, dict) else default


def refusal_text(body: dict[str, Any]) -> str:
    """What a model refuses with instead of answering, where the test asked for a refusal (`fake.refusal`)."""
    refusal = (body.get("fake") or {}).get("refusal")
    return refusal if isinstance(refusal, str) else ""


def reply_text(body: dict[str, Any]) -> str:
    """The answer a test asked for: `fake.reply`, else the last user message's text (any API's shape)."""
    fake = body.get("fake") or {}
    if isinstance(fake.get("reply"), str):
        return fake["reply"]
    items = body.get("input")
    if isinstance(items, str):
        return items
    turns = body.get("messages", items)
    for turn in reversed(turns if isinstance(turns, list) else []):
        if isinstance(turn, dict) and turn.get("role") == "user":
            content = turn.get("content")
            if isinstance(content, str):
                return content
            return "".join(p.get("text", "") for p in content or () if isinstance(p, dict))
    return "ok"


def sse(kind: str | None, data: dict[str, Any]) -> str:
    head = f"event: {kind}\n" if kind else ""
    return f"{head}data: {json.dumps(data)}\n\n"


def pieces(body: dict[str, Any], text: str) -> list[str]:
    size = int((body.get("fake") or {}).get("chunk", 6))
    return [text[i : i + size] for i in range(0, len(text), size)] or [""]


async def pause(body: dict[str, Any]) -> None:
    await asyncio.sleep(float((body.get("fake") or {}).get("delay", 0.002)))


# ---- Anthropic Messages ---------------------------------------------------------------------------------------


def anthropic_error(status: int, message: str) -> JSONResponse:
    kind = ANTHROPIC_ERROR_TYPES.get(status, "api_error")
    body = {"type": "error", "error": {"type": kind, "message": message}, "request_id": f"req_{uuid.uuid4().hex}"}
    headers = {"retry-after": "7"} if status == 429 else None
    return JSONResponse(body, status_code=status, headers=headers)


def message_usage(body: dict[str, Any], output: int) -> dict[str, int]:
    fake = body.get("fake") or {}
    return {
        "input_tokens": input_tokens(body),
        "cache_creation_input_tokens": int(fake.get("cache_creation", 0)),
        "cache_read_input_tokens": int(fake.get("cache_read", 0)),
        "output_tokens": output,
    }


def message(body: dict[str, Any], text: str, content: list[dict[str, Any]], stop: str | None) -> dict[str, Any]:
    return {
        "id": f"msg_{uuid.uuid4().hex[:24]}",
        "type": "message",
        "role": "assistant",
        "content": content,
        "model": body.get("model"),
        "stop_reason": stop,
        "stop_sequence": None,
        "usage": message_usage(body, len(text.split()) if stop else 1),
    }


FAKE_SIGNATURE = "ZmFrZS1zaWduYXR1cmU="  # a thinking block's signature: opaque to the client


def message_content(body: dict[str, Any], text: str) -> list[dict[str, Any]]:
    """A whole message's blocks: thinking first where the test asked for reasoning, then the text, then the tool
    call where it asked for one."""
    thinking = reasoning_text(body)
    head = [{"type": "thinking", "thinking": thinking, "signature": FAKE_SIGNATURE}] if thinking else []
    call = tool_call(body)
    tail = [tool_use(body, call, json.loads(call["arguments"]))] if call else []
    return [*head, {"type": "text", "text": text}, *tail]


def tool_use(body: dict[str, Any], call: dict[str, str], arguments: Any) -> dict[str, Any]:
    """The block of a call: tool_use, or server_tool_use where the test asked for a tool Anthropic runs."""
    return {"type": tool_kind(body, "tool_use"), "id": "toolu_fake", "name": call["name"], "input": arguments}


def stop_reason(body: dict[str, Any]) -> str:
    """tool_use where the client is to run the call; a server tool is Anthropic's to run, so the turn just ends."""
    return "tool_use" if tool_call(body) and tool_kind(body, "tool_use") == "tool_use" else "end_turn"


async def message_events(body: dict[str, Any], text: str) -> AsyncIterator[str]:
    fake = body.get("fake") or {}
    parts = pieces(body, text)
    yield sse("message_start", {"type": "message_start", "message": message(body, text, [], None)})
    index = 0
    if thinking := reasoning_text(body):
        block = {"type": "thinking", "thinking": "", "signature": ""}
        yield sse("content_block_start", {"type": "content_block_start", "index": 0, "content_block": block})
        for part in pieces(body, thinking):
            delta = {"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": part}}
            yield sse("content_block_delta", delta)
            await pause(body)
        signature = {"type": "signature_delta", "signature": FAKE_SIGNATURE}
        yield sse("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": signature})
        yield sse("content_block_stop", {"type": "content_block_stop", "index": 0})
        index = 1
    start = {"type": "content_block_start", "index": index, "content_block": {"type": "text", "text": ""}}
    yield sse("content_block_start", start)
    yield sse("ping", {"type": "ping"})
    for i, part in enumerate(parts):
        if i == fake.get("error_after"):  # what Anthropic sends when it fails mid-stream (the guide's example)
            error = {"type": "overloaded_error", "message": "Overloaded"}
            yield sse("error", {"type": "error", "error": error})
            return
        delta = {"type": "content_block_delta", "index": index, "delta": {"type": "text_delta", "text": part}}
        yield sse("content_block_delta", delta)
        await pause(body)
    yield sse("content_block_stop", {"type": "content_block_stop", "index": index})
    if call := tool_call(body):
        index += 1
        yield sse(
            "content_block_start",
            {"type": "content_block_start", "index": index, "content_block": tool_use(body, call, {})},
        )
        for part in pieces(body, call["arguments"]):
            partial = {"type": "input_json_delta", "partial_json": part}
            yield sse("content_block_delta", {"type": "content_block_delta", "index": index, "delta": partial})
            await pause(body)
        yield sse("content_block_stop", {"type": "content_block_stop", "index": index})
    usage = {"output_tokens": len(text.split())}
    stop = {"type": "message_delta", "delta": {"stop_reason": stop_reason(body), "stop_sequence": None}, "usage": usage}
    yield sse("message_delta", stop)
    yield sse("message_stop", {"type": "message_stop"})


async def messages(request: Request, body: dict[str, Any]) -> Response:
    text = reply_text(body)
    if not body.get("stream"):
        return JSONResponse(message(body, text, message_content(body, text), stop_reason(body)))
    return StreamingResponse(message_events(body, text), media_type="text/event-stream")


async def count_tokens(request: Request, body: dict[str, Any]) -> Response:
    return JSONResponse({"input_tokens": input_tokens(body)})


# ---- OpenAI Responses and chat completions ----------------------------------------------------------------------


def openai_error(status: int, message: str) -> JSONResponse:
    error = {"message": message, "type": "server_error" if status >= 500 else "invalid_request_error"}
    return JSONResponse({"error": {**error, "param": None, "code": None}}, status_code=status)


def with_error_fields(response: JSONResponse, **fields: str) -> JSONResponse:
    """An OpenAI error with its `param` and `code` filled in."""
    body = json.loads(response.body)
    body["error"].update(fields)
    return JSONResponse(body, status_code=response.status_code)


def response_object(body: dict[str, Any], text: str | None, msg_id: str, resp_id: str) -> dict[str, Any]:
    """A Response: in progress with no output (text None), or completed with the message and usage."""
    done = text is not None
    output = [
        *reasoning_items(body, msg_id),
        {
            "type": "message",
            "id": msg_id,
            "status": "completed",
            "role": "assistant",
            "content": [message_part(body, text)],
        },
        *function_calls(body, msg_id),
    ]
    prompt, generated = input_tokens(body), len((text or "").split())
    usage = {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": generated,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + generated,
    }
    return {
        "id": resp_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": "completed" if done else "in_progress",
        "error": None,
        "incomplete_details": None,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "model": body.get("model"),
        "output": output if done else [],
        "parallel_tool_calls": True,
        "previous_response_id": body.get("previous_response_id"),
        "reasoning": {"effort": None, "summary": None},
        "store": body.get("store", True),
        "temperature": body.get("temperature", 1.0),
        "text": {"format": {"type": "text"}},
        "tool_choice": "auto",
        "tools": [],
        "top_p": body.get("top_p", 1.0),
        "truncation": "disabled",
        "usage": usage if done else None,
        "user": None,
        "metadata": {},
    }


def message_part(body: dict[str, Any], text: str | None) -> dict[str, Any]:
    """A Response message's content part: the answer's output_text, or a refusal where the test asked for one."""
    if refusal := refusal_text(body):
        return {"type": "refusal", "refusal": refusal}
    return {"type": "output_text", "text": text, "annotations": []}


def reasoning_items(body: dict[str, Any], msg_id: str) -> list[dict[str, Any]]:
    """A Response's reasoning item, before its message, where the test asked for reasoning: its summary says it."""
    summary = reasoning_text(body)
    if not summary:
        return []
    return [{"type": "reasoning", "id": f"rs_{msg_id}", "summary": [{"type": "summary_text", "text": summary}]}]


def reasoning_events(body: dict[str, Any], item: dict[str, Any]) -> list[dict[str, Any]]:
    """A reasoning item streamed: added, its summary part's text in deltas, then each level's done event."""
    part = item["summary"][0]
    at = {"item_id": item["id"], "output_index": 0, "summary_index": 0}
    return [
        {"type": "response.output_item.added", "output_index": 0, "item": {**item, "summary": []}},
        {"type": "response.reasoning_summary_part.added", **at, "part": {**part, "text": ""}},
        *({"type": "response.reasoning_summary_text.delta", **at, "delta": p} for p in pieces(body, part["text"])),
        {"type": "response.reasoning_summary_text.done", **at, "text": part["text"]},
        {"type": "response.reasoning_summary_part.done", **at, "part": part},
        {"type": "response.output_item.done", "output_index": 0, "item": item},
    ]


# a tool call item's type -> the events its text streams in (+ .delta / .done), and the key of the done event's copy
CALL_STREAMS = {
    "function_call": ("response.function_call_arguments", "arguments"),
    "custom_tool_call": ("response.custom_tool_call_input", "input"),
    "mcp_call": ("response.mcp_call_arguments", "arguments"),
    "code_interpreter_call": ("response.code_interpreter_call_code", "code"),
    "shell_call": ("response.shell_call_command", "command"),  # each command's, its first piece in a `.added` too
    "apply_patch_call": ("response.apply_patch_call_operation_diff", "diff"),
}
# a tool call item's type -> where its text is in the item (openai-python's types/responses)
CALL_TEXTS: dict[str, tuple[str | int, ...]] = {
    "function_call": ("arguments",),
    "custom_tool_call": ("input",),
    "mcp_call": ("arguments",),
    "code_interpreter_call": ("code",),
    "shell_call": ("action", "commands", 0),
    "apply_patch_call": ("operation", "diff"),
    "local_shell_call": ("action", "command", 2),
    "computer_call": ("action", "text"),
}


def call_fields(kind: str, name: str, text: str) -> dict[str, Any]:
    """A tool call item's members besides its id, type and status, `text` where the kind keeps it (openai-python's
    types/responses)."""
    if kind == "mcp_call":
        return {"name": name, "server_label": "fake_mcp", "arguments": text, "output": None, "error": None}
    if kind == "code_interpreter_call":
        return {"container_id": "cntr_fake", "code": text, "outputs": None}
    if kind == "shell_call":
        return {"call_id": "call_fake", "action": {"commands": [text], "timeout_ms": None, "max_output_length": None}}
    if kind == "apply_patch_call":
        return {"call_id": "call_fake", "operation": {"type": "create_file", "path": "notes.md", "diff": text}}
    if kind == "local_shell_call":
        action = {"type": "exec", "command": ["bash", "-lc", text], "env": {}, "working_directory": None}
        return {"call_id": "call_fake", "action": action}
    if kind == "computer_call":
        return {"call_id": "call_fake", "action": {"type": "type", "text": text}, "pending_safety_checks": []}
    return {"call_id": "call_fake", "name": name, CALL_TEXTS[kind][0]: text}


def function_calls(body: dict[str, Any], msg_id: str) -> list[dict[str, Any]]:
    """A Response's tool call item, after its message, where the test asked for a tool call: a function_call, or
    another kind of call whose text (a custom tool's free-text `input`, an MCP call's `arguments`, code interpreter's
    `code`, a command a shell or computer call runs, the diff a patch writes) is the arguments text."""
    call = tool_call(body)
    if call is None:
        return []
    kind = tool_kind(body, "function_call")
    fields = call_fields(kind, call["name"], call["arguments"])
    return [{"type": kind, "id": f"fc_{msg_id}", **fields, "status": "completed"}]


def item_added(item: dict[str, Any]) -> dict[str, Any]:
    """A tool call item as response.output_item.added carries it: its text to come where it streams (a shell call's
    commands none yet: each is added by an event of its own), whole where it does not."""
    if item["type"] not in CALL_STREAMS:
        return item
    added = copy.deepcopy(item)
    *outer, key = CALL_TEXTS[item["type"]]
    holder = functools.reduce(operator.getitem, outer, added)
    if isinstance(holder, list):
        holder.clear()
    else:
        holder[key] = ""
    return added


def function_call_events(body: dict[str, Any], item: dict[str, Any], index: int) -> list[dict[str, Any]]:
    """A tool call item streamed: added with no text (a whole item with it), its text in deltas, their done, the
    item's. A shell call's command is added (with no text yet), in deltas, done, by its index, and no item id."""
    added = {"type": "response.output_item.added", "output_index": index, "item": item_added(item)}
    done = {"type": "response.output_item.done", "output_index": index, "item": item}
    if item["type"] not in CALL_STREAMS:
        return [added, done]
    events, key = CALL_STREAMS[item["type"]]
    text = functools.reduce(operator.getitem, CALL_TEXTS[item["type"]], item)
    shell = item["type"] == "shell_call"
    at = {"output_index": index, **({"command_index": 0} if shell else {"item_id": item["id"]})}
    return [
        added,
        *([{"type": f"{events}.added", **at, key: ""}] if shell else []),
        *({"type": f"{events}.delta", **at, "delta": p} for p in pieces(body, text)),
        {"type": f"{events}.done", **at, key: text},
        done,
    ]


async def response_events(body: dict[str, Any], text: str, msg_id: str, resp_id: str) -> AsyncIterator[str]:
    final = response_object(body, text, msg_id, resp_id)
    reasoning = [i for i in final["output"] if i["type"] == "reasoning"]
    calls = [i for i in final["output"] if i["type"] in CALL_TEXTS]
    item = next(i for i in final["output"] if i["type"] == "message")
    part, index = item["content"][0], len(reasoning)
    key = "refusal" if part["type"] == "refusal" else "text"  # streamed in response.refusal.* or output_text.*
    logprobs = {"logprobs": []} if key == "text" else {}
    at = {"item_id": msg_id, "output_index": index, "content_index": 0}
    events: list[dict[str, Any]] = [
        {"type": "response.created", "response": response_object(body, None, msg_id, resp_id)},
        {"type": "response.in_progress", "response": response_object(body, None, msg_id, resp_id)},
        *(e for r in reasoning for e in reasoning_events(body, r)),
        {
            "type": "response.output_item.added",
            "output_index": index,
            "item": {**item, "status": "in_progress", "content": []},
        },
        {"type": "response.content_part.added", **at, "part": {**part, key: ""}},
    ]
    for piece in pieces(body, part[key]):
        events.append({"type": f"response.{part['type']}.delta", **at, "delta": piece, **logprobs})
    events += [
        {"type": f"response.{part['type']}.done", **at, key: part[key], **logprobs},
        {"type": "response.content_part.done", **at, "part": part},
        {"type": "response.output_item.done", "output_index": index, "item": item},
        *(e for n, c in enumerate(calls, index + 1) for e in function_call_events(body, c, n)),
        {"type": "response.completed", "response": final},
    ]
    for number, event in enumerate(events):
        if number == (body.get("fake") or {}).get("cut_after"):
            return  # the connection ends here, as a broken one does: no response.completed, no usage
        yield sse(event["type"], {**event, "sequence_number": number})
        await pause(body)


async def responses(request: Request, body: dict[str, Any]) -> Response:
    stored = organization(request)
    previous = body.get("previous_response_id")
    if previous is not None and previous not in stored.responses:
        error = openai_error(400, f"Previous response with id '{previous}' not found.")
        return with_error_fields(error, param="previous_response_id", code="previous_response_not_found")
    text = reply_text(body)
    msg_id, resp_id = f"msg_{uuid.uuid4().hex}", f"resp_{uuid.uuid4().hex}"
    final = response_object(body, text, msg_id, resp_id)
    if final["store"] is not False:
        stored.responses[resp_id] = final
    if not body.get("stream"):
        return JSONResponse(final)
    return StreamingResponse(response_events(body, text, msg_id, resp_id), media_type="text/event-stream")


def chat_finish(body: dict[str, Any]) -> str:
    return "tool_calls" if tool_call(body) else "stop"


def reasoning_field(body: dict[str, Any]) -> str:
    """Where a chat answer carries its reasoning: vLLM's `reasoning_content`, or `reasoning` in newer releases."""
    return str((body.get("fake") or {}).get("reasoning_field", "reasoning_content"))


def chat_call_deltas(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The chat deltas of the tool call the test asked for: each call's head (id and name), then its arguments in
    pieces, shaped by `fake.tool_stream` where the test asked for a server's quirks."""
    call = tool_call(body)
    if call is None:
        return []
    quirks = (body.get("fake") or {}).get("tool_stream") or {}
    deltas: list[dict[str, Any]] = []
    for n in range(int(quirks.get("repeat", 1))):
        head = {
            "index": n,
            "id": f"call_fake{n or ''}",
            "type": "function",
            "function": {"name": call["name"], "arguments": ""},
        }
        fragments = [{"index": n, "function": {"arguments": p}} for p in pieces(body, call["arguments"])]
        if quirks.get("unindexed"):
            for fragment in (head, *fragments):
                del fragment["index"]
        deltas += [{"tool_calls": [fragment]} for fragment in (head, *fragments)]
        if quirks.get("interrupt"):
            deltas.insert(len(deltas) - len(fragments) + 1, {"content": quirks["interrupt"]})
    return deltas


async def chat_events(body: dict[str, Any], text: str) -> AsyncIterator[str]:
    base = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": int(time.time())}
    base["model"] = body.get("model")
    yield sse(None, {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    if reasoning := reasoning_text(body):
        for piece in pieces(body, reasoning):
            delta = {reasoning_field(body): piece}
            yield sse(None, {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
            await pause(body)
    refusal = refusal_text(body)
    for piece in pieces(body, refusal or text):
        delta = {"refusal": piece} if refusal else {"content": piece}
        yield sse(None, {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
        await pause(body)
    for delta in chat_call_deltas(body):
        yield sse(None, {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
        await pause(body)
    yield sse(None, {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": chat_finish(body)}]})
    if (body.get("stream_options") or {}).get("include_usage"):
        usage = {"prompt_tokens": input_tokens(body), "completion_tokens": len(text.split())}
        yield sse(None, {**base, "choices": [], "usage": {**usage, "total_tokens": sum(usage.values())}})
    yield "data: [DONE]\n\n"


async def chat(request: Request, body: dict[str, Any]) -> Response:
    text = reply_text(body)
    if body.get("stream"):
        return StreamingResponse(chat_events(body, text), media_type="text/event-stream")
    reasoning = {reasoning_field(body): reasoning_text(body)} if reasoning_text(body) else {}
    answer = {"content": None, "refusal": refusal_text(body)} if refusal_text(body) else {"content": text}
    call = tool_call(body)
    calls = {"tool_calls": [{"id": "call_fake", "type": "function", "function": call}]} if call else {}
    message = {"role": "assistant", **reasoning, **answer, **calls}
    choice = {"index": 0, "message": message, "finish_reason": chat_finish(body)}
    return JSONResponse(
        {"id": "chatcmpl-fake", "object": "chat.completion", "model": body.get("model"), "choices": [choice]}
    )


async def embeddings(request: Request, body: dict[str, Any]) -> Response:
    """platform.openai.com "Embeddings": one vector per input (a text or a list of texts), with usage."""
    inputs = body.get("input")
    texts = inputs if isinstance(inputs, list) else [inputs]
    data = [{"object": "embedding", "index": i, "embedding": [0.25, -0.5, float(i)]} for i in range(len(texts))]
    tokens = sum(len(str(text).split()) for text in texts)
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return JSONResponse({"object": "list", "data": data, "model": body.get("model"), "usage": usage})


def steered(body: dict[str, Any]) -> dict[str, Any]:
    """The body with its `fake` object: its own, or the one a translated Messages request carries in `user`."""
    if "fake" in body or not isinstance(body.get("user"), str):
        return body
    try:
        fake = json.loads(body["user"])
    except ValueError:
        return body
    return {**body, "fake": fake} if isinstance(fake, dict) else body


# ---- OpenAI Files and stored Responses -------------------------------------------------------------------------
# platform.openai.com API reference, "Files": POST /v1/files (multipart: file, purpose) -> a File object; GET /v1/files
# (purpose, limit 1-10,000 default 10,000, order desc by default, after: an id) -> {"object": "list", "data",
# "first_id", "last_id", "has_more"}; GET /v1/files/{id}; GET /v1/files/{id}/content; DELETE /v1/files/{id} ->
# {"id", "object": "file", "deleted": true}. "Responses": a response made with `store` (true by default) is kept:
# GET /v1/responses/{id}, DELETE /v1/responses/{id} -> {"id", "object": "response", "deleted": true}, and a later
# request may continue it (`previous_response_id`; an unknown one is a 400 previous_response_not_found).
# "Containers": POST /v1/containers (JSON: name) -> a container; POST /v1/containers/{id}/files, "either a
# multipart/form-data request with the raw file content, or a JSON request with a file ID" (`file_id`: a file of the
# organization, copied into the container; a multipart body naming one copies it too) -> a container file;
# GET /v1/containers/{id}/files/{file_id}/content -> its bytes. "Batch": POST /v1/batches (JSON: input_file_id, a
# file of the organization; endpoint; completion_window) -> a batch, `validating` (the fake runs none of its lines).
# "Fine-tuning": POST /v1/fine_tuning/jobs (JSON: model, training_file, suffix) -> a fine_tuning.job,
# `validating_files`, its `fine_tuned_model` null until it succeeds (the fake runs it to success by its first read
# after it was made); GET /v1/fine_tuning/jobs (after, limit: default 20) -> {"object": "list", "data", "has_more"};
# GET /v1/fine_tuning/jobs/{id}; GET /v1/fine_tuning/jobs/{id}/checkpoints -> fine_tuning.job.checkpoint objects, each
# a model too (`fine_tuned_model_checkpoint`). A succeeded job's `fine_tuned_model` is `ft:<model>:<org>:<suffix>:<id>`
# and its `result_files` a file of the organization. "Models": GET /v1/models lists the base models and the
# organization's fine-tunes; GET /v1/models/{model}; DELETE /v1/models/{model} (a fine-tune of the organization) ->
# {"id", "object": "model", "deleted": true}. A model the organization may not call is a 404 model_not_found: "The model
# `<model>` does not exist or you do not have access to it."
BASE_MODELS = ("gpt-4.1-mini", "text-embedding-3-small")


class Objects:
    """What the fake keeps for the callers of one key, as the provider keeps it per organization."""

    def __init__(self) -> None:
        self.files: dict[str, tuple[dict[str, Any], bytes]] = {}  # by id, oldest first
        self.responses: dict[str, dict[str, Any]] = {}
        self.containers: dict[str, dict[str, bytes]] = {}  # container id -> its files' bytes by id
        self.jobs: dict[str, dict[str, Any]] = {}  # fine-tuning jobs by id, oldest first
        self.models: dict[str, dict[str, Any]] = {}  # the fine-tuned models it made (checkpoints too), by name


def organization(request: Request) -> Objects:
    """The objects of the key the request carries (checked already): each key is an organization of its own."""
    orgs: dict[str, Objects] = request.app.state.organizations
    return orgs[request.headers.get("authorization", "").removeprefix("Bearer ")]


def not_found(kind: str, object_id: str) -> JSONResponse:
    return with_error_fields(openai_error(404, f"No such {kind} object: {object_id}"), param="id")


def form_fields(content_type: str, body: bytes) -> dict[str, tuple[str | None, bytes]]:
    """A multipart/form-data body's fields: name -> (file name, bytes), read with the standard library's MIME
    parser (the test environment has no python-multipart)."""
    message = BytesParser(policy=HTTP).parsebytes(f"Content-Type: {content_type}\r\n\r\n".encode() + body)
    fields = {}
    for part in message.iter_parts() if message.is_multipart() else ():
        name = part.get_param("name", header="content-disposition")
        if isinstance(name, str):
            fields[name] = (part.get_filename(), part.get_payload(decode=True) or b"")
    return fields


async def create_file(request: Request, stored: Objects) -> Response:
    form = form_fields(request.headers.get("content-type", ""), await request.body())
    if "file" not in form or "purpose" not in form:
        return openai_error(400, "'file' and 'purpose' are required")
    filename, content = form["file"]
    purpose = form["purpose"][1].decode()
    file = {
        "id": f"file-{uuid.uuid4().hex[:24]}",
        "object": "file",
        "bytes": len(content),
        "created_at": int(time.time()),
        "expires_at": None,
        "filename": filename,
        "purpose": purpose,
        "status": "processed",
        "status_details": None,
    }
    stored.files[file["id"]] = (file, content)
    return JSONResponse(file)


async def list_files(request: Request, stored: Objects) -> Response:
    query = request.query_params
    limit = int(query.get("limit", 10_000))
    if not 1 <= limit <= 10_000:
        return with_error_fields(openai_error(400, "limit must be between 1 and 10000"), param="limit")
    files = [f for f, _ in stored.files.values() if query.get("purpose") in (None, f["purpose"])]
    if query.get("order", "desc") == "desc":
        files.reverse()
    if (after := query.get("after")) is not None:
        at = next((i for i, f in enumerate(files) if f["id"] == after), None)
        if at is None:
            return not_found("File", after)
        files = files[at + 1 :]
    page = files[:limit]
    first, last = (page[0]["id"], page[-1]["id"]) if page else (None, None)
    return JSONResponse(
        {"object": "list", "data": page, "first_id": first, "last_id": last, "has_more": len(files) > limit}
    )


async def one_file(request: Request, stored: Objects) -> Response:
    file_id = request.path_params["file_id"]
    if file_id not in stored.files:
        return not_found("File", file_id)
    file, content = stored.files[file_id]
    if request.url.path.endswith("/content"):
        return Response(content, media_type="application/octet-stream")
    if request.method == "DELETE":
        del stored.files[file_id]
        return JSONResponse({"id": file_id, "object": "file", "deleted": True})
    return JSONResponse(file)


async def one_response(request: Request, stored: Objects) -> Response:
    response_id = request.path_params["response_id"]
    if response_id not in stored.responses:
        return not_found("Response", response_id)
    if request.method == "DELETE":
        del stored.responses[response_id]
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})
    return JSONResponse(stored.responses[response_id])


async def create_container(request: Request, stored: Objects) -> Response:
    body = await request.json()
    container_id = f"cntr_{uuid.uuid4().hex[:24]}"
    stored.containers[container_id] = {}
    return JSONResponse(
        {"id": container_id, "object": "container", "name": body.get("name"), "created_at": int(time.time())}
    )


async def create_container_file(request: Request, stored: Objects) -> Response:
    container_id = request.path_params["container_id"]
    if container_id not in stored.containers:
        return not_found("Container", container_id)
    content_type = request.headers.get("content-type", "")
    if content_type.startswith("multipart/"):
        form = form_fields(content_type, await request.body())
        file_id = form["file_id"][1].decode() if "file_id" in form else None
    else:
        form, file_id = {}, (await request.json()).get("file_id")
    if file_id is not None:
        if file_id not in stored.files:
            return not_found("File", file_id)
        content = stored.files[file_id][1]
    elif "file" in form:
        content = form["file"][1]
    else:
        return openai_error(400, "either 'file' or 'file_id' is required")
    made = f"cfile_{uuid.uuid4().hex[:24]}"
    stored.containers[container_id][made] = content
    return JSONResponse({"id": made, "object": "container.file", "container_id": container_id, "bytes": len(content)})


async def container_file_content(request: Request, stored: Objects) -> Response:
    files = stored.containers.get(request.path_params["container_id"], {})
    file_id = request.path_params["file_id"]
    if file_id not in files:
        return not_found("Container file", file_id)
    return Response(files[file_id], media_type="application/octet-stream")


async def create_batch(request: Request, stored: Objects) -> Response:
    body = await request.json()
    if body.get("input_file_id") not in stored.files:
        return not_found("File", str(body.get("input_file_id")))
    batch = {
        "id": f"batch_{uuid.uuid4().hex[:24]}",
        "object": "batch",
        "endpoint": body.get("endpoint"),
        "input_file_id": body["input_file_id"],
        "completion_window": body.get("completion_window"),
        "status": "validating",
        "created_at": int(time.time()),
    }
    return JSONResponse(batch)


def model_not_found(model: str) -> JSONResponse:
    message = f"The model `{model}` does not exist or you do not have access to it."
    return with_error_fields(openai_error(404, message), code="model_not_found")


def callable_model(model: Any, stored: Objects) -> bool:
    """A base model, or a fine-tune the organization made."""
    return not (isinstance(model, str) and model.startswith("ft:")) or model in stored.models


async def create_job(request: Request, stored: Objects) -> Response:
    body = await request.json()
    if body.get("training_file") not in stored.files:
        return not_found("File", str(body.get("training_file")))
    if not callable_model(body.get("model"), stored):
        return model_not_found(str(body.get("model")))
    job = {
        "id": f"ftjob-{uuid.uuid4().hex[:24]}",
        "object": "fine_tuning.job",
        "model": body.get("model"),
        "created_at": int(time.time()),
        "finished_at": None,
        "fine_tuned_model": None,
        "organization_id": "org-fake",
        "result_files": [],
        "status": "validating_files",
        "training_file": body["training_file"],
        "validation_file": body.get("validation_file"),
        "hyperparameters": {"n_epochs": 1},
        "trained_tokens": None,
        "error": None,
        "seed": 42,
        "suffix": body.get("suffix"),
    }
    stored.jobs[job["id"]] = job
    return JSONResponse(job)


def run_job(job: dict[str, Any], stored: Objects) -> dict[str, Any]:
    """A job read after it was made has run to success: its model, its checkpoint's model and its result file."""
    if job["status"] == "succeeded":
        return job
    base, short = str(job["model"]).removeprefix("ft:").split(":")[0], job["id"].removeprefix("ftjob-")[:8]
    model = f"ft:{base}:org-fake:{job['suffix'] or 'custom'}:{short}"
    checkpoint = f"{model}:ckpt-step-10"
    for name in (model, checkpoint):
        stored.models[name] = {"id": name, "object": "model", "created": int(time.time()), "owned_by": "org-fake"}
    result = {"id": f"file-{uuid.uuid4().hex[:24]}", "object": "file", "purpose": "fine-tune-results"}
    stored.files[result["id"]] = (result, b"step,train_loss\n10,0.5\n")
    job.update(
        status="succeeded",
        finished_at=int(time.time()),
        fine_tuned_model=model,
        result_files=[result["id"]],
        trained_tokens=100,
        checkpoints=[
            {
                "id": f"ftckpt_{short}",
                "object": "fine_tuning.job.checkpoint",
                "created_at": int(time.time()),
                "fine_tuned_model_checkpoint": checkpoint,
                "fine_tuning_job_id": job["id"],
                "metrics": {"step": 10, "train_loss": 0.5},
                "step_number": 10,
            }
        ],
    )
    return job


def shown_job(job: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in job.items() if k != "checkpoints"}


async def list_jobs(request: Request, stored: Objects) -> Response:
    limit = int(request.query_params.get("limit", 20))
    jobs = [shown_job(run_job(job, stored)) for job in reversed(stored.jobs.values())]  # newest first
    if (after := request.query_params.get("after")) is not None:
        at = next((i for i, job in enumerate(jobs) if job["id"] == after), None)
        if at is None:
            return not_found("Fine-tuning job", after)
        jobs = jobs[at + 1 :]
    return JSONResponse({"object": "list", "data": jobs[:limit], "has_more": len(jobs) > limit})


async def one_job(request: Request, stored: Objects) -> Response:
    job = stored.jobs.get(request.path_params["job_id"])
    if job is None:
        return not_found("Fine-tuning job", request.path_params["job_id"])
    run_job(job, stored)
    if request.url.path.endswith("/checkpoints"):
        data = job["checkpoints"]
        first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
        return JSONResponse({"object": "list", "data": data, "first_id": first, "last_id": last, "has_more": False})
    return JSONResponse(shown_job(job))


async def list_models(request: Request, stored: Objects) -> Response:
    base = [{"id": name, "object": "model", "created": 0, "owned_by": "openai"} for name in BASE_MODELS]
    return JSONResponse({"object": "list", "data": [*base, *stored.models.values()]})


async def one_model(request: Request, stored: Objects) -> Response:
    model = request.path_params["model"]
    if request.method == "DELETE":
        if model not in stored.models:
            return model_not_found(model)
        del stored.models[model]
        return JSONResponse({"id": model, "object": "model", "deleted": True})
    if model in BASE_MODELS:
        return JSONResponse({"id": model, "object": "model", "created": 0, "owned_by": "openai"})
    return JSONResponse(stored.models[model]) if model in stored.models else model_not_found(model)


async def unknown_route(request: Request, stored: Objects) -> Response:
    """Any other path: OpenAI's 404 for a URL it does not serve (recorded, so a test sees what reached it)."""
    return openai_error(404, f"Invalid URL ({request.method} {request.url.path})")


# ---- the app ------------------------------------------------------------------------------------------------------

Handler = Callable[[Request, dict[str, Any]], Any]


def build(api_keys: list[str]) -> Starlette:
    received: list[dict[str, Any]] = []

    def endpoint(handler: Handler, anthropic: bool) -> Callable[[Request], Any]:
        async def receive(request: Request) -> Response:
            body = await request.json()
            received.append({"path": request.url.path, "headers": dict(request.headers), "body": body})
            refuse = anthropic_error if anthropic else openai_error
            sent_key = request.headers.get("x-api-key") if anthropic else request.headers.get("authorization")
            if sent_key not in (api_keys if anthropic else [f"Bearer {key}" for key in api_keys]):
                return refuse(401, "invalid x-api-key" if anthropic else "Incorrect API key provided")
            if anthropic and not request.headers.get("anthropic-version"):
                return refuse(400, "anthropic-version: header is required")
            status = (body.get("fake") or {}).get("status")
            if status:
                return refuse(int(status), f"fake upstream answers {status}")
            if not anthropic and not callable_model(body.get("model"), organization(request)):
                return model_not_found(str(body.get("model")))
            return await handler(request, steered(body))

        return receive

    def objects(handler: Callable[[Request, Objects], Any]) -> Callable[[Request], Any]:
        """An object route: recorded (its body when JSON), refused without a key like the model routes, and served
        from the objects of the key it carries."""

        async def receive(request: Request) -> Response:
            body = await request.body()
            json_body = body and "json" in request.headers.get("content-type", "")
            received.append(
                {
                    "path": request.url.path,
                    "method": request.method,
                    "query": request.url.query,
                    "headers": dict(request.headers),
                    "body": json.loads(body) if json_body else None,
                }
            )
            if request.headers.get("authorization") not in [f"Bearer {key}" for key in api_keys]:
                return openai_error(401, "Incorrect API key provided")
            return await handler(request, organization(request))

        return receive

    async def get_received(request: Request) -> Response:
        return JSONResponse(received)

    app = Starlette(
        routes=[
            Route("/v1/messages", endpoint(messages, anthropic=True), methods=["POST"]),
            Route("/v1/messages/count_tokens", endpoint(count_tokens, anthropic=True), methods=["POST"]),
            Route("/v1/responses", endpoint(responses, anthropic=False), methods=["POST"]),
            Route("/v1/responses/{response_id}", objects(one_response), methods=["GET", "DELETE"]),
            Route("/v1/chat/completions", endpoint(chat, anthropic=False), methods=["POST"]),
            Route("/v1/embeddings", endpoint(embeddings, anthropic=False), methods=["POST"]),
            Route("/v1/fine_tuning/jobs", objects(create_job), methods=["POST"]),
            Route("/v1/fine_tuning/jobs", objects(list_jobs), methods=["GET"]),
            Route("/v1/fine_tuning/jobs/{job_id}", objects(one_job), methods=["GET"]),
            Route("/v1/fine_tuning/jobs/{job_id}/checkpoints", objects(one_job), methods=["GET"]),
            Route("/v1/models", objects(list_models), methods=["GET"]),
            Route("/v1/models/{model}", objects(one_model), methods=["GET", "DELETE"]),
            Route("/v1/files", objects(create_file), methods=["POST"]),
            Route("/v1/files", objects(list_files), methods=["GET"]),
            Route("/v1/files/{file_id}", objects(one_file), methods=["GET", "DELETE"]),
            Route("/v1/files/{file_id}/content", objects(one_file), methods=["GET"]),
            Route("/v1/batches", objects(create_batch), methods=["POST"]),
            Route("/v1/containers", objects(create_container), methods=["POST"]),
            Route("/v1/containers/{container_id}/files", objects(create_container_file), methods=["POST"]),
            Route(
                "/v1/containers/{container_id}/files/{file_id}/content",
                objects(container_file_content),
                methods=["GET"],
            ),
            Route("/_received", get_received),
            Route("/v1/{path:path}", objects(unknown_route), methods=["GET", "POST", "DELETE"]),
        ]
    )
    app.state.organizations = {key: Objects() for key in api_keys}
    return app


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument(
        "--api-key", required=True, action="append", help="a key a request may carry; each keeps its own objects"
    )
    args = parser.parse_args()
    uvicorn.run(build(args.api_key), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
