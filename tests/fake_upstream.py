"""A small OpenAI-compatible upstream for gateway tests, run as a real process on a loopback port.

It stands in for an LLM server where the test needs control the engine cannot give: exact chunk timing, abrupt
connection drops, slow headers, forced error statuses. A request steers it with a `fake` object in the JSON body
(the gateway forwards bodies unchanged): `{"chunks": 5, "delay": 0.1, "abort_after": 2, "header_delay": 1.0}`; usage
details and the model its answer names too (`cached`, `reasoning`, `answer_model`). Its
command line sets what holds for every request, so one upstream of several can be the broken one: `--fail-status`
(with `--fail-code`, the OpenAI-style error code its error body carries, e.g. context_length_exceeded) and `--slow`
(seconds before any answer's headers).
It also answers embeddings (`/v1/embeddings`): a bag of each input's words, so inputs with the same words embed alike.
`GET /_stats` reports what it saw (requests, cancelled streams, last headers and body) so tests can assert on the
upstream side of the wire.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import re
import time

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route


class Stats:
    def __init__(self) -> None:
        self.requests = 0
        self.embeddings = 0  # of the requests, those for embeddings
        self.completed_streams = 0
        self.cancelled_streams = 0
        self.passed_through = 0  # requests to the routes a pool passes through unread (echo)
        self.last_headers: dict[str, str] = {}
        self.last_body: dict = {}


def bag_of_words(text: str, dimensions: int = 64) -> list[float]:
    vector = [0.0] * dimensions
    for word in re.findall(r"[a-z0-9]+", text.lower()):
        vector[hashlib.sha256(word.encode()).digest()[0] % dimensions] += 1.0
    return vector


def build(name: str, fail_status: int | None, fail_code: str | None = None, slow: float = 0.0) -> Starlette:
    stats = Stats()

    async def completions(request: Request) -> Response:
        stats.requests += 1
        stats.last_headers = dict(request.headers)
        body = await request.json()
        stats.last_body = body
        fake = body.get("fake") or {}
        if fail_status:
            kind = "invalid_request_error" if fail_status < 500 else "server_error"
            return JSONResponse(
                {"error": {"message": f"{name} forced failure", "type": kind, "code": fail_code, "param": None}},
                status_code=fail_status,
            )
        await asyncio.sleep(slow or fake.get("header_delay", 0))
        chat = request.url.path.endswith("/chat/completions")
        words = [f"w{i} " for i in range(fake.get("chunks", 3))]
        usage = {"prompt_tokens": 7, "completion_tokens": len(words), "total_tokens": 7 + len(words)}
        if fake.get("cached"):
            usage["prompt_tokens_details"] = {"cached_tokens": fake["cached"]}
        if fake.get("reasoning"):
            usage["completion_tokens_details"] = {"reasoning_tokens": fake["reasoning"]}
        base = {
            "id": f"cmpl-{name}",
            "created": int(time.time()),
            "model": fake.get("answer_model", body.get("model")),  # a provider may answer with a dated model name
            "system_fingerprint": name,
        }
        if not body.get("stream"):
            text = "".join(words)
            choice = (
                {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
                if chat
                else {"index": 0, "text": text, "finish_reason": "stop", "logprobs": None}
            )
            obj = "chat.completion" if chat else "text_completion"
            answer = JSONResponse({**base, "object": obj, "choices": [choice], "usage": usage})
            if fake.get("set_cookie"):
                answer.set_cookie("session", fake["set_cookie"])
            return answer
        include_usage = (body.get("stream_options") or {}).get("include_usage")
        return StreamingResponse(stream(base, chat, words, fake, include_usage, usage), media_type="text/event-stream")

    async def stream(base: dict, chat: bool, words: list[str], fake: dict, include_usage: bool, usage: dict):
        obj = "chat.completion.chunk" if chat else "text_completion"
        try:
            for i, word in enumerate(words):
                if i == fake.get("abort_after"):
                    raise ConnectionAbortedError("fake upstream drops the connection mid-stream")
                last = i == len(words) - 1
                delta = {"index": 0, "delta": {"content": word}} if chat else {"index": 0, "text": word}
                choice = {**delta, "finish_reason": "length" if last else None}
                yield f"data: {json.dumps({**base, 'object': obj, 'choices': [choice]})}\n\n"
                await asyncio.sleep(fake.get("delay", 0))
            if include_usage:
                yield f"data: {json.dumps({**base, 'object': obj, 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
            stats.completed_streams += 1
        except asyncio.CancelledError:
            stats.cancelled_streams += 1
            raise

    async def embeddings(request: Request) -> Response:
        """OpenAI's embeddings: a vector per input, the bag of its words (lower case, punctuation dropped) hashed
        into 64 numbers, so texts with the same words embed alike and others less alike the fewer words they
        share."""
        stats.requests += 1
        stats.embeddings += 1
        body = stats.last_body = await request.json()
        inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
        data = [
            {"object": "embedding", "index": i, "embedding": bag_of_words(str(text))} for i, text in enumerate(inputs)
        ]
        usage = {"prompt_tokens": 3 * len(inputs), "total_tokens": 3 * len(inputs)}
        return JSONResponse({"object": "list", "data": data, "model": body.get("model"), "usage": usage})

    async def models(request: Request) -> Response:
        return JSONResponse(
            {"object": "list", "data": [{"id": f"{name}-model", "object": "model", "created": 0, "owned_by": name}]}
        )

    async def get_stats(request: Request) -> Response:
        return JSONResponse(vars(stats))

    async def echo(request: Request) -> Response:
        """A route the gateway passes through unread (files, message batches): says what arrived."""
        stats.passed_through += 1
        body = await request.body()
        return JSONResponse(
            {
                "method": request.method,
                "path": request.url.path,
                "query": request.url.query,
                "content_type": request.headers.get("content-type"),
                "authorization": request.headers.get("authorization"),
                "body_sha256": hashlib.sha256(body).hexdigest(),
            },
            status_code=201,
        )

    return Starlette(
        routes=[
            Route("/v1/chat/completions", completions, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/embeddings", embeddings, methods=["POST"]),
            Route("/v1/models", models),
            Route("/_stats", get_stats),
            Route("/v1/files{rest:path}", echo, methods=["GET", "POST", "DELETE"]),
            Route("/v1/messages/batches{rest:path}", echo, methods=["GET", "POST", "DELETE"]),
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--name", default="fake")
    parser.add_argument("--fail-status", type=int, help="answer every completion with this status")
    parser.add_argument("--fail-code", help="the error code of those answers' OpenAI-style error body")
    parser.add_argument("--slow", type=float, default=0.0, help="seconds before every completion's headers")
    args = parser.parse_args()
    app = build(args.name, args.fail_status, args.fail_code, args.slow)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
