"""The response cache's parts in process: what identifies an answer, which requests it serves, the memory store's
bounds, the way between a stored answer and its stream (replayed, then assembled again, an answer comes back as it
was), and the semantic match's buckets and index."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import numpy as np
import pytest

from gateway.apis.answers import AnswerFormat, MessagesFormat, ResponsesFormat
from gateway.cache.assemble import Assembly, complete
from gateway.cache.key import bypass_reason, cache_key, deterministic, refused_by_client
from gateway.cache.replay import CHAT, COMPLETIONS, MESSAGES, RESPONSES, replayed
from gateway.cache.semantic import MAX_CANDIDATES, SemanticIndex, bucket_key, embedding_of, last_user_text
from gateway.cache.stores import MemoryStore
from gateway.cache.wording import MAX_WORD_CHARS, MAX_WORDS, Wording
from gateway.context import Usage
from gateway.policy.loader import load_policy_dir
from gateway.policy.model import CacheSpec
from gateway.streaming.sse import read_event

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0, "user": "u1"}


def key(payload: dict[str, Any], tenant: str = "acme", route: str = "chat", pool: str = "p", beta: str | None = None):
    return cache_key(tenant, route, pool, payload, beta)


def test_the_key_ignores_transport_fields_and_key_order_only():
    base = key(BODY)
    assert key({**BODY, "stream": True, "stream_options": {"include_usage": True}}) == base
    assert key(dict(reversed(list(BODY.items())))) == base
    assert key({**BODY, "messages": [{"content": "hi", "role": "user"}]}) == base
    for changed in ({"user": "u2"}, {"cache_salt": "x"}, {"temperature": 0.0}, {"max_tokens": 5}, {"model": "n"}):
        assert key({**BODY, **changed}) != base, changed
    assert {
        key(BODY, tenant="other"),
        key(BODY, route="responses"),
        key(BODY, pool="q"),
        key(BODY, beta="b"),
    }.isdisjoint({base})
    # the parts are length-prefixed: moving characters from one part to the next makes another key
    assert key(BODY, tenant="ab", pool="c") != key(BODY, tenant="a", pool="bc")


def test_a_body_with_no_canonical_form_has_no_key():
    assert key({**BODY, "seed": 2**70}) is None


@pytest.mark.parametrize(
    ("route", "payload", "expected"),
    [
        ("chat", {"temperature": 0}, True),
        ("chat", {"temperature": 0.0}, True),
        ("chat", {"seed": 7}, True),
        ("chat", {}, False),  # the API's default temperature is 1
        ("chat", {"temperature": 0.2}, False),
        ("chat", {"temperature": False}, False),
        ("chat", {"seed": True}, False),
        ("messages", {"seed": 7}, False),  # Anthropic has no seed
        ("messages", {"temperature": 0}, True),
        ("embeddings", {}, True),
    ],
)
def test_what_counts_as_deterministic(route, payload, expected):
    assert deterministic(route, payload) is expected


def test_which_requests_are_looked_up():
    spec = CacheSpec(enabled=True)
    assert bypass_reason(spec, "chat", "acme", BODY, None) is None
    assert bypass_reason(spec, "chat", None, BODY, None) == "anonymous"
    assert bypass_reason(spec, "count_tokens", "acme", BODY, None) == "route"
    assert bypass_reason(spec, "chat", "acme", {**BODY, "temperature": 1}, None) == "sampled"
    assert bypass_reason(CacheSpec(enabled=True, deterministic_only=False), "chat", "a", {}, None) is None
    assert bypass_reason(spec, "responses", "acme", {**BODY, "background": True}, None) == "stateful"
    assert bypass_reason(spec, "responses", "acme", {**BODY, "conversation": "c1"}, None) == "stateful"
    assert bypass_reason(spec, "chat", "acme", BODY, "max-age=0, No-Store") == "cache_control"


def test_cache_control_directives():
    assert refused_by_client("no-cache") and refused_by_client("max-age=5, no-store")
    assert not refused_by_client("max-age=5") and not refused_by_client(None) and not refused_by_client("no-transform")


def test_the_policy_scope():
    spec = CacheSpec(enabled=True, match={"routes": ["chat"], "models": ["m"], "pools": ["p"]})
    assert spec.applies("chat", "m", "p")
    assert not spec.applies("responses", "m", "p") and not spec.applies("chat", "n", "p")
    assert not spec.applies("chat", "m", "q")


def test_the_memory_store_bounds_bytes_least_recently_used_first_and_expires():
    now = [0.0]
    store = MemoryStore(max_bytes=30, max_entry_bytes=12, clock=lambda: now[0])

    async def run() -> None:
        await store.put("a", b"a" * 10, ttl=5)
        await store.put("b", b"b" * 10, ttl=5)
        assert await store.get("a") == b"a" * 10  # a is now the most recently used
        await store.put("c", b"c" * 10, ttl=5)
        await store.put("d", b"d" * 10, ttl=5)  # over 30 bytes: b, the least recently used, goes
        assert await store.get("b") is None and await store.get("a") is not None and store.size == 30
        await store.put("big", b"x" * 13, ttl=5)  # over the entry bound: never stored
        assert await store.get("big") is None and len(store) == 3
        await store.put("a", b"A" * 4, ttl=5)  # replaced: its bytes counted once
        assert store.size == 24
        now[0] = 5.0
        assert await store.get("c") is None and store.size == 14  # expired: gone when asked for

    asyncio.run(run())


CHAT_ANSWER = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "created": 1,
    "model": "m",
    "choices": [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": "Calling.",
                "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
                    {"id": "call_2", "type": "function", "function": {"name": "g", "arguments": "{}"}},
                ],
            },
            "finish_reason": "tool_calls",
        },
        {"index": 1, "message": {"role": "assistant", "content": "Other."}, "finish_reason": "stop"},
    ],
    "usage": {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9},
}
COMPLETION_ANSWER = {
    "id": "cmpl-1",
    "object": "text_completion",
    "created": 1,
    "model": "m",
    "choices": [{"index": 0, "text": "once upon", "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4},
}
RESPONSE_ANSWER = {
    "id": "resp_1",
    "object": "response",
    "status": "completed",
    "model": "m",
    "output": [
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "thought"}]},
        {
            "type": "message",
            "id": "msg_1",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": "Hello there.", "annotations": []}],
        },
        {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "f", "arguments": "{}", "status": "completed"},
    ],
    "usage": {"input_tokens": 3, "output_tokens": 2, "total_tokens": 5},
}
MESSAGE_ANSWER = {
    "id": "msg_1",
    "type": "message",
    "role": "assistant",
    "model": "claude",
    "content": [
        {"type": "thinking", "thinking": "Let me see.", "signature": "sig"},
        {"type": "text", "text": "Here it is."},
        {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"a": [1, 2]}},
    ],
    "stop_reason": "tool_use",
    "stop_sequence": None,
    "usage": {"input_tokens": 9, "output_tokens": 7},
}


def _events(stream: list[bytes]) -> list[dict[str, Any]]:
    """The parsed data of a stream's events, as a client reads them (their SSE type matching their data's)."""
    parsed = []
    for event in stream:
        name, data = read_event(event)
        assert data is not None
        if data != b"[DONE]":
            value = json.loads(data)
            assert name is None or name.decode() == value["type"]
            parsed.append(value)
    return parsed


@pytest.mark.parametrize(
    ("path", "answer", "format_"),
    [
        (CHAT, CHAT_ANSWER, AnswerFormat()),
        (COMPLETIONS, COMPLETION_ANSWER, AnswerFormat()),
        (RESPONSES, RESPONSE_ANSWER, ResponsesFormat()),
        (MESSAGES, MESSAGE_ANSWER, MessagesFormat()),
    ],
)
def test_a_replayed_answer_assembles_back_to_itself_and_reads_as_the_stream_format(path, answer, format_):
    stream = replayed(path, answer, include_usage=True)
    assembly = Assembly(path, max_bytes=1 << 20)
    usage, ended = Usage(), False
    for event in stream:
        _, data = read_event(event)
        assert data is not None
        parsed = None if data == b"[DONE]" else json.loads(data)
        assert format_.is_event(None, data, parsed)
        ended = ended or format_.ends(data, parsed)
        if parsed is not None:
            format_.record(usage, parsed)
            assembly.feed(parsed, len(data))
    assert ended, "the stream is complete as its format reads it"
    assert assembly.answer() == answer
    assert usage.completion_tokens is not None and usage.completion_tokens > 0
    assert complete(path, answer)


def test_usage_goes_out_only_where_the_client_asked_for_it():
    assert not any("usage" in chunk for chunk in _events(replayed(CHAT, CHAT_ANSWER, include_usage=False)))
    assert _events(replayed(CHAT, CHAT_ANSWER, include_usage=True))[-1]["usage"] == CHAT_ANSWER["usage"]


def test_what_cannot_be_rebuilt_exactly_is_not_assembled():
    chunk = {"id": "c", "choices": [{"index": 0, "delta": {"content": "a"}, "logprobs": {"content": []}}]}
    assembly = Assembly(CHAT, max_bytes=1 << 20)
    assembly.feed(chunk, 10)
    assert assembly.answer() is None
    message = Assembly(MESSAGES, max_bytes=1 << 20)
    for event in _events(replayed(MESSAGES, MESSAGE_ANSWER, include_usage=False)):
        if event["type"] == "content_block_delta" and event["delta"]["type"] == "input_json_delta":
            event = {**event, "delta": {**event["delta"], "partial_json": '{"a": ['}}  # never whole JSON
        message.feed(event, 10)
    assert message.answer() is None


def test_assembly_stops_past_its_byte_bound():
    assembly = Assembly(CHAT, max_bytes=15)
    for word in ("0123456789", "0123456789"):
        assembly.feed({"choices": [{"index": 0, "delta": {"content": word}, "finish_reason": None}]}, len(word))
    assert assembly.answer() is None


def test_only_answers_that_ended_normally_are_complete():
    cut = {**CHAT_ANSWER, "choices": [{**CHAT_ANSWER["choices"][1], "finish_reason": "length"}]}
    assert not complete(CHAT, cut) and not complete(CHAT, {**CHAT_ANSWER, "choices": []})
    assert not complete(RESPONSES, {**RESPONSE_ANSWER, "status": "incomplete"})
    assert not complete(MESSAGES, {**MESSAGE_ANSWER, "stop_reason": "max_tokens"})
    assert complete("/v1/embeddings", {"data": []}) and not complete("/v1/embeddings", {"error": {}})


# ---- the semantic match's parts ------------------------------------------------------------------------------------


def test_the_last_user_text_is_read_only_where_it_is_text_alone():
    def last(content: Any, role: str = "user") -> str | None:
        return last_user_text(
            {"messages": [{"role": "system", "content": "be brief"}, {"role": role, "content": content}]}
        )

    assert last("hi there") == "hi there"
    assert last([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]) == "a\nb"
    assert last([{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}]) is None
    assert last("hi", role="assistant") is None and last([]) is None and last(None) is None
    assert last_user_text({"messages": []}) is None and last_user_text({"prompt": "x"}) is None


def test_a_bucket_holds_the_requests_equal_but_for_their_last_user_text():
    def bucket(text: str, tenant: str = "acme", embedder: str = "e", **extra: Any) -> str | None:
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}]
        return bucket_key(tenant, "chat", "p", {**BODY, "messages": messages, **extra}, None, embedder)

    assert bucket("what is x?") == bucket("tell me x")
    assert bucket("x", tenant="other") != bucket("x")
    assert bucket("x", embedder="f") != bucket("x")
    assert bucket("x", max_tokens=3) != bucket("x")
    assert bucket("x") != key({**BODY, "messages": [{"role": "user", "content": None}]}), "not an exact key"


def unit(*numbers: float) -> Any:
    vector = np.asarray(numbers, dtype=np.float32)
    return vector / np.linalg.norm(vector)


def test_the_index_serves_the_nearest_text_at_the_threshold_and_keeps_its_bound():
    index = SemanticIndex(max_entries=3)
    words = Wording.of("a question")
    index.add("b1", unit(1, 0), words, "k-east")
    index.add("b1", unit(0, 1), words, "k-north")
    found = index.nearest("b1", unit(1, 0.1), words, threshold=0.99)
    assert found is not None and found[0] == "k-east" and found[1] == pytest.approx(0.995, abs=1e-3)
    assert index.nearest("b1", unit(1, 1), words, threshold=0.99) is None, "halfway: near neither"
    assert index.nearest("b2", unit(1, 0), words, threshold=0.5) is None, "another bucket's texts are not compared"
    index.add("b2", unit(1, 0), words, "k-other")
    index.nearest("b1", unit(1, 0), words, threshold=0.5)  # b1 is now the most recently used
    index.add("b3", unit(1, 0), words, "k-new")  # past 3: b2, the least recently used, loses its oldest
    assert len(index) == 3 and index.nearest("b2", unit(1, 0), words, threshold=0.5) is None
    assert index.nearest("b1", unit(0, 1), words, threshold=0.99) is not None


def test_the_index_passes_over_a_nearer_text_whose_words_ask_another_question():
    index = SemanticIndex(max_entries=3)
    index.add("b", unit(1, 0), Wording.of("What time does the store close on Saturday?"), "k-close")
    index.add("b", unit(1, 0.3), Wording.of("When does the shop open on Saturdays?"), "k-open")
    asked = Wording.of("What time does the store open on Saturday?")
    found = index.nearest("b", unit(1, 0.01), asked, threshold=0.9)
    assert found is not None and found[0] == "k-open", "the nearest differs in one word: the next one answers"
    assert index.nearest("b", unit(1, 0.01), asked, threshold=0.99) is None


def test_only_the_nearest_few_texts_words_are_compared():
    index = SemanticIndex(max_entries=MAX_CANDIDATES + 1)
    for number in range(MAX_CANDIDATES):
        index.add("b", unit(1, 0.001 * number), Wording.of(f"Is flight {number} late?"), f"k-{number}")
    index.add("b", unit(1, 0.1), Wording.of("Is the flight late?"), "k-words-agree")
    asked = Wording.of("Is the flight late?")
    assert index.nearest("b", unit(1, 0), asked, threshold=0.99) is None, "past the nearest few: a miss"
    assert index.nearest("b", unit(1, 0.1), asked, threshold=0.99) is not None


@pytest.mark.parametrize(
    ("first", "second", "conflict"),
    [
        ("What is 15% of 200?", "What is 25% of 200?", "number"),
        ("Summarise it in three sentences.", "Summarise it in 3 sentences.", None),
        ("Summarise it in three sentences.", "Summarise it in ten sentences, please.", "number"),
        ("Does the hotel allow pets?", "Does the hotel not allow pets at all?", "negation"),
        ("Why isn't my Wi-Fi working?", "Why is my Wi-Fi not working?", "order"),
        ("How long is the flight from London to Paris?", "How long is the flight from Paris to London?", "order"),
        ("What time does the store open on Saturday?", "What time does the store close on Saturday?", "edit"),
        ("When is the next train to Leeds?", "When is the very last train to Leeds?", "edit"),
        ("What's the capital of France?", "what is the capital of france", None),
        ("How do I reset my password?", "I forgot my password: how can I set a new one?", None),
        ("Who wrote Pride and Prejudice?", "Who is the author of Pride and Prejudice?", None),
    ],
)
def test_words_tell_which_near_texts_ask_another_question(first, second, conflict):
    assert Wording.of(first).conflict(Wording.of(second)) == conflict
    assert Wording.of(second).conflict(Wording.of(first)) == conflict


def test_only_a_texts_first_words_are_kept_and_each_is_bounded():
    words = Wording.of("x" * 10_000 + " word" * 10_000)
    assert len(words.words) == MAX_WORDS and len(words.words[0]) == MAX_WORD_CHARS


@pytest.mark.parametrize(
    "content",
    [b"not json", b'{"data": []}', b'{"data": [{"embedding": "x"}]}', b'{"data": [{"embedding": [0, 0]}]}'],
)
def test_an_answer_that_is_no_embedding_gives_none(content):
    assert embedding_of(content) is None


def test_an_embedding_is_scaled_to_unit_length():
    vector = embedding_of(b'{"data": [{"embedding": [3, 4]}]}')
    assert vector is not None and vector.tolist() == pytest.approx([0.6, 0.8])


def test_a_policy_that_turns_the_semantic_match_on_is_warned_about(tmp_path):
    (tmp_path / "tenants").mkdir()
    doc = {"apiVersion": "portcullis.dev/v1", "metadata": {"name": "p"}}
    semantic = {"cache": {"enabled": True, "semantic": {"model": "embedder", "threshold": 0.97}}}
    (tmp_path / "base.yaml").write_text(json.dumps({**doc, "kind": "Policy", "spec": {"cache": {"enabled": True}}}))
    overlay = {**doc, "kind": "TenantPolicy", "tenant": "acme", "spec": semantic}
    (tmp_path / "tenants" / "acme.yaml").write_text(json.dumps(overlay))
    [warning] = load_policy_dir(tmp_path).warnings
    assert "tenant 'acme'" in warning and "'embedder'" in warning and "0.97" in warning
