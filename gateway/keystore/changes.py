"""What a look at the key store for changed keys answers."""

from __future__ import annotations

from typing import NamedTuple

from gateway.keystore.records import KeyRecord


class Changes(NamedTuple):
    """The store's version and the records changed after the version asked about.

    A version counts changes within one lifetime of the store (`epoch`): a Redis restarted empty or from an older
    snapshot, or wiped, counts again from where it was left, so the same version can name other changes. Versions
    of two epochs are not comparable: a reader whose copy is of another epoch must load the whole store again.
    """

    epoch: str
    version: int
    records: list[KeyRecord]
