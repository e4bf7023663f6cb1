"""MCP sessions bound to the caller that opened them, with no table to keep: the session id a client is given is
the upstream's, prefixed with a MAC of it, the server's name and the caller (its key, or its tenant where no key
names it). A session id presented with another key fails the MAC and is answered as an unknown session (404), as
the specification has a server answer a session it does not know; so is one whose MAC was forged or cut.

The MAC's secret is the process's, handed by a supervisor to its workers (gateway/ops/workers.py) through
`PORTCULLIS_MCP_SESSION_SECRET`; gateways behind one load balancer share sessions when the operator sets that
variable to the same secret for each.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets

SECRET_ENV = "PORTCULLIS_MCP_SESSION_SECRET"
_MAC_CHARS = 22  # 128 bits, base64url
_SEPARATOR = "."


def process_secret() -> bytes:
    """The secret session ids are bound with: the environment's, else one made now and put there for the workers
    this process starts."""
    value = os.environ.get(SECRET_ENV)
    if not value:
        value = os.environ[SECRET_ENV] = secrets.token_urlsafe(32)
    return value.encode()


class SessionBinder:
    def __init__(self, secret: bytes) -> None:
        self._secret = secret

    def _mac(self, server: str, caller: str, upstream: str) -> str:
        digest = hmac.new(self._secret, f"{server}\0{caller}\0{upstream}".encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).decode()[:_MAC_CHARS]

    def outward(self, server: str, caller: str, upstream: str) -> str:
        """The id the client is given for the upstream's session `upstream`."""
        return f"{self._mac(server, caller, upstream)}{_SEPARATOR}{upstream}"

    def inward(self, server: str, caller: str, presented: str) -> str | None:
        """The upstream's session id, when `presented` was given to this caller for this server; else None."""
        mac, separator, upstream = presented.partition(_SEPARATOR)
        if not separator or not upstream:
            return None
        return upstream if hmac.compare_digest(mac, self._mac(server, caller, upstream)) else None


def caller_of(key_id: str | None, tenant: str | None) -> str:
    """Who a session belongs to: the key that opened it, or its tenant where the caller has no key (anonymous)."""
    return f"key:{key_id}" if key_id else f"tenant:{tenant or ''}"
