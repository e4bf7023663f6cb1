"""What the gateway records of an upstream object a tenant made: whose it is, its kind, when it was made."""

from __future__ import annotations

from typing import NamedTuple


class ObjectRecord(NamedTuple):
    tenant: str
    kind: str  # the catalog's kind: "file", "response", "batch"... (gateway/tenancy/catalog.py)
    created_at: float  # Unix seconds


class Made(NamedTuple):
    """An object the upstream made for a tenant: its id and its record."""

    object_id: str
    record: ObjectRecord


class StoreUnavailable(Exception):
    """The store did not answer: nothing is decided about ownership without it."""
