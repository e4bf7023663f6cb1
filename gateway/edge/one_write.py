"""A fixed-length answer in one write: its head goes to the socket with its body, not ahead of it.

uvicorn writes an answer's head when the app sends `http.response.start` and its body when the app sends the body:
two sends on the socket for every answer, each a pass through the kernel's TCP stack (on loopback, the receiver's
too) and a segment of its own. That second send cost about as much CPU as a tenth of a proxied request. An answer
that declares its Content-Length is sent whole by every app the gateway serves, its body message straight after its
start, so its head is held and goes out with the body's first bytes, in one `writelines`. An answer without one (a
stream: chunked, SSE) is untouched: its head goes out at once, as a client waiting on a long prefill must see it.
A HEAD request's answer, which has no body to carry its head, is untouched too.
"""

from __future__ import annotations

from typing import Any

from uvicorn.protocols.http.httptools_impl import RequestResponseCycle


class HeldHead:
    """The cycle's transport while its answer's head is held: the head is kept, and the next write carries it."""

    def __init__(self, transport: Any) -> None:
        self.transport = transport
        self.head: bytes | None = None

    def write(self, data: bytes) -> None:
        if self.head is None:  # the head itself
            self.head = data
            return
        head, self.head = self.head, b""
        if head:
            self.transport.writelines((head, data))  # one send, no copy of the body
        else:
            self.transport.write(data)

    def flush(self) -> None:
        """Send a head no body carried (the app failed between its start and its body)."""
        head, self.head = self.head, b""
        if head and not self.transport.is_closing():
            self.transport.write(head)

    def close(self) -> None:
        self.flush()
        self.transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)


def declares_length(message: Any) -> bool:
    """Whether an `http.response.start` names a Content-Length (a fixed-length answer, its body to follow)."""
    for name, _ in message.get("headers", ()):
        if name.lower() == b"content-length":
            return True
    return False


class OneWriteCycle(RequestResponseCycle):
    """uvicorn's request cycle, writing a fixed-length answer's head with its body."""

    async def send(self, message: Any) -> None:
        transport = self.transport
        if isinstance(transport, HeldHead):  # the message after the start: the body, which carries the head
            try:
                await super().send(message)
            finally:
                self.transport = transport.transport
                transport.flush()
            return
        if message["type"] == "http.response.start" and self.scope["method"] != "HEAD" and declares_length(message):
            self.transport = HeldHead(transport)  # type: ignore[assignment]
        await super().send(message)
