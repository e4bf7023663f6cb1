"""Auth stage: the one place that refuses a request for its API key. Keys map to tenants through the KeyStore,
which holds them only as SHA-256 digests and confirms them in constant time."""

from __future__ import annotations

import logging

from gateway.context import RequestContext
from gateway.errors import GatewayError
from gateway.keys import ANONYMOUS, KeyStore, presented_key

log = logging.getLogger(__name__)


class AuthStage:
    name = "auth"

    def __init__(self, keys: KeyStore) -> None:
        self._keys = keys
        if keys.empty:
            log.warning("auth: no API keys configured; every request is served as tenant %r", ANONYMOUS)

    async def __call__(self, ctx: RequestContext) -> None:
        identity = self._keys.lookup(ctx.request.headers)
        if identity is None:
            if presented_key(ctx.request.headers) is None:
                raise _unauthorized("missing API key: send 'Authorization: Bearer <key>'", "missing_api_key")
            raise _unauthorized("incorrect API key provided", "invalid_api_key")
        ctx.tenant, ctx.key_label, ctx.key_id = identity.tenant, identity.label or None, identity.key_id or None
        ctx.span.set_attribute("portcullis.tenant", ctx.tenant)


def _unauthorized(message: str, code: str) -> GatewayError:
    return GatewayError(
        401, message, type="authentication_error", code=code, headers={"www-authenticate": 'Bearer realm="portcullis"'}
    )
