"""KeyRing: the keys every request is looked up in, held in this process's memory.

Two kinds of key open the gateway: static keys from `auth.keys` in the config (indexed by an 8-byte digest prefix an
attacker cannot steer, confirmed in constant time), and keys stored through the admin API (indexed by the public id
inside their secret). A lookup is synchronous and costs one SHA-256 and a dictionary lookup, whatever the number of
keys: it runs on every request, in the WAF (which needs the tenant before auth decides) and in auth.

Stored keys reach the ring from the key store (gateway/keystore/store.py): loaded whole before the gateway serves,
then polled for changes every `store.poll_interval` seconds. A poll that fails is logged and retried; the ring keeps
what it had, so a store outage stops no one whose key was already known (and lets no revoked key back in). What it
had may be stale: a key revoked through an instance that still reaches the store works here until a poll succeeds.
`store.max_key_staleness`, where set, bounds that: once the last successful read is older, stored keys (and anonymous
access, which holds only while no key exists) are refused as `key_store_unavailable` until the store answers, when
the changes missed apply at once. Static keys need no store and keep working.

No keys → anonymous: while there are no static keys and the key store has never held a key, every request is served
as tenant 'anonymous' (a first run, `make run`), unless `auth.anonymous` is off. Once a key exists the gateway stays
closed: a revoked or expired key still counts (revoking the last key must not open the gateway), and so does a key
this process has seen in a store that has since lost it (a Redis without persistence restarted).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from prometheus_client import Gauge

from gateway.config import AuthConfig, StoreConfig
from gateway.keystore.changes import Changes
from gateway.keystore.records import KeyRecord, key_id_of
from gateway.keystore.store import KeyStoreBackend

log = logging.getLogger(__name__)

ANONYMOUS = "anonymous"

# Why a request's key was refused; "invalid_api_key" covers unknown and revoked alike.
Refusal = Literal["missing_api_key", "invalid_api_key", "expired_api_key", "key_store_unavailable"]


@dataclass(frozen=True, slots=True)
class Identity:
    tenant: str
    label: str
    key_id: str  # a stored key's public id; a static key's digest prefix; "" when anonymous
    record: KeyRecord | None = None  # the stored key's record; None for a static key or anonymous


_ANONYMOUS = Identity(ANONYMOUS, "", "")

StaticKeys = dict[bytes, tuple[bytes, Identity]]  # digest prefix → (digest, identity)


class KeyRing:
    def __init__(self, auth: AuthConfig, backend: KeyStoreBackend, store: StoreConfig, synced: Gauge) -> None:
        """`synced` is set to the Unix time of each successful read of the store."""
        self._static = static_keys(auth)
        self._stored: dict[str, tuple[KeyRecord, Identity]] = {}  # id → record, for stored keys not revoked
        self._closed = bool(self._static) or not auth.anonymous  # a key exists (or anonymous is off): never opens
        self._backend = backend
        self._poll_interval = store.poll_interval
        self._max_staleness = store.max_key_staleness
        self._synced = synced
        self._synced_at = 0.0  # time.monotonic() of the last successful read
        self._stale = False  # the last read is older than `max_staleness`: the store's decisions are refused
        self.epoch: str | None = None  # the store lifetime the ring's copy is of (None: nothing loaded yet)
        self.version = 0  # the store version the ring holds, within that epoch
        self._poller: asyncio.Task[None] | None = None
        self._closing = False
        self._refreshing = asyncio.Lock()  # one refresh at a time: an older answer must not undo a newer one
        self._failing = False
        self._was_anonymous: bool | None = None

    def use_static(self, keys: StaticKeys) -> None:
        """The static keys of a reloaded config, in one assignment: a key it dropped opens nothing from now on.
        Dropping them all does not open the gateway: a key existed."""
        self._static = keys
        self._closed = self._closed or bool(keys)
        self._log_anonymous()

    @property
    def anonymous(self) -> bool:
        return not self._closed

    def lookup(self, headers: Mapping[str, str]) -> Identity | None:
        """The identity a request's key belongs to (anonymous when no keys are configured), or None: a lookup never
        refuses, the auth stage does."""
        found = self.identify(headers)
        return found if isinstance(found, Identity) else None

    def identify(self, headers: Mapping[str, str]) -> Identity | Refusal:
        """The identity a request's key opens now, or why it opens none."""
        if not self._closed:
            return "key_store_unavailable" if self._stale else _ANONYMOUS
        presented = presented_key(headers)
        if presented is None:
            return "missing_api_key"
        key_id = key_id_of(presented)
        if key_id and self._stale:
            return "key_store_unavailable"
        digest = hashlib.sha256(presented.encode()).digest()
        stored = self._stored.get(key_id) if key_id else None
        if stored is not None:
            record, identity = stored
            now = time.time()
            if not record.matches(digest, now):
                return "invalid_api_key"
            return "expired_api_key" if record.expired(now) else identity
        entry = self._static.get(digest[:8])
        if entry is None or not hmac.compare_digest(entry[0], digest):
            return "invalid_api_key"
        return entry[1]

    async def start(self) -> None:
        """Load the stored keys (before the gateway serves: a failure here stops it starting), then poll."""
        await self.refresh()
        self._poller = asyncio.create_task(self._poll(), name="keyring-poll")

    async def refresh(self) -> None:
        """Apply the store's changes since the version held (the poller does; so may a writer that wants its change
        seen here at once)."""
        async with self._refreshing:
            found = await self._backend.changes(self.version)
            # another lifetime of the store (Redis restarted or wiped), or a version that went back: the changes
            # after the ring's version are not all those made since its copy, so the whole store is read again
            full = found.epoch != self.epoch or found.version < self.version
            if full and self.version:
                found = await self._backend.changes(0)
            self._apply(found, full)
            self._read_succeeded()

    def _apply(self, found: Changes, full: bool) -> None:
        stored = {} if full else self._stored
        self._closed = self._closed or bool(found.records)  # a key was made: revoking it later must not open it
        for record in found.records:
            if record.revoked_at is None:
                stored[record.id] = (record, Identity(record.tenant, record.label, record.id, record))
            else:
                stored.pop(record.id, None)
        self._stored, self.epoch, self.version = stored, found.epoch, found.version
        self._log_anonymous()

    async def aclose(self) -> None:
        if self._poller is not None:
            self._closing = True  # the poller stops even where a client turned its cancellation into an error
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
            self._poller = None

    async def _poll(self) -> None:
        while not self._closing:
            await asyncio.sleep(self._poll_interval)
            try:
                await self.refresh()
            except Exception as err:
                self._poll_failed(err)

    def _read_succeeded(self) -> None:
        """A read of the store succeeded: the ring is current."""
        self._synced_at = time.monotonic()
        self._synced.set(time.time())
        if self._failing:
            log.warning(
                "key store %s: polling works again, at version %d%s",
                self._backend.name,
                self.version,
                "; stored keys are accepted again" if self._stale else "",
            )
        self._failing = self._stale = False

    def _poll_failed(self, err: Exception) -> None:
        if not self._failing:
            log.warning(
                "key store %s: polling failed (%s: %s); keys stay as of version %d, retrying",
                self._backend.name,
                type(err).__name__,
                err,
                self.version,
            )
        self._failing = True
        stale_for = time.monotonic() - self._synced_at
        if not self._stale and self._max_staleness is not None and stale_for > self._max_staleness:
            self._stale = True
            log.error(
                "key store %s: not read for %.0f s (store.max_key_staleness %g s); stored keys are refused with 503 "
                "key_store_unavailable until it answers",
                self._backend.name,
                stale_for,
                self._max_staleness,
            )

    def _log_anonymous(self) -> None:
        anonymous = self.anonymous
        if anonymous != self._was_anonymous:
            if anonymous:
                log.warning("auth: no API key exists; every request is served as tenant %r", ANONYMOUS)
            elif self._was_anonymous:
                log.warning("auth: an API key exists; from now on requests without a valid key are refused")
            self._was_anonymous = anonymous


def static_keys(auth: AuthConfig) -> StaticKeys:
    """`auth.keys` as looked up; a key's variable that is not set is a ConfigError."""
    keys: StaticKeys = {}
    for key in auth.keys:
        digest = key.digest()
        keys[digest[:8]] = (digest, Identity(key.tenant, key.label, digest[:6].hex()))
    return keys


def presented_key(headers: Mapping[str, str]) -> str | None:
    auth = headers.get("authorization")
    if auth:
        scheme, _, token = auth.partition(" ")
        return token.strip() or None if scheme.lower() == "bearer" else None
    return headers.get("x-api-key") or headers.get("api-key")
