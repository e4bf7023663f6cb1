"""What every admin request must show before auth and before any route sees it.

A listener on loopback is not private: every web page the operator's browser opens can send it requests. Each check
closes one way in:
- `Host` names the admin listener (421 otherwise): its own address and port as the connection reached them, the
  loopback names on a loopback connection, `admin.host` where it is a name, and `admin.allowed_hosts`. A DNS-rebound
  name (evil.example resolving to 127.0.0.1) makes the browser treat the admin API as evil.example's own origin and
  let its script read the answers; its Host header still says evil.example.
- An `Origin` header, where there is one, is the listener's own (403 otherwise). Browsers send one with every
  cross-origin request that is not a plain navigation; curl and Prometheus send none.
- A request that changes state says `Content-Type: application/json` (415 otherwise). A page can POST text/plain or
  a form to any address without asking; a JSON body makes the browser ask first (a CORS preflight), which this
  API never grants.
- `Authorization: Bearer <token>` carries the admin token (401 otherwise; compared in constant time).
"""

from __future__ import annotations

import hmac
from ipaddress import ip_address
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.config import AdminConfig
from gateway.errors import GatewayError

READ_ONLY_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "[::1]"})
WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::"})
SHOWN_HEADER_CHARS = 100  # of a refused Host or Origin, in the answer


class AdminGuard:
    """ASGI middleware in front of the admin app's routes: the checks above, in that order."""

    def __init__(self, app: ASGIApp, admin: AdminConfig, token: str) -> None:
        self.app = app
        self.expected_authorization = f"Bearer {token}".encode()
        self.configured_name = None if admin.host in WILDCARD_HOSTS else _literal(admin.host.lower())
        self.allowed = frozenset(admin.allowed_hosts)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refusal = self.refusal(scope)
            if refusal is not None:
                await refusal.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def refusal(self, scope: Scope) -> GatewayError | None:
        headers = Headers(scope=scope)
        host = headers.get("host", "").lower()
        if not self.names_this_listener(host, scope.get("server")):
            return GatewayError(
                421,
                f"Host {_shown(host)} does not name the admin listener: use its address, or list a name a proxy "
                "forwards in admin.allowed_hosts",
                code="admin_host_not_allowed",
            )
        origin = headers.get("origin")
        if origin is not None and not _same_origin(origin, host):
            return GatewayError(
                403,
                f"Origin {_shown(origin)} is not the admin listener's own: the admin API answers no cross-origin "
                "request (a browser page's)",
                type="permission_error",
                code="admin_origin_not_allowed",
            )
        if scope["method"] not in READ_ONLY_METHODS and not _is_json(headers.get("content-type", "")):
            return GatewayError(
                415,
                "a request that changes state must have Content-Type: application/json",
                code="unsupported_media_type",
            )
        given = headers.get("authorization", "").encode("latin-1")
        if not hmac.compare_digest(given, self.expected_authorization):
            return GatewayError(
                401,
                "the admin plane needs its bearer token",
                type="authentication_error",
                code="invalid_admin_token",
                headers={"www-authenticate": "Bearer"},
            )
        return None

    def names_this_listener(self, host: str, server: tuple[str, int | None] | None) -> bool:
        """Whether a Host header value names the listener the connection arrived on (`server`: its local address)."""
        if host in self.allowed:
            return True
        name, _, port = host.rpartition(":") if not host.endswith("]") else (host, "", "")
        if not name or name.endswith(":"):  # no port given, or an IPv6 address without brackets
            name, port = host, ""
        if name in self.allowed:
            return True
        if server is None or server[1] is None or port != str(server[1]):  # None: a Unix socket, no address
            return False
        if name == _literal(server[0]) or name == self.configured_name:
            return True
        return name in LOOPBACK_NAMES and ip_address(server[0]).is_loopback


def _literal(address: str) -> str:
    """An address as a Host header writes it: IPv6 in brackets."""
    return f"[{address}]" if ":" in address and not address.startswith("[") else address


def _same_origin(origin: str, host: str) -> bool:
    """An Origin naming the Host the request was sent to, over http or https (https where a proxy ends TLS)."""
    parts = urlsplit(origin.lower())
    return parts.scheme in ("http", "https") and parts.netloc == host and not parts.path


def _is_json(content_type: str) -> bool:
    return content_type.partition(";")[0].strip().lower() == "application/json"


def _shown(value: str) -> str:
    return repr(value[:SHOWN_HEADER_CHARS]) if value else "(none)"
