"""Auth stage: API keys mapped to tenants. Keys are held only as SHA-256 digests and confirmed in constant time."""

from __future__ import annotations

import hashlib
import hmac
import logging

from gateway.config import AuthConfig
from gateway.context import RequestContext
from gateway.errors import GatewayError

log = logging.getLogger(__name__)

ANONYMOUS = "anonymous"


class AuthStage:
    name = "auth"

    def __init__(self, config: AuthConfig) -> None:
        # Indexed by an 8-byte digest prefix: the lookup's timing depends only on a SHA-256 prefix an attacker cannot
        # steer, and the full digest is then confirmed with compare_digest (constant time).
        self._keys = {}
        for key in config.keys:
            digest = key.digest()
            self._keys[digest[:8]] = (digest, key.tenant, key.label)
        if not self._keys:
            log.warning("auth: no API keys configured; every request is served as tenant %r", ANONYMOUS)

    async def __call__(self, ctx: RequestContext) -> None:
        if not self._keys:
            ctx.tenant = ANONYMOUS
            return
        presented = _presented_key(ctx.request.headers)
        if presented is None:
            raise _unauthorized("missing API key: send 'Authorization: Bearer <key>'", "missing_api_key")
        digest = hashlib.sha256(presented.encode()).digest()
        stored, tenant, label = self._keys.get(digest[:8], (b"", None, None))
        if not hmac.compare_digest(stored, digest):
            raise _unauthorized("incorrect API key provided", "invalid_api_key")
        ctx.tenant, ctx.key_label, ctx.key_id = tenant, label, digest[:6].hex()
        ctx.span.set_attribute("portcullis.tenant", ctx.tenant)


def _presented_key(headers) -> str | None:
    auth = headers.get("authorization")
    if auth:
        scheme, _, token = auth.partition(" ")
        return token.strip() or None if scheme.lower() == "bearer" else None
    return headers.get("x-api-key") or headers.get("api-key")


def _unauthorized(message: str, code: str) -> GatewayError:
    return GatewayError(401, message, type="authentication_error", code=code,
                        headers={"www-authenticate": 'Bearer realm="portcullis"'})
