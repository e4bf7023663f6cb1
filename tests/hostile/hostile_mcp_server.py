"""A misbehaving MCP server for the MCP gateway's hostile tests, run as a real process on a loopback port: answers
a tools/list with its tools, and a tools/call as the tool's name says:

  huge          an SSE answer whose one event, the call's answer, is `--event-bytes` of text long
  garbage       200 application/json that is no JSON
  wrong_type    200 text/html
  stray         200 application/json: an answer to another request
  chatty        an SSE answer that first sends a sampling request, a progress notification and an answer to another
                request, then the call's own answer
  silent        SSE headers, then nothing for ten seconds

`GET /healthz` answers once it serves.
"""

from __future__ import annotations

import argparse
import asyncio
import json

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

TOOLS = ("huge", "garbage", "wrong_type", "stray", "chatty", "silent")


def event(message: dict) -> bytes:
    return b"event: message\ndata: " + json.dumps(message).encode() + b"\n\n"


def build(event_bytes: int) -> Starlette:
    async def mcp(request: Request) -> Response:
        message = await request.json()
        ident = message.get("id")
        if message.get("method") == "tools/list":
            tools = [{"name": n, "description": "Misbehaves.", "inputSchema": {"type": "object"}} for n in TOOLS]
            return JSONResponse({"jsonrpc": "2.0", "id": ident, "result": {"tools": tools}})
        name = message["params"]["name"]
        answer = {"jsonrpc": "2.0", "id": ident, "result": {"content": [{"type": "text", "text": "done"}]}}
        if name == "garbage":
            return Response(b"<html>oops</html>", media_type="application/json")
        if name == "stray":
            return JSONResponse({**answer, "id": 999})
        if name == "wrong_type":
            return Response(b"<html>oops</html>", media_type="text/html")

        async def stream():  # type: ignore[no-untyped-def]
            if name == "huge":
                yield event({**answer, "result": {"content": [{"type": "text", "text": "x" * event_bytes}]}})
                return
            elif name == "silent":
                await asyncio.sleep(10)
            elif name == "chatty":
                yield event({"jsonrpc": "2.0", "id": "s1", "method": "sampling/createMessage", "params": {}})
                yield event({"jsonrpc": "2.0", "method": "notifications/progress", "params": {"progress": 1}})
                yield event({"jsonrpc": "2.0", "id": 999, "result": {"content": [{"type": "text", "text": "other"}]}})
            yield event(answer)

        return StreamingResponse(stream(), media_type="text/event-stream")

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    return Starlette(routes=[Route("/mcp", mcp, methods=["POST"]), Route("/healthz", healthz)])


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--event-bytes", type=int, default=8192)
    args = parser.parse_args()
    uvicorn.run(build(args.event_bytes), host="127.0.0.1", port=args.port, log_level="warning")
