"""OpenAI-style errors: every rejection a client sees is `{"error": {"message", "type", "code", "param"}}`."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from gateway.header_values import rendered


class GatewayError(Exception):
    """A request the gateway refuses or cannot serve; raised by stages and the upstream call."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "code": self.code, "param": self.param}}

    def to_json(self) -> bytes:
        return json.dumps(self.body()).encode()

    def response(self, body: dict | None = None) -> Response:
        """This error answered: OpenAI's body, or the one a route of another shape gives."""
        content = self.to_json() if body is None else json.dumps(body).encode()
        return Response(content, status_code=self.status, headers=rendered(self.headers), media_type="application/json")

    def sse_event(self) -> bytes:
        """The same error as a server-sent event, for streams that already started."""
        return b"data: " + self.to_json() + b"\n\n"


def invalid_request(message: str, *, param: str | None = None, code: str | None = None) -> GatewayError:
    return GatewayError(400, message, param=param, code=code)


def internal_error() -> GatewayError:
    """A defect of the gateway's own, as the client hears it: no detail, since the log has the traceback."""
    return GatewayError(500, "internal gateway error", type="server_error", code="internal_error")


async def http_error(request: Request, exc: HTTPException) -> Response:
    """Starlette's own 404/405s, in the same OpenAI error shape as everything else."""
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return GatewayError(exc.status_code, str(exc.detail), code=code, headers=exc.headers).response()


async def server_error(request: Request, exc: Exception) -> Response:
    """What no route handled: logged with its traceback by the server, answered in the same shape, never as text."""
    return internal_error().response()


# Both apps (public and admin) answer what their routes do not in the OpenAI shape. Starlette types every handler
# as taking any Exception, though it calls each only with the class it is registered for.
EXCEPTION_HANDLERS: dict[type[Exception], Callable[..., Awaitable[Response]]] = {
    HTTPException: http_error,
    Exception: server_error,
}
