"""Output guard cost per streamed token on this machine: the detectors and the bookkeeping, no classifier.

    python -m bench.output_guard_bench [--tokens 4000] [--repeat 5] [--json out.json]

Each stream is `--tokens` events of one token's text (4 characters) in the upstream's own event shape, fed to
`OutputGuard.feed` one event at a time as the relay does, with the default policy's output settings (secrets
blocked, hold-back 64, scan every 128 characters; the classifier off, so no model is loaded): chat content, a chat
tool call's arguments (JSON text, with an escaped character now and then), Responses text deltas, Messages text
deltas, and chat content written as HTML (an entity or a percent-escape every few tokens, which the detectors also
read unescaped). The figure is the CPU time of the feeding thread per event, in microseconds, the best of
`--repeat` runs: on a shared machine wall time measures the neighbours.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Callable

from gateway.apis.answers import AnswerFormat, MessagesFormat, ResponsesFormat
from gateway.guard.output import OutputGuard
from gateway.guard.spec import GuardSpec

WORDS = ("the ", "plan", " for", " Q3 ", "is o", "n tr", "ack,", " see", " doc", "\\u00e9t")


def token(i: int) -> str:
    return WORDS[i % len(WORDS)] if i % 50 else "\\n  "  # an escape sequence now and then (text in arguments)


def event(data: dict, name: str | None = None) -> bytes:
    return (f"event: {name}\n" if name else "").encode() + b"data: " + json.dumps(data).encode() + b"\n\n"


def chat_content(i: int) -> bytes:
    delta = {"content": token(i).replace("\\", "")}
    return event({"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta}]})


HTML_WORDS = ("<p>T", "om &", "amp;", " Jer", "ry: ", "50% ", "&lt;", " a%2", "0b</", "p>\n ")


def chat_html(i: int) -> bytes:
    delta = {"content": HTML_WORDS[i % len(HTML_WORDS)]}
    return event({"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta}]})


def chat_arguments(i: int) -> bytes:
    piece = '{"note": "' if i == 0 else token(i)
    call = {"index": 0, "function": {"arguments": piece}}
    return event(
        {"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"tool_calls": [call]}}]}
    )


def responses_text(i: int) -> bytes:
    data = {
        "type": "response.output_text.delta",
        "item_id": "msg_1",
        "output_index": 0,
        "content_index": 0,
        "delta": token(i).replace("\\", ""),
        "sequence_number": i,
    }
    return event(data, data["type"])


def messages_text(i: int) -> bytes:
    data = {
        "type": "content_block_delta",
        "index": 0,
        "delta": {"type": "text_delta", "text": token(i).replace("\\", "")},
    }
    return event(data, data["type"])


STREAMS: dict[str, tuple[Callable[[], AnswerFormat], Callable[[int], bytes]]] = {
    "chat content": (AnswerFormat, chat_content),
    "chat content as HTML": (AnswerFormat, chat_html),
    "chat tool arguments": (AnswerFormat, chat_arguments),
    "responses text": (ResponsesFormat, responses_text),
    "messages text": (MessagesFormat, messages_text),
}


async def per_event_us(answers: AnswerFormat, make: Callable[[int], bytes], tokens: int) -> float:
    spec = GuardSpec.model_validate({"enabled": True, "injection": {"enabled": False}, "output": {"enabled": True}})
    guard = OutputGuard(None, spec, "bench", "bench", answers)  # no classifier: the injection check is off
    events = [make(i) for i in range(tokens)]
    started = time.thread_time()
    for e in events:
        await guard.feed([e])
    await guard.feed([b"data: [DONE]\n\n"])
    return (time.thread_time() - started) / tokens * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    out = {}
    for name, (answers, make) in STREAMS.items():
        runs = [asyncio.run(per_event_us(answers(), make, args.tokens)) for _ in range(args.repeat)]
        out[name] = round(min(runs), 2)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    print(json.dumps({"us_per_token": out, "tokens": args.tokens, "repeat": args.repeat}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
