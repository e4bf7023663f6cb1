"""Auth stage: the one place that refuses a request for its API key. The KeyRing (gateway/keystore/keyring.py) says
whose key it is, or why it opens nothing; a stored key's allowed models are checked here for the model the request
names, after parse named it (and again for the model of every attempt, gateway/stages/authority.py)."""

from __future__ import annotations

from typing import Any

from gateway.context import RequestContext
from gateway.errors import GatewayError
from gateway.keystore.keyring import Identity, KeyRing, Refusal

MAX_MODEL_IN_MESSAGE = 256  # characters of a refused model's name echoed back

_MESSAGES: dict[Refusal, str] = {
    "missing_api_key": "missing API key: send 'Authorization: Bearer <key>'",
    "invalid_api_key": "incorrect API key provided",
    "expired_api_key": "this API key has expired",
}


class AuthStage:
    name = "auth"

    def __init__(self, keys: KeyRing) -> None:
        self._keys = keys

    async def __call__(self, ctx: RequestContext) -> None:
        identity = self._keys.identify(ctx.request.headers)
        if identity == "key_store_unavailable":
            raise GatewayError(
                503,
                "API keys cannot be checked: the key store is unreachable; retry",
                type="server_error",
                code=identity,
                headers={"retry-after": "1"},
            )
        if not isinstance(identity, Identity):
            raise GatewayError(
                401,
                _MESSAGES[identity],
                type="authentication_error",
                code=identity,
                headers={"www-authenticate": 'Bearer realm="portcullis"'},
            )
        record = identity.record
        if record is not None and record.models:
            model = ctx.model or _named_model(ctx.payload)
            if model and not record.allows(model):
                raise model_not_allowed(model)
        ctx.tenant, ctx.key_label, ctx.key_id = identity.tenant, identity.label or None, identity.key_id or None
        ctx.key = record
        ctx.span.set_attribute("portcullis.tenant", ctx.tenant)


def _named_model(payload: dict[str, Any]) -> str:
    """The model a passthrough route's JSON body names, if any (its parse reads no model)."""
    model = payload.get("model")
    return model if isinstance(model, str) else ""


def model_not_allowed(model: str, param: str = "model") -> GatewayError:
    """The 403 for a model the calling key's allow-list does not name (`param`: where the request names it)."""
    return GatewayError(
        403,
        f"this API key may not use model {model[:MAX_MODEL_IN_MESSAGE]!r}"
        + ("" if param == "model" else f" ({param})"),
        type="permission_error",
        code="model_not_allowed",
        param=param,
    )
