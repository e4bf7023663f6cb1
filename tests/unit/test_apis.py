"""Request shapes: which texts a model reads (with roles and places), what the WAF keeps out of `args`, how each
shape is counted, and how each answer format reports usage."""

from __future__ import annotations

import json

import pytest

from gateway.apis.answers import AnswerFormat, MessagesFormat, ResponsesFormat
from gateway.apis.routes import BY_NAME, BY_PATH, ROUTE_NAMES
from gateway.apis.untrusted import Identifier, place_of
from gateway.context import Usage
from gateway.errors import GatewayError
from gateway.guard.inputs import request_texts
from gateway.guard.spec import INJECTION_ROLES
from gateway.waf.parts import RequestView

SQLI = "1' UNION SELECT password FROM users--"

RESPONSES_REQUEST = {
    "model": "m",
    "instructions": "Be brief.",
    "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Find order 7."}, {"type": "input_image"}]},
        {"type": "function_call", "call_id": "c1", "name": "lookup", "arguments": '{"q": "x"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "order 7: shipped"},
        {
            "type": "reasoning",
            "summary": [{"type": "summary_text", "text": "Use the lookup tool."}],
            "encrypted_content": "gAAAA" + "x" * 40,
        },
    ],
    "tools": [{"type": "function", "name": "lookup", "description": "Looks up an order."}],
    "metadata": {"ref": SQLI},
}

MESSAGES_REQUEST = {
    "model": "m",
    "max_tokens": 16,
    "system": [{"type": "text", "text": "Be brief."}],
    "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "w", "input": {"city": "Paris"}}]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "sunny"}]},
                {"type": "text", "text": "Thanks."},
            ],
        },
    ],
    "tools": [{"name": "w", "description": "Weather by city.", "input_schema": {"type": "object"}}],
    "metadata": {"user_id": SQLI},
}


def never_decoded(ids: list[int], where: str) -> None:
    raise AssertionError("no token ids here")


def test_every_route_name_is_a_policy_route_name() -> None:
    assert set(BY_NAME) == set(ROUTE_NAMES)
    assert {api.path for api in BY_PATH.values()} >= {"/v1/responses", "/v1/embeddings", "/v1/messages"}


def test_responses_texts_have_the_provenances_the_guard_reads_them_by() -> None:
    api = BY_NAME["responses"]
    api.check(RESPONSES_REQUEST)
    roles = {"system", "user", "tool", "tool_definitions"}
    inventory = api.inventory(RESPONSES_REQUEST)
    found = [(t.text, t.provenance, t.where) for t in request_texts(inventory, roles, never_decoded)]
    assert found == [
        ("Be brief.", "system", "instructions"),
        ("Find order 7.", "user", "input[0].content[0]"),
        ("order 7: shipped", "tool_result", "input[2].output"),
        ("Looks up an order.", "tool_definitions", "tools[0].description"),
    ], "the roles a policy names select the provenances it reads"
    every = [(t.text, t.provenance) for t in request_texts(inventory, INJECTION_ROLES, never_decoded)]
    assert ("x", "tool_arguments") in every and ("Use the lookup tool.", "reasoning") in every, (
        "by default the guard reads the earlier turns the client sends back too: a forged history is input"
    )


def test_messages_texts_read_tool_results_by_their_provenance() -> None:
    api = BY_NAME["messages"]
    api.check(MESSAGES_REQUEST)
    texts = [(t.text, t.provenance) for t in api.inventory(MESSAGES_REQUEST).texts()]
    assert texts == [
        ("Be brief.", "system"),
        ("Weather in Paris?", "user"),
        ("Paris", "tool_arguments"),
        ("sunny", "tool_result"),
        ("Thanks.", "user"),
        ("Weather by city.", "tool_definitions"),
    ]


@pytest.mark.parametrize(
    ("route", "payload", "prompt_text"),
    [
        ("responses", RESPONSES_REQUEST, "order 7: shipped"),
        ("messages", MESSAGES_REQUEST, "sunny"),
        ("embeddings", {"model": "m", "input": ["alpha", "beta"], "user": SQLI}, "beta"),
    ],
)
def test_the_waf_keeps_prompt_text_out_of_args_but_not_application_fields(route, payload, prompt_text) -> None:
    view = RequestView(route=route, payload=payload)
    args = [text for _, text, _ in view.values("args")]
    prompt = [text for _, text, _ in view.values("prompt")]
    assert SQLI in args, "an application field is an argument on every route"
    assert prompt_text in prompt and prompt_text not in args
    assert not any(text.startswith("gAAAA") for text in args), "a reasoning item's encrypted state is not an argument"


def test_a_request_on_no_known_route_has_no_prompt() -> None:
    view = RequestView(route="", payload={"messages": [{"role": "user", "content": "hello"}]})
    assert view.values("prompt") == [] and "hello" in [text for _, text, _ in view.values("args")]


@pytest.mark.parametrize(
    ("route", "payload", "param"),
    [
        ("responses", {"model": "m", "input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        ("responses", {"model": "m", "input": [{"type": "function_call", "name": "f"}]}, "input[0].call_id"),
        ("responses", {"model": "m", "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ("responses", {"model": "m", "input": "x", "tools": [{"type": "function"}]}, "tools[0].name"),
        ("embeddings", {"model": "m", "input": "x", "encoding_format": "hex"}, "encoding_format"),
        ("embeddings", {"model": "m", "input": ["x"] * 2049}, "input"),
        ("messages", {"model": "m", "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        (
            "messages",
            {
                "model": "m",
                "max_tokens": 1,
                "messages": [{"role": "user", "content": "x"}],
                "tool_choice": {"type": "any"},
            },
            "tool_choice",
        ),
    ],
)
def test_bad_requests_name_the_field(route, payload, param) -> None:
    with pytest.raises(GatewayError) as info:
        BY_NAME[route].check(payload)
    assert info.value.status == 400 and info.value.param == param


def test_messages_only_an_anthropic_pool_serves_are_still_counted() -> None:
    body = {**MESSAGES_REQUEST, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}
    BY_NAME["messages"].check(body)
    form, messages = BY_NAME["messages"].counted(body)
    assert form == "chat" and "Weather in Paris?" in messages[0]["content"] and "sunny" in messages[0]["content"]


def test_count_tokens_needs_no_max_tokens() -> None:
    api = BY_NAME["count_tokens"]
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    api.check(body)
    assert api.counted(body) == ("chat", [{"role": "user", "content": "hi"}])


def test_answer_formats_report_usage_as_limits_settle_it() -> None:
    chat = Usage()
    AnswerFormat().record(
        chat, {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4, "prompt_tokens_details": {}}}
    )
    assert (chat.prompt_tokens, chat.completion_tokens) == (9, 4)

    responses = Usage()
    final = {
        "object": "response",
        "status": "incomplete",
        "incomplete_details": {"reason": "max_output_tokens"},
        "output": [{"type": "message", "content": [{"type": "output_text", "text": "hi"}]}],
        "usage": {"input_tokens": 12, "output_tokens": 5, "input_tokens_details": {"cached_tokens": 8}},
    }
    fmt = ResponsesFormat()
    fmt.record(responses, {"type": "response.incomplete", "response": final})
    assert (responses.prompt_tokens, responses.completion_tokens, responses.cached_tokens) == (12, 5, 8)
    assert responses.finish_reasons == ["max_output_tokens"] and responses.generated
    assert fmt.ends(b"", {"type": "response.incomplete"}) and not fmt.ends(b"", {"type": "response.created"})

    anthropic = Usage()
    fmt = MessagesFormat()
    start = {"type": "message_start", "message": {"usage": {"input_tokens": 3, "cache_read_input_tokens": 40}}}
    fmt.record(anthropic, start)
    fmt.record(anthropic, {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "x"}})
    fmt.record(
        anthropic, {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 7}}
    )
    assert (anthropic.prompt_tokens, anthropic.cached_tokens, anthropic.completion_tokens) == (43, 40, 7)
    assert anthropic.finish_reasons == ["end_turn"] and anthropic.generated
    assert fmt.ends(b"", {"type": "message_stop"})


def test_each_answer_format_knows_its_stream_events() -> None:
    """The envelope a client reads an event by: a JSON object (chat), typed by its `type` (Responses, Messages),
    under the same SSE type where one is named; [DONE] ends OpenAI's streams, never Anthropic's. A field of the wrong
    type inside is the upstream's to answer for, and still an event."""

    def event(fmt: AnswerFormat, data: bytes, name: bytes | None = None) -> bool:
        parsed = json.loads(data) if data != b"[DONE]" else None
        return fmt.is_event(name, data, parsed if isinstance(parsed, dict) else None)

    chat, responses, messages = AnswerFormat(), ResponsesFormat(), MessagesFormat()
    assert event(chat, b'{"choices": 5}') and event(chat, b"[DONE]")
    assert not event(chat, b"[1, 2]") and not event(chat, b'"text"')
    for typed in (responses, messages):
        assert event(typed, b'{"type": "ping"}') and event(typed, b'{"type": "ping"}', b"ping")
        assert not event(typed, b'{"delta": "x"}') and not event(typed, b'{"type": ["ping"]}')
        assert not event(typed, b'{"type": "ping"}', b"message_stop")
    assert event(responses, b"[DONE]") and not event(messages, b"[DONE]")


@pytest.mark.parametrize(
    "kind",
    [
        "response.output_text",
        "response.refusal",
        "response.reasoning_text",
        "response.reasoning_summary_text",
        "response.function_call_arguments",
        "response.mcp_call_arguments",
        "response.custom_tool_call_input",
        "response.code_interpreter_call_code",
    ],
)
def test_every_text_a_responses_model_writes_is_output_seen(kind: str) -> None:
    """A stream cut before response.completed is billed its completion reservation once output was seen: reasoning,
    a refusal, a tool call's text are output the model generated as much as the answer is."""
    usage = Usage()
    ResponsesFormat().record(usage, {"type": "response.created", "response": {"object": "response", "output": []}})
    assert not usage.generated
    ResponsesFormat().record(usage, {"type": f"{kind}.delta", "output_index": 0, "delta": "x"})
    assert usage.generated


def untrusted_strings(answers: AnswerFormat, event: dict, whole: bool = False) -> dict[str, str]:
    """{where: string} of what a format's readers leave to the guard: untrusted text, and identifiers (`id:` …)."""
    known = {place_of(holder, key) for _, holder, key in (answers.body_texts if whole else answers.texts)(event)}
    return {
        ("id: " if isinstance(c, Identifier) else "") + f"{c.kind} {c.path}".strip(): holder[key]
        for c, holder, key in answers.untrusted(event, known, whole=whole)
        if not is_key(c)
    }


def is_key(channel: object) -> bool:
    return isinstance(channel, Identifier) and channel.path.endswith(" key")


def test_every_key_of_an_answer_is_read_as_an_identifier_once() -> None:
    """A field's name reaches the client as surely as its value: each distinct one is read, once."""
    chunk = {"id": "c1", "choices": [{"index": 0, "delta": {"content": "hi", "note_AKIA": 1}, "logprobs": None}]}
    read = [holder[key] for c, holder, key in AnswerFormat().untrusted(chunk, set()) if is_key(c)]
    assert sorted(read) == sorted(["id", "choices", "index", "delta", "content", "note_AKIA", "logprobs"])
    seen = {"id", "choices", "index", "delta", "content", "logprobs"}
    assert [holder[key] for c, holder, key in AnswerFormat().untrusted(chunk, set(), seen) if is_key(c)] == [
        "note_AKIA"
    ]


def test_every_string_no_reader_takes_is_read_as_untrusted_text_or_as_an_identifier() -> None:
    """A new event type, a field a server added, a tool's name: untrusted text. Ids, enums and names: identifiers.
    Not read: the request's own settings that a Response repeats, and opaque fields while they hold base64."""
    unknown = {
        "type": "response.hologram.delta",
        "item_id": "h_1",
        "output_index": 2,
        "delta": "beam",
        "sequence_number": 4,
    }
    assert untrusted_strings(ResponsesFormat(), unknown) == {
        "id: response.hologram.delta output_index=2 type": "response.hologram.delta",
        "id: response.hologram.delta output_index=2 item_id": "h_1",
        "response.hologram.delta output_index=2 delta": "beam",
    }
    created = {
        "type": "response.created",
        "response": {"id": "resp_1", "instructions": "be brief", "tools": [{"name": "f"}], "obfuscation": "Zm9v"},
    }
    assert untrusted_strings(ResponsesFormat(), created) == {
        "id: response.created type": "response.created",
        "id: response.created response.id": "resp_1",
    }
    chunk = {
        "id": "c1",
        "choices": [
            {"index": 1, "delta": {"content": "hi", "hologram": "beam"}, "logprobs": {"content": [{"token": "hi"}]}}
        ],
    }
    assert untrusted_strings(AnswerFormat(), chunk) == {
        "id: id": "c1",
        "choices[1].delta.hologram": "beam",
        "choices[1].logprobs.content[].token": "hi",
    }
    blocks = {
        "content": [{"type": "hologram", "hologram": "beam", "signature": "c2ln"}, {"signature": "not base64!"}],
        "container": {"id": "container_1", "expires_at": "2026-12-06"},  # an identifier's object: all it holds
    }
    assert untrusted_strings(MessagesFormat(), blocks, whole=True) == {
        "id: content[0].type": "hologram",
        "content[0].hologram": "beam",
        "content[1].signature": "not base64!",
        "id: container.id": "container_1",
        "id: container.expires_at": "2026-12-06",
    }
    seen = {"container_1"}
    known: set = set()
    assert [
        c.path
        for c, _, _ in MessagesFormat().untrusted(blocks, known, seen, whole=True)
        if "container" in c.path and not is_key(c)
    ] == ["container.expires_at"], "an identifier's value already read is not given again"
