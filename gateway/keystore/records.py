"""What the key store holds about one API key, and how its secret is made and recognised.

A secret reads `pcl-<id>-<random>`: the id is public (it names the key in logs, limits, spend reports and the admin
API) and lets a lookup find the one record to compare, so a store of many keys costs one dictionary lookup per
request. Only the secret's SHA-256 digest is stored: a secret of 256 random bits needs no slow password hash, the
way GitHub and Stripe store theirs. Rotation keeps the previous digest valid until its grace period ends.
"""

from __future__ import annotations

import functools
import hashlib
import secrets
import time
from fnmatch import fnmatchcase
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from gateway.policy.model import Budget, RuleId
from gateway.tenancy.tenant_name import TenantName

SECRET_PREFIX = "pcl-"
_ID_END = len(SECRET_PREFIX) + 12  # the id: 12 characters after the prefix, then '-'
_SECRET_LENGTH = _ID_END + 1 + 43  # then 32 random bytes in URL-safe base64

KeyId = Annotated[str, Field(pattern=r"^[a-z0-9]{12}$")]
ModelGlob = Annotated[str, Field(min_length=1, max_length=256)]
Digest = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


class KeySettings(BaseModel):
    """What an operator sets on a key (the admin API's create and update bodies)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tenant: TenantName
    label: Annotated[str, Field(max_length=128)] = ""
    models: Annotated[list[ModelGlob], Field(max_length=64)] = Field(
        default_factory=list, description="models this key may call, as globs ('gpt-4o*'); empty: any"
    )
    expires_at: float | None = Field(default=None, description="Unix seconds after which the key is refused")
    limits: Annotated[dict[RuleId, Annotated[int, Field(gt=0)]], Field(max_length=64)] = Field(
        default_factory=dict,
        description="this key's own limits for policy rate-limit rules, by rule id (key, kind and period stay)",
    )
    budget: Budget | None = Field(default=None, description="this key's own spend limit, on top of policy budgets")
    metadata: Annotated[
        dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]], Field(max_length=32)
    ] = Field(default_factory=dict)

    def allows(self, model: str) -> bool:
        """Whether this key may call `model` (its globs; none: any model)."""
        return not self.models or any(fnmatchcase(model, allowed) for allowed in self.models)


class KeyRecord(KeySettings):
    """A stored key: its settings, its digests and its history."""

    id: KeyId
    digest: Digest
    previous_digest: Digest | None = None
    previous_valid_until: float | None = Field(default=None, description="the rotated-out secret works until then")
    created_at: float
    updated_at: float
    revoked_at: float | None = None

    def public(self) -> dict:
        """The record as the admin API and the audit log show it: no digests."""
        return self.model_dump(exclude={"digest", "previous_digest"})

    @functools.cached_property
    def _digest_bytes(self) -> bytes:  # compared on every request the key makes
        return bytes.fromhex(self.digest)

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and now >= self.expires_at

    def matches(self, digest: bytes, now: float) -> bool:
        """Whether a presented secret's digest is this key's current secret, or its previous one within the grace
        period; says nothing of revocation or expiry (auth tells an expired key's holder so, no one else)."""
        if secrets.compare_digest(self._digest_bytes, digest):
            return True
        return (
            self.previous_digest is not None
            and self.previous_valid_until is not None
            and now < self.previous_valid_until
            and secrets.compare_digest(bytes.fromhex(self.previous_digest), digest)
        )


def new_key_id() -> str:
    return secrets.token_hex(6)


def new_secret(key_id: str) -> str:
    return f"{SECRET_PREFIX}{key_id}-{secrets.token_urlsafe(32)}"


def key_id_of(secret: str) -> str | None:
    """The public id inside a stored key's secret; None for anything else (a static key, garbage)."""
    # by position, not by a regex: every request asks. The id only picks the record whose digest is compared, so a
    # malformed one is refused by that comparison (or found in no record) like any wrong secret
    if len(secret) != _SECRET_LENGTH or not secret.startswith(SECRET_PREFIX) or secret[_ID_END] != "-":
        return None
    return secret[len(SECRET_PREFIX) : _ID_END]


def digest_of(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def now() -> float:
    return time.time()
