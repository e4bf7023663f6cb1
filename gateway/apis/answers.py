"""How an upstream's answer is read, per wire format: usage and finish reasons (token limits settle on them, traces
show them), where the generated text is (the output guard scans and redacts it in place), whether a stream is
complete, whether an event is the upstream's own error, and which reported token counts are counts (charging, the
fair queue, metrics and the Messages translation all take the same ones).

A format reads one request's answer: a whole body, or the stream's events one by one (parsed JSON objects), a
stream's by a copy of its own (`for_stream`): which call a chat tool-call fragment belongs to depends on the fragments
before it (gateway/apis/chat_calls.py).
Generated text is addressed as (channel, holder, key): the dict holding a piece of text and its key, and the
channel the piece belongs to (a choice, a Responses content part, an Anthropic content block), so the guard can
follow each channel's text across events. Reasoning is generated text too, read like the answer: it reaches the
client as the answer does (chat's `reasoning_content` / `reasoning`, Messages thinking blocks, Responses reasoning
items), so a secret the guard would take out of the answer must not pass in it. It gets channels of its own (a
choice's reasoning, a reasoning summary part), so its text is never run together with the answer's. So are a tool
call's arguments and a refusal: an agent runs the call, so a secret or PII in `send_email(body=...)` leaves as surely
as one in the answer does. Arguments are JSON text, on `Arguments` channels, which the guard redacts so that the
JSON stays valid; an Anthropic tool_use block's `input` is an object, read as its JSON and parsed back when redacted.
A Responses custom tool's input is free text in the tool's own grammar, code interpreter's code is code, and so are
the commands a shell, local shell or computer call runs and the diff a patch call writes: each string on a text
channel as the answer is, held where it is (a command line's words are an array's strings, an environment an
object's), so a redaction leaves each a string where it was.

Every string of an answer is accounted for: a format's readers name where its known texts are, its `Inventory`
names the fields that hold no generated text (identifiers, opaque blobs, the request's settings echoed back), and
`untrusted()` gives every other string, of an event type the table knows or not, on an `Untrusted` channel, and the
identifiers on `Identifier` ones (gateway/apis/untrusted.py), for the guard to read: nothing the client gets goes
unread but base64 in an opaque field and the request's own settings.
Copies of a text that a stream repeats whole (`snapshots()`) are compared with what its pieces said.

Every reader takes any JSON object: the answer is whatever the upstream sent, so a field of the wrong type reads as
absent, never as an exception that would cost the client a 500 or a stream cut without its error event.
"""

from __future__ import annotations

import copy
import json
from collections import defaultdict
from collections.abc import Callable, Container, Hashable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol, Self

from gateway.apis.chat_calls import StreamedCalls
from gateway.apis.untrusted import Inventory, Place

if TYPE_CHECKING:
    from gateway.context import Usage


class Holder(Protocol):
    """What holds a piece of generated text: an object by its key, or an array by its index (a command's words)."""

    def __getitem__(self, key: Any, /) -> Any: ...

    def __setitem__(self, key: Any, value: Any, /) -> None: ...


Text = tuple[Hashable, Holder, str | int]  # (channel, holder, key): holder[key] is a piece of generated text
REASONING_FIELDS = ("reasoning_content", "reasoning")  # a chat answer's reasoning: vLLM's name, and newer releases'
REFUSAL = "refusal"  # a chat answer's refusal: text the client reads (a Messages client, as a text block)
FUNCTION_CALL = "function_call"  # the legacy single tool call, before tool_calls


@dataclass(frozen=True, slots=True)
class Arguments:
    """A tool call's arguments, as a channel: JSON text that an agent parses and runs, so the guard redacts it
    keeping the JSON valid. `at` is the call: (choice, the call's number or FUNCTION_CALL) in chat (the calls
    numbered in the order they start, as a whole answer lists them), the content block in Messages, the output item
    in Responses."""

    at: Hashable


class AnswerFormat:
    """The OpenAI chat-completions, completions and embeddings format: `choices`, `usage`, and `[DONE]`.

    `reasoning=False` reads a chat answer without its reasoning: for a client that never gets it (a Messages
    client of a chat pool that did not ask for thinking), where scanning it could only block what nobody sees."""

    # ids, enums and names (vLLM's `stop_reason` is the request's stop string that matched; `kv_transfer_params`
    # its disaggregated prefill's handle); opaque: an audio answer's sound (its transcript is text, read as untrusted),
    # the padding that obfuscates a stream's event sizes
    INVENTORY = Inventory(
        identifiers=frozenset(
            {"id", "object", "model", "system_fingerprint", "service_tier", "finish_reason", "stop_reason", "role"}
            | {"type", "kv_transfer_params"}
        ),
        opaque=frozenset({"obfuscation"}),
        opaque_paths={"": frozenset({"choices[].delta.audio.data", "choices[].message.audio.data"})},
        items=frozenset({"choices"}),
    )

    def __init__(self, *, reasoning: bool = True) -> None:
        self.reasoning = reasoning
        self._calls: defaultdict[int, StreamedCalls] = defaultdict(StreamedCalls)  # a stream's, per choice
        self._inventory = self.INVENTORY
        if not reasoning:  # dropped on the way to the client: no text of its
            self._inventory = replace(self.INVENTORY, dropped=frozenset(REASONING_FIELDS))

    def for_stream(self) -> Self:
        """This format, to read one stream's events with: a chat stream's tool calls are told apart by what their
        earlier fragments said, which no other stream may share."""
        reader = copy.copy(self)
        reader._calls = defaultdict(StreamedCalls)
        return reader

    def record(self, usage: Usage, body: dict[str, Any]) -> None:
        """Usage, finish reasons and the answer's id and model from a whole answer or from one stream event."""
        _take_identity(usage, body)
        for choice in _array(body.get("choices")):
            reason = choice.get("finish_reason") if isinstance(choice, dict) else None
            if reason:
                usage.finish_reasons.append(reason)
            usage.generated = usage.generated or _carries_output(choice)
        _take_usage(usage, body.get("usage"), ("prompt_tokens", "completion_tokens"), _CHAT_DETAILS)

    def ends(self, data: bytes, event: dict[str, Any] | None) -> bool:
        """Whether this event completes the stream (nothing may follow it)."""
        return data == b"[DONE]"

    def is_event(self, name: bytes | None, data: bytes, event: dict[str, Any] | None) -> bool:
        """Whether a stream event's data is one of this format's events (`name`: its SSE type, `event`: its data
        parsed, None where it is not a JSON object): a chat or completions chunk is a JSON object, and [DONE] ends
        the stream. What a client reads is the upstream's to say, so a field of the wrong type is still an event
        (the readers take any object); data that is no object is not."""
        return event is not None or data == b"[DONE]"

    def is_error(self, event: dict[str, Any]) -> bool:
        return "error" in event

    def texts(self, event: dict[str, Any]) -> Iterator[Text]:
        """The pieces of generated text a stream event carries."""
        for i, choice in enumerate(_array(event.get("choices"))):
            if isinstance(choice, dict):
                number = _index(choice.get("index"), i)
                yield from self._choice_texts(number, choice, self._calls[number])

    def ended(self, event: dict[str, Any]) -> Iterator[Hashable]:
        """The channels a stream event ends. A choice's reasoning ends where its answer starts (reasoning comes
        first), not only at the finish: held back until then, it would hold the whole answer behind it."""
        for i, choice in enumerate(_array(event.get("choices"))):
            if not isinstance(choice, dict):
                continue
            number = _index(choice.get("index"), i)
            if choice.get("finish_reason"):  # (its tool calls end with the stream: their indexes are not here)
                yield from (number, (number, REFUSAL))
            if choice.get("finish_reason") or _answer_started(choice.get("delta")):
                yield from ((number, field) for field in REASONING_FIELDS)

    def snapshots(self, event: dict[str, Any]) -> Iterator[Text]:
        """Copies of a channel's whole text so far that a stream event repeats (to redact as the pieces were)."""
        return iter(())

    def untrusted(
        self, event: dict[str, Any], known: set[Place], seen: Container[str] = (), *, whole: bool = False
    ) -> Iterator[Text]:
        """The strings of a stream event (or, `whole`, an answer) that are not at a `known` place (the texts the
        readers above gave), as the format's inventory reads them: identifiers (but the values already `seen`) and
        untrusted text, less what holds no text (gateway/apis/untrusted.py)."""
        return self._inventory.untrusted(event, known, seen, whole=whole)

    def logprobs(self, event: dict[str, Any]) -> Iterator[tuple[str, Any, bool]]:
        """The logprobs an event (or a whole answer) holds: (where, the logprobs value, whether a stream's later events
        add to it); gateway/apis/logprobs.py reads what they spell."""
        for i, choice in enumerate(_array(event.get("choices"))):
            if isinstance(choice, dict) and choice.get("logprobs"):
                yield f"choices[{_index(choice.get('index'), i)}].logprobs", choice["logprobs"], True

    def where(self, channel: Hashable) -> str:
        """A channel, for people (verdicts say where they found what they found)."""
        if isinstance(channel, Arguments):
            number, call = channel.at if isinstance(channel.at, tuple) else (channel.at, FUNCTION_CALL)
            inner = FUNCTION_CALL if call == FUNCTION_CALL else f"tool_calls[{call}].function"
            return f"choices[{number}].{inner}.arguments"
        if isinstance(channel, tuple):  # a choice's reasoning or refusal
            return "choices[{}].{}".format(*channel)
        return f"choices[{channel}]"

    def read_after(self, before: Hashable, channel: Hashable) -> bool:
        """Whether a whole answer's client reads this channel's text run on from the one before it in the answer
        (a message's text blocks in a row); a chat choice is one text."""
        return False

    def body_texts(self, body: dict[str, Any]) -> Iterator[Text]:
        """The generated texts of a whole answer."""
        for i, choice in enumerate(_array(body.get("choices"))):
            if isinstance(choice, dict):
                yield from self._choice_texts(i, choice, None)

    def _choice_texts(self, number: int, choice: dict[str, Any], calls: StreamedCalls | None) -> Iterator[Text]:
        """A choice's answer text on the choice's channel; its reasoning (per field) and refusal on channels of
        their own; each tool call's arguments on the call's: a stream's calls as `calls` tells them apart, a
        message's by their place."""
        holder, key = _choice_text(choice)
        if holder is not None:
            yield number, holder, key
        for outer in ("delta", "message"):
            inner = choice.get(outer)
            if not isinstance(inner, dict):
                continue
            for field in (*(REASONING_FIELDS if self.reasoning else ()), REFUSAL):
                if isinstance(inner.get(field), str):
                    yield (number, field), inner, field
            for call, function in _calls(inner, calls):
                yield Arguments((number, call)), function, "arguments"


class ResponsesFormat(AnswerFormat):
    """OpenAI Responses: a Response object, or typed events ending in response.completed / incomplete / failed.

    A message's refusal parts are read as its output_text parts are (their delta and done events mirror
    output_text's, the text under `refusal`), and so is a reasoning item's text: its `reasoning_text` content parts
    on the content parts' channels, each summary part on a channel of its own. A function_call item's arguments are
    read on the item's channel: their deltas, the `.done` event's and the item's full copies; so are an mcp_call
    item's (a tool the provider calls on an MCP server) and an mcp_approval_request's (the call the client approves;
    whole items only, they are not streamed). A custom_tool_call item's `input` and a code_interpreter_call item's
    `code` likewise, on text channels (free text in the tool's own grammar, code: not JSON), and the texts of the calls
    that run commands (`_FREE_TEXT_ITEMS`): each shell_call command on a channel of its own, streamed in
    shell_call_command events (whose `.added` carries the command's first piece), an apply_patch_call's diff in
    apply_patch_call_operation_diff deltas; a local_shell_call or computer_call comes whole. An item's texts in its
    `output_item.added` event are the first piece of each (deltas append to them, as openai-python's stream reader
    reads them): an item that is not streamed is added whole."""

    _FINAL = ("response.completed", "response.incomplete", "response.failed")  # not a set: a `type` may not hash
    # the request's own settings, which a Response repeats (its instructions and tools were the input guard's)
    _ECHO = frozenset(
        {"instructions", "tools", "tool_choice", "text", "reasoning", "prompt", "metadata", "conversation", "include"}
        | {"truncation", "user", "safety_identifier", "prompt_cache_key", "prompt_cache_retention", "store"}
        | {"previous_response_id", "background", "billing"}
    )
    # ids, enums and names; an error event's code and param; opaque: encrypted reasoning, images and sound as base64,
    # the padding that obfuscates a stream's event sizes (openai-python's types/responses)
    INVENTORY = Inventory(
        identifiers=frozenset(
            {"type", "id", "object", "status", "role", "model", "call_id", "item_id", "approval_request_id"}
            | {"server_label", "created_by", "container_id", "file_id", "service_tier", "output_format", "quality"}
            | {"size"}
        ),
        opaque=frozenset({"encrypted_content", "partial_image_b64", "result", "obfuscation"}),
        opaque_paths={"response.audio.delta": frozenset({"delta"})},
        echoed={"": _ECHO | {f"response.{field}" for field in _ECHO}},
    )

    def record(self, usage: Usage, body: dict[str, Any]) -> None:
        """A delta of any text the model writes is output seen, reasoning, a refusal or a tool call's text as much as
        the answer: a stream cut before its usage keeps its completion reservation once the model generated any."""
        kind = body.get("type")
        if self._streamed(body, ".delta") is not None:
            usage.generated = True
        if kind in self._FINAL and isinstance(body.get("response"), dict):
            body = body["response"]
        if body.get("object") != "response":
            return
        _take_identity(usage, body)
        if body.get("output"):
            usage.generated = True
        details = body.get("incomplete_details")
        reason = details.get("reason") if isinstance(details, dict) else None
        if reason or body.get("status"):
            usage.finish_reasons.append(reason or body["status"])
        _take_usage(usage, body.get("usage"), ("input_tokens", "output_tokens"), _RESPONSES_DETAILS)

    def ends(self, data: bytes, event: dict[str, Any] | None) -> bool:
        return event is not None and (event.get("type") in self._FINAL or event.get("type") == "error")

    def is_event(self, name: bytes | None, data: bytes, event: dict[str, Any] | None) -> bool:
        """A typed event (a client dispatches it by its type); [DONE] too, which OpenAI's clients take as the end
        of any stream."""
        return _is_typed(name, event) if event is not None else data == b"[DONE]"

    def is_error(self, event: dict[str, Any]) -> bool:
        return event.get("type") in ("error", "response.failed")

    def texts(self, event: dict[str, Any]) -> Iterator[Text]:
        streamed = self._streamed(event, ".delta")
        if streamed is not None and isinstance(event.get("delta"), str):
            yield streamed[0], event, "delta"
        # a text's first piece where an added event carries it (an empty one, all still to come, holds nothing back)
        added = self._streamed(event, ".added")
        if added is not None and _holds_text(event, added[1]) and event[added[1]]:
            yield added[0], event, added[1]
        if event.get("type") == "response.output_item.added" and isinstance(event.get("item"), dict):
            texts = _item_texts(_index(event.get("output_index")), event["item"])
            yield from ((channel, holder, key) for channel, holder, key in texts if holder[key])

    def ended(self, event: dict[str, Any]) -> Iterator[Hashable]:
        """A streamed text's done event ends it; an item's done event ends all of its texts, and its added event the
        texts it carries (what is streamed starts empty there: a text the added event holds comes whole, such as an
        apply_patch_call's path, and waiting for its item's end held back the diff streamed after it)."""
        streamed = self._streamed(event, ".done")
        kind, item = event.get("type"), event.get("item")
        if streamed is not None:
            yield streamed[0]
        elif kind == "response.output_item.done" and isinstance(item, dict):
            yield from (channel for channel, _, _ in _item_texts(_index(event.get("output_index")), item))
        elif kind == "response.output_item.added" and isinstance(item, dict):
            texts = _item_texts(_index(event.get("output_index")), item)
            yield from (channel for channel, holder, key in texts if holder[key])

    def _streamed(self, event: dict[str, Any], suffix: str) -> tuple[Hashable, str] | None:
        """A streamed text's event's channel and the key of its text in the done and added events; None for other
        events."""
        kind = event.get("type")
        if not isinstance(kind, str) or not kind.endswith(suffix):
            return None
        found = _STREAMED.get(kind.removesuffix(suffix))
        if found is None:
            return None
        channel, key = found
        return channel(event), key

    def logprobs(self, event: dict[str, Any]) -> Iterator[tuple[str, Any, bool]]:
        """An output_text part's logprobs: a text event's (a `.delta`'s add to the part's; a `.done`'s are a whole
        copy), and those of the parts an event's part, item or response holds (or a whole answer's output)."""
        if event.get("logprobs"):
            place = (
                f"output_index={_index(event.get('output_index'))} content_index={_index(event.get('content_index'))}"
            )
            yield f"{place} logprobs", event["logprobs"], event.get("type") == "response.output_text.delta"
        part, item, response = event.get("part"), event.get("item"), event.get("response")
        if isinstance(part, dict) and part.get("logprobs"):
            yield "part.logprobs", part["logprobs"], False
        items = [item] if isinstance(item, dict) else _array(event.get("output"))
        if isinstance(response, dict):
            items = _array(response.get("output"))
        for i, output in enumerate(items):
            for j, content in enumerate(_array(output.get("content")) if isinstance(output, dict) else ()):
                if isinstance(content, dict) and content.get("logprobs"):
                    yield f"output[{i}].content[{j}].logprobs", content["logprobs"], False

    def snapshots(self, event: dict[str, Any]) -> Iterator[Text]:
        kind = event.get("type")
        streamed = self._streamed(event, ".done")
        if streamed is not None and isinstance(event.get(streamed[1]), str):
            yield streamed[0], event, streamed[1]
        elif kind == "response.content_part.done" and (key := _content_key(event.get("part"))):
            yield _part(event), event["part"], key
        elif kind == "response.reasoning_summary_part.done" and _is_text(event.get("part"), "summary_text"):
            yield _summary(event), event["part"], "text"
        elif kind == "response.output_item.done" and isinstance(event.get("item"), dict):
            yield from _item_texts(_index(event.get("output_index")), event["item"])
        elif kind in self._FINAL and isinstance(event.get("response"), dict):
            yield from self.body_texts(event["response"])

    def body_texts(self, body: dict[str, Any]) -> Iterator[Text]:
        for i, item in enumerate(_array(body.get("output"))):
            if isinstance(item, dict):
                yield from _item_texts(i, item)

    def read_after(self, before: Hashable, channel: Hashable) -> bool:
        """A content part right after another of the same item (a message's output_text parts, a reasoning item's
        content): the client reads the two as one text."""
        return type(before) is tuple and type(channel) is tuple and channel == (before[0], before[1] + 1)

    def where(self, channel: Hashable) -> str:
        if isinstance(channel, _Summary):
            return f"output[{channel.item}].summary[{channel.part}]"
        if isinstance(channel, Arguments):
            return f"output[{channel.at}].arguments"
        if isinstance(channel, _ItemText):
            return f"output[{channel.item}].{channel.path}"
        item, part = channel if isinstance(channel, tuple) else (channel, 0)
        return f"output[{item}].content[{part}]"


class MessagesFormat(AnswerFormat):
    """Anthropic Messages: a Message object, or events from message_start to message_stop.

    Thinking blocks are read as text blocks are. Redacting one leaves its signature unmatched (Anthropic then
    refuses it sent back in a later turn): the policy's choice, over letting what it redacts reach the client. A
    tool_use block's input is read on the block's `Arguments` channel: its input_json_delta fragments in a stream,
    the JSON of its `input` object in a whole answer. So is the input of a call to a tool Anthropic runs (a
    server_tool_use block: web search, code execution; an mcp_tool_use block: an MCP server's tool), which the
    client gets as it gets a tool_use block."""

    _BLOCKS = {"text": "text", "thinking": "thinking"}  # a block's type -> the key of its text
    # ids, enums and names (the request's stop sequence that matched); opaque: a thinking block's signature,
    # redacted thinking, encrypted search results (anthropic-sdk-python's types)
    INVENTORY = Inventory(
        identifiers=frozenset(
            {"type", "id", "role", "model", "stop_reason", "stop_sequence", "tool_use_id", "container", "page_age"}
            | {"media_type", "file_id"}
        ),
        opaque=frozenset({"signature", "data", "encrypted_content", "encrypted_index"}),
    )
    _CALLS = ("tool_use", "server_tool_use", "mcp_tool_use")  # blocks whose `input` is the model's call
    _DELTAS = {"text_delta": "text", "thinking_delta": "thinking"}  # a block delta's type -> the key of its text

    def record(self, usage: Usage, body: dict[str, Any]) -> None:
        kind = body.get("type")
        if kind == "message_start" and isinstance(body.get("message"), dict):
            body = body["message"]
            kind = "message"
        if kind == "message":
            _take_identity(usage, body)
        if kind == "content_block_delta" or (kind == "message" and body.get("content")):
            usage.generated = True
        delta = body.get("delta") if kind == "message_delta" else body
        reason = delta.get("stop_reason") if isinstance(delta, dict) and kind in ("message", "message_delta") else None
        if reason:
            usage.finish_reasons.append(reason)
        reported = body.get("usage")
        if not isinstance(reported, dict) or kind not in ("message", "message_delta"):
            return
        if isinstance(reported.get("output_tokens"), int):
            usage.completion_tokens = reported["output_tokens"]
        if isinstance(reported.get("input_tokens"), int):  # Anthropic's input_tokens leave out cached tokens
            cached = [reported.get(k) for k in ("cache_read_input_tokens", "cache_creation_input_tokens")]
            usage.prompt_tokens = reported["input_tokens"] + sum(c for c in cached if isinstance(c, int))
            if isinstance(cached[0], int):
                usage.cached_tokens = cached[0]

    def ends(self, data: bytes, event: dict[str, Any] | None) -> bool:
        return event is not None and event.get("type") in ("message_stop", "error")

    def is_event(self, name: bytes | None, data: bytes, event: dict[str, Any] | None) -> bool:
        """A typed event, and nothing else: Anthropic's streams have no [DONE]."""
        return event is not None and _is_typed(name, event)

    def is_error(self, event: dict[str, Any]) -> bool:
        return event.get("type") == "error"

    def texts(self, event: dict[str, Any]) -> Iterator[Text]:
        """A block delta's text; a block's start, and message_start's message, carry the first piece of their
        blocks' texts (what the SDK's accumulator starts each block from): empty from Anthropic, not from everyone."""
        kind, delta = event.get("type"), event.get("delta")
        if kind == "content_block_delta" and isinstance(delta, dict):
            key = self._DELTAS.get(str(delta.get("type")))
            if key is not None and isinstance(delta.get(key), str):
                yield _index(event.get("index")), delta, key
            elif delta.get("type") == "input_json_delta" and isinstance(delta.get("partial_json"), str):
                yield Arguments(_index(event.get("index"))), delta, "partial_json"
        elif kind == "content_block_start" and isinstance(event.get("content_block"), dict):
            yield from self._block_texts(_index(event.get("index")), event["content_block"])
        elif kind == "message_start" and isinstance(event.get("message"), dict):
            yield from self.body_texts(event["message"])

    def ended(self, event: dict[str, Any]) -> Iterator[Hashable]:
        if event.get("type") == "content_block_stop":
            yield from (_index(event.get("index")), Arguments(_index(event.get("index"))))

    def body_texts(self, body: dict[str, Any]) -> Iterator[Text]:
        for i, block in enumerate(_array(body.get("content"))):
            if isinstance(block, dict):
                yield from self._block_texts(i, block)

    def _block_texts(self, index: int, block: dict[str, Any]) -> Iterator[Text]:
        """A content block's text or thinking on its channel; a call's input, read as its JSON, on its `Arguments`
        channel (an empty one, as a stream's block starts, holds nothing)."""
        key = self._BLOCKS.get(str(block.get("type")))
        if key is not None and isinstance(block.get(key), str):
            yield index, block, key
        elif block.get("type") in self._CALLS and "input" in block and block["input"] != {}:
            yield Arguments(index), _AsJson(block, "input"), "json"

    def where(self, channel: Hashable) -> str:
        if isinstance(channel, Arguments):
            return f"content[{channel.at}].input"
        return f"content[{channel}]"

    def read_after(self, before: Hashable, channel: Hashable) -> bool:
        """A text or thinking block right after another: the client reads the two as one text."""
        return type(before) is int and type(channel) is int and channel == before + 1


class TokenCountFormat(AnswerFormat):
    """Anthropic's count_tokens answer: counting a prompt sends it to no model, so it is charged no tokens."""

    def record(self, usage: Usage, body: dict[str, Any]) -> None:
        usage.prompt_tokens = usage.completion_tokens = 0


# where an OpenAI usage object details its prompt's cached tokens and its completion's reasoning tokens
_CHAT_DETAILS = ("prompt_tokens_details", "completion_tokens_details")
_RESPONSES_DETAILS = ("input_tokens_details", "output_tokens_details")


def _take_usage(usage: Usage, reported: Any, counts: tuple[str, str], details: tuple[str, str]) -> None:
    """An OpenAI usage object's counts (prompt, completion), the prompt's cached tokens and the reasoning tokens among
    the completion's; chat and Responses name the same fields differently."""
    if not isinstance(reported, dict):
        return
    usage.prompt_tokens = reported.get(counts[0])
    usage.completion_tokens = reported.get(counts[1])
    cached = reported.get(details[0])
    if isinstance(cached, dict):
        usage.cached_tokens = cached.get("cached_tokens")
    inner = reported.get(details[1])
    count = inner.get("reasoning_tokens") if isinstance(inner, dict) else None
    if isinstance(count, int) and not isinstance(count, bool):
        usage.reasoning_tokens = count


_MAX_IDENTITY = 256


def _take_identity(usage: Usage, body: dict[str, Any]) -> None:
    """The answer's id and the model that wrote it, where the upstream names them (for traces), cut to
    `_MAX_IDENTITY` characters: the upstream's strings, kept for as long as the request runs."""
    if usage.response_id is None and isinstance(answer_id := body.get("id"), str) and answer_id:
        usage.response_id = answer_id[:_MAX_IDENTITY]
    if usage.response_model is None and isinstance(model := body.get("model"), str) and model:
        usage.response_model = model[:_MAX_IDENTITY]


def _is_typed(name: bytes | None, event: dict[str, Any]) -> bool:
    """An event of a typed stream (Responses, Messages): its `type` a string, and the SSE type it was sent under the
    same, where it names one (clients dispatch by either: Anthropic's by the SSE type, OpenAI's by the data's)."""
    kind = event.get("type")
    return isinstance(kind, str) and (name is None or name == kind.encode())


_MAX_TOKENS = 2**31  # no context window comes near it; 2^64 - 1 would overflow the spend store's 64-bit columns


def token_count(reported: object) -> int | None:
    """A token count as an upstream reported it, if it is one (a whole number, not negative, below what no request
    can reach: past it, the number is not a count)."""
    if isinstance(reported, bool) or not isinstance(reported, int):
        return None
    return reported if 0 <= reported < _MAX_TOKENS else None


def _carries_output(choice: object) -> bool:
    """Whether a choice holds generated output (text, content, a tool call, reasoning), not just its role: token
    limits charge an unreported completion only once output was seen."""
    if not isinstance(choice, dict):
        return False
    if choice.get("text"):
        return True
    part = choice.get("delta") or choice.get("message")
    if isinstance(part, dict):
        for key, value in part.items():  # a loop, not any() over a generator: this runs for every answer
            if value and key != "role":
                return True
    return False


def _answer_started(delta: Any) -> bool:
    """Whether a chat delta carries the answer (content, a refusal, a tool call) and no more reasoning."""
    if not isinstance(delta, dict):
        return False
    for field in REASONING_FIELDS:  # loops, not any(): this runs for every chunk of a stream
        if delta.get(field):
            return False
    return bool(delta.get("content") or delta.get("refusal") or delta.get("tool_calls"))


def _calls(message: dict[str, Any], streamed: StreamedCalls | None) -> Iterator[tuple[int | str, dict[str, Any]]]:
    """A chat message's (or delta's) tool calls with arguments: (the call's number, the dict holding its arguments),
    the legacy function_call as FUNCTION_CALL. A delta's fragments are numbered by the stream's calls so far (each
    fragment counts, with arguments or not: a call's first may name it and hold none), a message's by their place."""
    for j, call in enumerate(_array(message.get("tool_calls"))):
        if not isinstance(call, dict):
            continue
        number = streamed.number(call)[0] if streamed is not None else j
        if _holds_text(call.get("function"), "arguments"):
            yield number, call["function"]
    if _holds_text(message.get(FUNCTION_CALL), "arguments"):
        yield FUNCTION_CALL, message[FUNCTION_CALL]


def _holds_text(holder: Any, key: str) -> bool:
    return isinstance(holder, dict) and isinstance(holder.get(key), str)


def _choice_text(choice: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
    """The dict and key holding a choice's text: delta.content, message.content or text."""
    for outer in ("delta", "message"):
        inner = choice.get(outer)
        if isinstance(inner, dict) and isinstance(inner.get("content"), str):
            return inner, "content"
    if isinstance(choice.get("text"), str):
        return choice, "text"
    return None, ""


class _AsJson(dict[str, Any]):
    """A JSON value (a tool_use block's `input` object) as a text holder: `json` is its JSON text, and setting it (a
    redaction) parses it back into its owner, so the client still gets an object. Text that no longer parses (a
    redaction can't break it; see the guard) would leave `{}`: never what was redacted."""

    def __init__(self, owner: dict[str, Any], key: str) -> None:
        super().__init__(json=json.dumps(owner[key], ensure_ascii=False))
        self._owner, self._key = owner, key

    @property
    def place(self) -> Place:
        """Where the value it stands for is held: every string in it is this text's."""
        return id(self._owner), self._key

    def __setitem__(self, key: str, text: Any) -> None:
        super().__setitem__(key, text)
        try:
            self._owner[self._key] = json.loads(text)
        except ValueError:
            self._owner[self._key] = {}


@dataclass(frozen=True, slots=True)
class _Summary:
    """A Responses reasoning item's summary part, as a channel: not a tuple, never equal to a content part's."""

    item: int
    part: int


@dataclass(frozen=True, slots=True)
class _ItemText:
    """A Responses tool call item's free text, as a channel: text an agent or a tool runs (a custom tool's `input`, in
    the tool's own grammar; code interpreter's `code`; a shell command), not JSON, so not an `Arguments` channel.
    `path` is where it is in the item (`action.command[2]`)."""

    item: int
    path: str


# the items whose `arguments` are JSON text (a tuple, not a set: a `type` may not hash)
_ARGUMENT_ITEMS = ("function_call", "mcp_call", "mcp_approval_request")
# a tool call item's type -> where its free texts are: `a.b` a member's member, `a[]` each string of an array, `a{}`
# each string value of an object. From openai-python's types/responses: response_custom_tool_call.py,
# response_code_interpreter_tool_call.py, response_output_item.py (LocalShellCall's exec action),
# response_function_shell_tool_call.py (shell_call), response_apply_patch_tool_call.py (its create_file,
# update_file, delete_file operations), response_computer_tool_call.py (a `type` action's text; `actions` batches them)
_FREE_TEXT_ITEMS = {
    "custom_tool_call": ("input",),
    "code_interpreter_call": ("code",),
    "local_shell_call": ("action.command[]", "action.env{}", "action.working_directory"),
    "shell_call": ("action.commands[]",),
    "apply_patch_call": ("operation.diff", "operation.path"),
    "computer_call": ("action.text", "actions[].text"),
}


# a content part's type -> the key of its text: a message's answer and refusal parts, a reasoning item's text
_CONTENT_TEXTS = {"output_text": "text", "refusal": "refusal", "reasoning_text": "text"}


def _content_key(part: Any) -> str | None:
    """The key of a content part's text; None for a part with none (an image, a part of the wrong shape)."""
    key = _CONTENT_TEXTS.get(str(part.get("type"))) if isinstance(part, dict) else None
    return key if key is not None and isinstance(part.get(key), str) else None


def _part(event: dict[str, Any]) -> Hashable:
    return _index(event.get("output_index")), _index(event.get("content_index"))


def _summary(event: dict[str, Any]) -> Hashable:
    return _Summary(_index(event.get("output_index")), _index(event.get("summary_index")))


def _call_arguments(event: dict[str, Any]) -> Hashable:
    return Arguments(_index(event.get("output_index")))


def _item_text(path: str) -> Callable[[dict[str, Any]], Hashable]:
    """The channel of an item's free text at `path`, for its delta and done events."""
    return lambda event: _ItemText(_index(event.get("output_index")), path)


def _shell_command(event: dict[str, Any]) -> Hashable:
    return _ItemText(_index(event.get("output_index")), f"action.commands[{_index(event.get('command_index'))}]")


# a streamed text's events (+ .delta / .done; a shell command's also .added) -> the channel an event is on, and the
# key of the done (and added) event's copy. Named as openai-python's types/responses/response_*_event.py name them;
# the apply_patch_call diff's, which it lacks, as OpenAI's streaming reference and openai-php's client do
# (src/Responses/Responses/Streaming/ApplyPatchCallOperationDiffDelta.php, ...Done.php: `delta`, then `diff`)
_STREAMED: dict[str, tuple[Callable[[dict[str, Any]], Hashable], str]] = {
    "response.output_text": (_part, "text"),
    "response.refusal": (_part, "refusal"),
    "response.reasoning_text": (_part, "text"),
    "response.reasoning_summary_text": (_summary, "text"),
    "response.function_call_arguments": (_call_arguments, "arguments"),
    "response.mcp_call_arguments": (_call_arguments, "arguments"),
    "response.custom_tool_call_input": (_item_text("input"), "input"),
    "response.code_interpreter_call_code": (_item_text("code"), "code"),
    "response.shell_call_command": (_shell_command, "command"),
    "response.apply_patch_call_operation_diff": (_item_text("operation.diff"), "diff"),
}


def _array(value: Any) -> list[Any]:
    """An upstream's array field, as a list: empty, whatever else the upstream sent."""
    return value if isinstance(value, list) else []


def _index(value: Any, default: int = 0) -> int:
    """An upstream's index field, as a channel key: an int, whatever the upstream sent."""
    return value if isinstance(value, int) else default


def _is_text(part: Any, *types: str) -> bool:
    return isinstance(part, dict) and part.get("type") in types and isinstance(part.get("text"), str)


def _item_texts(index: int, item: dict[str, Any]) -> Iterator[Text]:
    """An output item's texts: a message's or a reasoning item's content parts, a reasoning item's summary parts, a
    tool call's arguments or free text."""
    for j, part in enumerate(_array(item.get("content"))):
        if key := _content_key(part):
            yield (index, j), part, key
    for j, part in enumerate(_array(item.get("summary"))):
        if _is_text(part, "summary_text"):
            yield _Summary(index, j), part, "text"
    if item.get("type") in _ARGUMENT_ITEMS and _holds_text(item, "arguments"):
        yield Arguments(index), item, "arguments"
    patterns = _FREE_TEXT_ITEMS.get(item["type"], ()) if isinstance(item.get("type"), str) else ()
    for pattern in patterns:
        for path, holder, place in _strings_at(item, pattern):
            yield _ItemText(index, path), holder, place


def _strings_at(holder: dict[str, Any], pattern: str, path: str = "") -> Iterator[tuple[str, Holder, str | int]]:
    """The strings `pattern` names in an item (see `_FREE_TEXT_ITEMS`): each one's path, and its holder and key."""
    step, _, rest = pattern.partition(".")
    name = step.removesuffix("[]").removesuffix("{}")
    value = holder.get(name)
    here = f"{path}.{name}" if path else name
    places: list[tuple[str, Holder, str | int]]
    if step.endswith("[]"):
        places = [(f"{here}[{i}]", _array(value), i) for i in range(len(_array(value)))]
    elif step.endswith("{}"):
        places = [(f"{here}.{key}", value, key) for key in value] if isinstance(value, dict) else []
    else:
        places = [(here, holder, name)] if name in holder else []
    for where, inner, key in places:
        if not rest and isinstance(inner[key], str):
            yield where, inner, key
        elif rest and isinstance(inner[key], dict):
            yield from _strings_at(inner[key], rest, where)
