"""KeyStore: the API-key table (SHA-256 digests → tenant and label), lookup only.

Stages that must know who is calling before authentication decides — the WAF runs before auth so that attacks are
refused before any per-tenant work — look the presented key up here. A lookup never rejects: an unknown or missing
key is simply `None`, and the auth stage remains the one place that refuses.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass

from gateway.config import AuthConfig

ANONYMOUS = "anonymous"


@dataclass(frozen=True, slots=True)
class Identity:
    tenant: str
    label: str
    key_id: str


class KeyStore:
    def __init__(self, config: AuthConfig) -> None:
        # Indexed by an 8-byte digest prefix an attacker cannot steer; the full digest is confirmed in constant time.
        self._keys: dict[bytes, tuple[bytes, str, str]] = {}  # prefix → (digest, tenant, label)
        for key in config.keys:
            digest = key.digest()
            self._keys[digest[:8]] = (digest, key.tenant, key.label)

    @property
    def empty(self) -> bool:
        return not self._keys

    def lookup(self, headers: Mapping[str, str]) -> Identity | None:
        """The identity a request's key belongs to; anonymous when no keys are configured; None when unknown."""
        if not self._keys:
            return Identity(ANONYMOUS, "", "")
        presented = presented_key(headers)
        if presented is None:
            return None
        digest = hashlib.sha256(presented.encode()).digest()
        entry = self._keys.get(digest[:8])
        if entry is None or not hmac.compare_digest(entry[0], digest):
            return None
        _, tenant, label = entry
        return Identity(tenant, label, digest[:6].hex())


def presented_key(headers: Mapping[str, str]) -> str | None:
    auth = headers.get("authorization")
    if auth:
        scheme, _, token = auth.partition(" ")
        return token.strip() or None if scheme.lower() == "bearer" else None
    return headers.get("x-api-key") or headers.get("api-key")
