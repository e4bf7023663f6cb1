"""Mutated JSON documents for the fuzz tests: a valid request or answer with one to three of its members replaced,
added, dropped or appended to, by values no well-behaved client or upstream sends — a wrong type, a list or an
object where a name is expected (unhashable: a set lookup raises), numbers past int64 and double, strings that are
roles or part types out of place, objects shaped like parts, tools or object references.

Seeded: a failure's report holds the body that caused it, and the same seed makes it again."""

from __future__ import annotations

import json
import random
from typing import Any

import httpx

# names a request or answer of some supported API holds somewhere: a mutation adds one where it does not belong
FIELD_NAMES = (
    "model messages content role name tools tool_choice functions function_call response_format stream "
    "stream_options n max_tokens max_completion_tokens max_output_tokens stop stop_sequences logit_bias logprobs "
    "top_logprobs input instructions previous_response_id text reasoning prompt suffix echo best_of system metadata "
    "user seed temperature top_p top_k parallel_tool_calls audio modalities prediction store include truncation "
    "service_tier encoding_format dimensions thinking type image_url url source data media_type tool_use_id id "
    "arguments output call_id cache_control include_usage json_schema schema file file_id input_audio refusal "
    "tool_calls tool_call_id conversation background prompt_cache_key safety_identifier container citations "
    "document title signature summary status annotations choices message delta usage finish_reason stop_reason "
    "index item output_index partial_json input_tokens output_tokens prompt_tokens completion_tokens"
).split()

VALUES: tuple[Any, ...] = (
    None, True, False, 0, -1, 1, 2**63, -(2**63), 10**30, 1.5, -0.0, 1e308, "", "x", "\u202e\u0000",
    "user", "assistant", "system", "tool", "developer", "function", "text", "image_url", "input_text", "tool_use",
    "tool_result", "auto", "none", "required", "json_schema", "a" * 3000,
    [], {}, [None], [""], [[]], [{}], ["a", 1, None], [[1, 2]],
    {"type": None}, {"type": "text"}, {"type": "text", "text": 5}, {"type": ["text"]}, [{"type": "text"}],
    [{"type": "image_url", "image_url": 5}], [{"type": "image_url", "image_url": {"url": 5}}],
    [{"type": "input_image"}], [{"type": "tool_result"}], {"type": "function"}, {"type": "function", "function": None},
    {"type": "json_schema", "json_schema": None}, [{"role": "user"}], [{"role": 5, "content": "x"}],
    {"type": ["x"], "file_id": "file-1"}, {"file_ids": [{"id": None}]}, {"previous_response_id": ["resp_1"]},
    {"a": {"b": {"c": [1, {"d": None}]}}}, {"name": None},
)  # fmt: skip


def mutated(document: Any, rng: random.Random) -> Any:
    """A copy of `document` with one to three mutations."""
    document = json.loads(json.dumps(document))
    for _ in range(rng.choice((1, 1, 2, 3))):
        _mutate_once(document, rng)
    return document


def _mutate_once(document: Any, rng: random.Random) -> None:
    path = rng.choice(list(_paths(document)))
    value = json.loads(json.dumps(rng.choice(VALUES)))  # a copy: a value may be mutated later in place
    if not path:  # the document itself: a member it does not have
        if isinstance(document, dict):
            document[rng.choice(FIELD_NAMES)] = value
        return
    parent = document
    for key in path[:-1]:
        parent = parent[key]
    node, roll = parent[path[-1]], rng.random()
    if roll < 0.5:
        parent[path[-1]] = value
    elif roll < 0.8 and isinstance(node, dict):
        node[rng.choice(FIELD_NAMES)] = value
    elif roll < 0.9 and isinstance(parent, dict):
        del parent[path[-1]]
    elif isinstance(node, list):
        node.append(value)
    else:
        parent[path[-1]] = value


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> Any:
    yield prefix
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _paths(value, (*prefix, i))


ANTHROPIC_ROUTES = ("/v1/messages", "/v1/messages/count_tokens")
# a stream's last event: its API's end, or an error event (both APIs' error events say "error")
STREAM_ENDS = (b"data: [DONE]", b"event: message_stop", b"event: response.completed", b"error")


def answer_problem(route: str, response: httpx.Response) -> str | None:
    """What is wrong with a gateway's answer on `route` to a mutated request or upstream answer, or None: a 5xx, an
    error not in the route's own shape, or a stream that ends without its end or an error event."""
    if response.status_code >= 500:
        return f"status {response.status_code}"
    if response.status_code >= 400:
        try:
            error = response.json()
        except ValueError:
            return "an error that is not JSON"
        if route in ANTHROPIC_ROUTES:
            shaped = error.get("type") == "error" and isinstance(error.get("error", {}).get("type"), str)
        else:
            shaped = isinstance(error.get("error"), dict) and isinstance(error["error"].get("message"), str)
        return None if shaped else "an error not in the route's shape"
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        events = [e for e in response.content.split(b"\n\n") if e.strip()]
        if not events or not any(end in events[-1] for end in STREAM_ENDS):
            return "a stream without its end or an error event"
        if b"internal_error" in response.content:
            return "an internal error event"
    return None
