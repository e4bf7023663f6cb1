"""/v1/responses on the real engine (bundled model), on a loopback socket, driven by the official openai SDK."""

from __future__ import annotations

import httpx
import openai
import pytest

from backend_engine.http.server import EngineServer

from .served import MODEL, running_server, wait_idle

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def served(make_engine):
    server = EngineServer(make_engine())
    with running_server(server) as url:
        yield server, url


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served[1] + "/v1", api_key="x")


def chat_answer(client, messages, max_tokens):
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0)


def test_string_input_is_answered_as_chat_completions_answers_it(client, served):
    chat = chat_answer(client, [{"role": "user", "content": QUESTION}], 20)
    r = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=20, temperature=0)
    assert r.output_text == chat.choices[0].message.content == "The capital of France is Paris."
    assert r.status == "completed" and r.incomplete_details is None
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    assert item.id.startswith("msg_") and [p.type for p in item.content] == ["output_text"]
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.input_tokens_details.cached_tokens > 0  # the chat request (same prompt) left its blocks cached
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    raw = httpx.post(served[1] + "/v1/responses", json={"input": QUESTION, "max_output_tokens": 2}).json()
    assert "output_text" not in raw and raw["store"] is False and raw["tools"] == []
    assert raw["text"] == {"format": {"type": "text"}} and raw["tool_choice"] == "auto"


def test_items_with_instructions_render_as_the_same_chat(client):
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Name a colour."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Blue."}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"role": "user", "content": "And a fruit?"},
    ]
    r = client.responses.create(
        model=MODEL, instructions="Answer with one word.", input=items, max_output_tokens=12, temperature=0
    )
    messages = [
        {"role": "system", "content": "Answer with one word."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "And a fruit?"},
    ]
    chat = chat_answer(client, messages, 12)
    assert r.output_text == chat.choices[0].message.content and r.output_text
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.instructions == "Answer with one word." and r.max_output_tokens == 12 and r.temperature == 0


def test_max_output_tokens_makes_the_response_incomplete(client):
    r = client.responses.create(model=MODEL, input="Tell me a long story.", max_output_tokens=3, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete" and r.usage.output_tokens == 3 and r.output_text


def stream_events(client, **kw):
    with client.responses.create(model=MODEL, stream=True, temperature=0, **kw) as stream:
        return list(stream)


def test_stream_events_come_in_order_and_deltas_join_to_the_final_text(client, served):
    events = stream_events(client, input=QUESTION, max_output_tokens=20)
    types = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * len(deltas),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert len(deltas) > 1  # text arrives as it is generated, not in one piece
    text = "".join(d.delta for d in deltas)
    final = events[-1].response
    assert text == events[-4].text == events[-3].part.text == final.output_text == "The capital of France is Paris."
    assert events[0].response.status == "in_progress" and final.status == "completed"
    assert final.id == events[0].response.id and final.usage.output_tokens == 8
    item_ids = {e.item_id for e in deltas} | {events[2].item.id, events[-2].item.id, final.output[0].id}
    assert len(item_ids) == 1
    assert [(d.output_index, d.content_index) for d in deltas] == [(0, 0)] * len(deltas)
    wait_idle(served[0])


def test_stream_cut_by_max_output_tokens_ends_incomplete(client):
    events = stream_events(client, input="Tell me a long story.", max_output_tokens=4)
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-2].item.status == "incomplete"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == events[-1].response.output_text


def test_engine_failure_mid_stream_ends_with_an_error_event(client, served, monkeypatch):
    engine = served[0].engine
    real_step, steps = engine.step, []

    def failing_step():
        steps.append(1)
        if len(steps) == 3:
            raise RuntimeError("device lost")
        return real_step()

    monkeypatch.setattr(engine, "step", failing_step)
    events = stream_events(client, input="Tell me a long story.", max_output_tokens=30)
    assert [e.type for e in events[-2:]] == ["error", "response.failed"]
    assert "device lost" in events[-2].message
    assert events[-1].response.status == "failed" and events[-1].response.error.code == "server_error"
    assert any(e.type == "response.output_text.delta" for e in events)  # it failed mid-stream, not before
    wait_idle(served[0])


def test_closing_a_stream_aborts_its_sequence(client, served):
    with client.responses.create(
        model=MODEL, input="Tell me a long story.", max_output_tokens=200, stream=True, temperature=0
    ) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                break
    wait_idle(served[0])


def test_sdk_raises_openai_errors(client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_123")
    assert exc.value.code == "previous_response_not_found" and "stores no responses" in exc.value.message
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="gpt-4o", input="hi")


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"input": "hi", "frequency_penalty": 1}, "frequency_penalty", "unknown_parameter"),
        ({"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools", None),
        ({"input": "hi", "text": {"format": {"type": "json_object"}}}, "text.format", None),
        ({"input": "hi", "temperature": "hot"}, "temperature", "invalid_type"),
        ({"input": "hi", "max_output_tokens": 0}, None, None),
        ({"input": "hi", "max_output_tokens": 100000}, "max_output_tokens", "context_length_exceeded"),
        ({"input": "hi", "metadata": {"k": 1}}, "metadata.k", None),
        ({"input": "hi", "stream": "yes"}, "stream", "invalid_type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input[0].content[0].type", None),
        ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input[0].content[0].text", None),
        ({"instructions": "only instructions"}, "input", None),
        ({"input": "hi " * 3000}, None, None),
    ],
)  # fmt: skip
def test_bad_requests_get_400_in_openai_shape(served, body, param, code):
    r = httpx.post(served[1] + "/v1/responses", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert err["param"] == param
    if code:
        assert err["code"] == code
