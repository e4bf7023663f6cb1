"""What a CRS test stage puts on the wire, and what the gateway's HTTP server hands on of it.

go-ftw sends `METHOD URI VERSION`, the stage's headers and its data; unless the stage sets
`autocomplete_headers: false` (or sends `encoded_request`, raw bytes) it adds what a client would: a form
Content-Type for data without one, `Connection: close`, and a Content-Length for the data (0 for a POST, PUT or
PATCH without any). The gateway's front door is uvicorn's httptools protocol (gateway/edge/http_server.py): llhttp
parses the head, uvicorn parses the target with `httptools.parse_url`, and a request either fails there, answered
400 before any middleware runs, or reaches the app with the method, target, headers and the body as llhttp framed
it (Content-Length bytes, de-chunked, nothing when neither header is there). `served` replays that with the same
two parsers, so the harness judges the request the WAF would see and counts one the server refuses as refused.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any

import httptools

from gateway.waf.cases import DEFAULT_HEADERS
from gateway.waf.parts import header_text

_METHODS_WITH_BODY = {"POST", "PUT", "PATCH"}


def wire_bytes(given: dict[str, Any]) -> bytes:
    """The bytes go-ftw sends for a stage's `input`."""
    if given.get("encoded_request"):
        return base64.b64decode(given["encoded_request"])
    data = given.get("data")
    body = b"" if data is None else (data.encode("utf-8", errors="surrogateescape") if isinstance(data, str) else data)
    headers = dict(DEFAULT_HEADERS) if "headers" not in given else {}
    headers.update({str(k): str(v) for k, v in (given.get("headers") or {}).items()})
    method = str(given.get("method", "GET"))
    if given.get("autocomplete_headers", True) and not given.get("stop_magic"):
        named = {k.lower() for k in headers}
        if body and "content-type" not in named:
            headers["Content-Type"] = "application/x-www-form-urlencoded"
        if "connection" not in named:
            headers["Connection"] = "close"
        if "content-length" not in named and (body or method.upper() in _METHODS_WITH_BODY):
            headers["Content-Length"] = str(len(body))
    version = str(given.get("version", "HTTP/1.1"))
    head = f"{method} {given.get('uri', '/')} {version}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    return head.encode("utf-8", errors="surrogateescape") + b"\r\n" + body


@dataclass
class Served:
    """The first request of the bytes as the server hands it to the app."""

    method: str = ""
    path: str = ""  # the target's path and query, as uvicorn puts them in the ASGI scope (no scheme or host)
    query: str = ""
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""


class _FirstRequest:
    """httptools callbacks, doing for the first request what uvicorn's protocol does with it."""

    def __init__(self) -> None:
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.request = Served()
        self.dispatched = False  # the head reached the app
        self.complete = False  # its body too

    def on_url(self, url: bytes) -> None:
        if not self.dispatched:
            self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.dispatched:
            self.request.headers.append((name.decode("latin-1"), header_text(value)))

    def on_headers_complete(self) -> None:
        if self.dispatched:
            return
        parsed = httptools.parse_url(self.url)  # uvicorn's next steps; a target without a path fails here (400)
        self.request.path = parsed.path.decode("ascii")
        self.request.query = (parsed.query or b"").decode("latin-1")
        self.request.method = self.parser.get_method().decode("latin-1")
        self.dispatched = True

    def on_body(self, body: bytes) -> None:
        if not self.complete:
            self.request.body += body

    def on_message_complete(self) -> None:
        self.complete = True


def served(raw: bytes) -> Served | None:
    """The request the app receives, or None when the server answers it (400, or 408 for a head that never ends)
    before it reaches the app. What follows a first request on the connection does not change it."""
    first = _FirstRequest()
    try:
        first.parser.feed_data(raw)
    except httptools.HttpParserUpgrade:
        pass  # an upgrade the gateway does not serve reaches the app like any request
    except httptools.HttpParserError:
        pass
    return first.request if first.dispatched else None
