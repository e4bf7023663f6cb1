"""A misbehaving OpenAI-compatible upstream for the hostile tests, run as a real process on a loopback port.

Requests are parsed with h11; answers are written as raw bytes, so the upstream can misbehave at the byte level
(every answer is close-delimited or has a Content-Length, and closes its connection). A request steers it with a
`hostile` object in its JSON body (the gateway forwards bodies unchanged); `behaviour` is one of:

  ok            a well-formed answer: a chat completion, or an SSE stream when the request has `stream: true` (of
                `words` events, 3 by default, each word padded with `pad` bytes)
  huge_body     200 JSON `bytes` long, close-delimited (or with a Content-Length when `length` is true)
  no_boundary   200 SSE, then one event of `bytes` bytes that never ends, in `piece`-byte writes `pause` s apart
  trickle       200 (SSE when streaming, else JSON) and then one byte every `interval` seconds, forever
  hang          read the request and never answer
  slow_first    200 SSE headers at once, the stream's first event only after `delay` seconds
  stall         200 SSE, `events` events, then silence with the connection open
  garbage       `status` with `body` as it is (a string, written as latin-1: "\u00ff" is the byte 0xff) and
                `content_type`
  html_502      502 with an nginx-style HTML error page
  line_endings  a normal stream whose events end in `endings` taken in turn (e.g. ["\r\r", "\n\r\n"]); every
                byte of a line ending is its own write, `gap` s apart, so a CRLF arrives cut in two
  written       200 SSE, then each string of `events` (written as latin-1) in a write of its own, `gap` s apart
                (0.05 by default), so each arrives in a read of its own; then the answer ends, or with `hold` the
                connection is held open (only a gateway that stops reading closes it: `closed_at`)
  idle_close    a well-formed completion on a connection kept open; the next request on that connection is read
                and the connection closed unanswered, as a server closing an idle connection just as a request on
                it arrives (`dropped` in the stats counts them)

A Messages request that the gateway translates to chat keeps no member it does not translate, so it carries the
`hostile` object as JSON in `metadata.user_id`, which reaches the upstream as chat's `user`.

With `--metrics TEXT`, GET /metrics answers TEXT as Prometheus text (what a scrape of an engine reads).

`tag` names the request in the stats. GET /_stats answers {"requests": n, "seen": {tag: {"behaviour",
"received_at", "closed_at", "answered"}}}: `closed_at` (time.time()) is when the gateway closed the connection
before the answer was complete, null while it has not; `answered` whether the whole answer went out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Awaitable, Callable

import h11

HTML_502 = (
    b"<html>\r\n<head><title>502 Bad Gateway</title></head>\r\n<body>\r\n<center><h1>502 Bad Gateway</h1>"
    b"</center>\r\n<hr><center>nginx</center>\r\n</body>\r\n</html>\r\n"
)
BLOCK = 1024 * 1024


class Answer:
    """Raw HTTP/1.1 answer bytes to one request on one connection."""

    def __init__(self, writer: asyncio.StreamWriter, request: dict) -> None:
        self.writer = writer
        self.request = request

    async def write(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def head(
        self,
        status: int = 200,
        content_type: str = "application/json",
        length: int | None = None,
        reason: str = "OK",
        keep_alive: bool = False,
    ) -> None:
        lines = [f"HTTP/1.1 {status} {reason}", f"content-type: {content_type}"]
        lines.append("connection: keep-alive" if keep_alive else "connection: close")
        if length is not None:
            lines.append(f"content-length: {length}")
        await self.write(("\r\n".join(lines) + "\r\n\r\n").encode())

    async def whole(
        self, status: int, body: bytes, content_type: str = "application/json", keep_alive: bool = False
    ) -> None:
        await self.head(status, content_type, len(body), keep_alive=keep_alive)
        await self.write(body)

    def chunks(self, words: int = 3, pad: int = 0) -> list[bytes]:
        """A normal stream's data payloads, usage included when asked for, and [DONE]."""
        base = {
            "id": "cmpl-hostile",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": self.request.get("model"),
        }
        out = [
            json.dumps(
                {
                    **base,
                    "choices": [
                        {
                            "index": 0,
                            "delta": {"content": f"w{i} " + "x" * pad},
                            "finish_reason": "stop" if i == words - 1 else None,
                        }
                    ],
                }
            )
            for i in range(words)
        ]
        if (self.request.get("stream_options") or {}).get("include_usage"):
            out.append(
                json.dumps(
                    {
                        **base,
                        "choices": [],
                        "usage": {"prompt_tokens": 7, "completion_tokens": words, "total_tokens": 7 + words},
                    }
                )
            )
        return [c.encode() for c in out] + [b"[DONE]"]

    def completion(self) -> bytes:
        return json.dumps(
            {
                "id": "cmpl-hostile",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": self.request.get("model"),
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": "w0 w1 w2 "}, "finish_reason": "stop"}
                ],
                "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10},
            }
        ).encode()


async def ok(answer: Answer, spec: dict) -> None:
    if not answer.request.get("stream"):
        await answer.whole(200, answer.completion())
        return
    await answer.head(200, "text/event-stream")
    for data in answer.chunks(spec.get("words", 3), spec.get("pad", 0)):
        await answer.write(b"data: " + data + b"\n\n")


async def idle_close(answer: Answer, spec: dict) -> None:
    await answer.whole(200, answer.completion(), keep_alive=True)  # Server.handle drops the connection's next one


async def huge_body(answer: Answer, spec: dict) -> None:
    size = spec["bytes"]
    await answer.head(200, length=size if spec.get("length") else None)
    prefix = b'{"id": "cmpl-hostile", "pad": "'
    await answer.write(prefix)
    left = size - len(prefix) - 2
    while left > 0:
        await answer.write(b"x" * min(BLOCK, left))
        left -= BLOCK
    await answer.write(b'"}')


async def no_boundary(answer: Answer, spec: dict) -> None:
    await answer.head(200, "text/event-stream")
    piece, pause = spec.get("piece", 16 * 1024), spec.get("pause", 0)
    left = spec["bytes"]
    await answer.write(b"data: ")
    while left > 0:
        await answer.write(b"x" * min(piece, left))
        left -= piece
        if pause:
            await asyncio.sleep(pause)


async def trickle(answer: Answer, spec: dict) -> None:
    streaming = answer.request.get("stream")
    await answer.head(200, "text/event-stream" if streaming else "application/json")
    await answer.write(b"data: {" if streaming else b"{")
    while True:
        await asyncio.sleep(spec.get("interval", 1.0))
        await answer.write(b" ")


async def hang(answer: Answer, spec: dict) -> None:
    await asyncio.Event().wait()


async def slow_first(answer: Answer, spec: dict) -> None:
    await answer.head(200, "text/event-stream")
    await asyncio.sleep(spec.get("delay", 3.0))
    for data in answer.chunks():
        await answer.write(b"data: " + data + b"\n\n")


async def stall(answer: Answer, spec: dict) -> None:
    await answer.head(200, "text/event-stream")
    for data in answer.chunks(words=spec.get("events", 2) + 1)[: spec.get("events", 2)]:
        await answer.write(b"data: " + data + b"\n\n")
    await asyncio.Event().wait()


async def garbage(answer: Answer, spec: dict) -> None:
    await answer.whole(
        spec.get("status", 200), spec.get("body", "").encode("latin-1"), spec.get("content_type", "text/plain")
    )


async def html_502(answer: Answer, spec: dict) -> None:
    await answer.whole(502, HTML_502, "text/html")


async def line_endings(answer: Answer, spec: dict) -> None:
    endings = spec["endings"]
    await answer.head(200, "text/event-stream")
    for number, data in enumerate(answer.chunks(words=spec.get("words", 3))):
        await answer.write(b"data: " + data)
        for byte in endings[number % len(endings)].encode():
            await asyncio.sleep(spec.get("gap", 0.02))
            await answer.write(bytes([byte]))


async def written(answer: Answer, spec: dict) -> None:
    await answer.head(200, "text/event-stream")
    for event in spec["events"]:
        await answer.write(event.encode("latin-1"))
        await asyncio.sleep(spec.get("gap", 0.05))
    if spec.get("hold"):
        await asyncio.Event().wait()


BEHAVIOURS: dict[str, Callable[[Answer, dict], Awaitable[None]]] = {
    f.__name__: f
    for f in (
        ok,
        idle_close,
        huge_body,
        no_boundary,
        trickle,
        hang,
        slow_first,
        stall,
        garbage,
        html_502,
        line_endings,
        written,
    )
}


class Server:
    def __init__(self, metrics: str | None) -> None:
        self.metrics = metrics
        self.requests = 0
        self.dropped = 0
        self.seen: dict[str, dict] = {}

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await self._read_request(reader)
            if request is None:
                return
            target, body = request
            if target == b"/_stats":
                data = json.dumps({"requests": self.requests, "dropped": self.dropped, "seen": self.seen}).encode()
                await Answer(writer, {}).whole(200, data)
                return
            if target == b"/metrics" and self.metrics is not None:
                await Answer(writer, {}).whole(200, self.metrics.encode(), "text/plain; version=0.0.4")
                return
            if await self._serve(reader, writer, json.loads(body or b"{}")) == "idle_close":
                if await self._read_request(reader) is not None:
                    self.dropped += 1  # read, then the connection closes with no answer
        except (ConnectionError, h11.RemoteProtocolError):
            pass
        finally:
            writer.close()

    @staticmethod
    async def _read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes] | None:
        conn = h11.Connection(h11.SERVER)
        target, body = b"", bytearray()
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await reader.read(65536)
                if not data:
                    return None
                conn.receive_data(data)
            elif isinstance(event, h11.Request):
                target = event.target
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                return target, bytes(body)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: dict) -> str:
        """Answer one request as its `hostile` spec says; the behaviour it had."""
        self.requests += 1
        spec = request.get("hostile") or _translated_spec(request.get("user"))
        behaviour = spec.get("behaviour", "ok")
        record = self.seen[spec.get("tag", str(self.requests))] = {
            "behaviour": behaviour,
            "received_at": time.time(),
            "closed_at": None,
            "answered": False,
        }
        answering = asyncio.create_task(BEHAVIOURS[behaviour](Answer(writer, request), spec))
        gone = asyncio.create_task(reader.read(65536))  # b"": the gateway closed its end
        await asyncio.wait((answering, gone), return_when=asyncio.FIRST_COMPLETED)
        if answering.done() and answering.exception() is None:
            record["answered"] = True
        else:
            record["closed_at"] = time.time()
        for task in (answering, gone):
            task.cancel()
        await asyncio.gather(answering, gone, return_exceptions=True)  # gone's read over before another may begin
        return behaviour


def _translated_spec(user: object) -> dict:
    """The `hostile` object of a translated Messages request (its metadata.user_id), or {}."""
    try:
        spec = json.loads(user) if isinstance(user, str) else None
    except ValueError:
        return {}
    return spec if isinstance(spec, dict) else {}


async def serve(port: int, metrics: str | None) -> None:
    server = Server(metrics)
    listener = await asyncio.start_server(server.handle, "127.0.0.1", port)
    async with listener:
        await listener.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--metrics", help="the text GET /metrics answers")
    args = parser.parse_args()
    asyncio.run(serve(args.port, args.metrics))


if __name__ == "__main__":
    main()
