"""The admin audit log: one JSON line per change an operator makes through the admin API.

A line says when (`ts`, ISO-8601 UTC), who (`actor`: how the caller was let in, from which address, and the name it
gave in `x-portcullis-actor`), what (`action`, `key_id`, `tenant`), the key's public view `before` and `after` (never
a secret or a digest), and the admin request's id. Lines go to `admin.audit_log`, opened for append per line so
every line is written whole and several instances can share one file; unset, to the `portcullis.audit` logger.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

from starlette.requests import Request

from gateway.config import ConfigError

AUDIT_LOGGER = "portcullis.audit"
ACTOR_HEADER = "x-portcullis-actor"
MAX_ACTOR_NAME = 128

log = logging.getLogger(AUDIT_LOGGER)


@dataclass(frozen=True, slots=True)
class Actor:
    auth: str  # how the caller was let in: "admin-token", the only way there is
    address: str
    name: str | None  # what the caller calls itself: bounded, printable ASCII only, not verified


def actor_of(request: Request) -> Actor:
    named = request.headers.get(ACTOR_HEADER, "")
    name = "".join(c for c in named[:MAX_ACTOR_NAME] if c.isprintable() and c.isascii()) or None
    address = request.client.host if request.client else ""
    return Actor("admin-token", address, name)


class AuditLog:
    def __init__(self, path: Path | None) -> None:
        self.path = path
        if path is None:
            log.setLevel(logging.INFO)  # whatever the process's log level: audit lines are never filtered out
            return
        try:
            path.open("a").close()  # fail at start-up, not on the first change
        except OSError as exc:
            raise ConfigError(f"admin.audit_log: cannot append to {path}: {exc.strerror}") from None

    def record(
        self,
        action: str,
        actor: Actor,
        key_id: str,
        tenant: str,
        before: dict | None,
        after: dict | None,
        request_id: str,
    ) -> None:
        entry = {
            "ts": datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "actor": asdict(actor),
            "action": action,
            "key_id": key_id,
            "tenant": tenant,
            "before": before,
            "after": after,
            "request_id": request_id,
        }
        if self.path is None:
            log.info("admin %s of key %s", action, key_id, extra={"access": entry})  # emitted as the entry itself
            return
        with self.path.open("a") as out:  # closing flushes: one whole line per action
            out.write(json.dumps(entry, separators=(",", ":")) + "\n")
