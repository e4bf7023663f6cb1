"""The classifier's scores of texts it has read, so a text that comes back costs a lookup instead of the model.

Why: a deployment's system prompt and tool definitions ride on every request of its agents, and the guard reads
every provenance, so without this each request would pay the classifier again for the same few kilobytes.

Keyed by tenant, reading settings (window, overlap, first pass) and a BLAKE2b-128 digest of the text: no text is
kept, one tenant's texts never answer another's lookup (so a hit's speed tells nothing across tenants), and other
reading settings never read old scores. One cache belongs to one loaded classifier and goes with it on reload.
Bounded by entries, least recently used out first.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict

# (tenant, window, overlap, first pass above, digest of the text): every setting that changes how a text is read
Key = tuple[str | None, int, int, int | None, bytes]


def digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


class ScoreCache:
    """Thread-safe: lookups run on the offload executor's threads, stores on the event loop."""

    def __init__(self, entries: int) -> None:
        self.entries = entries
        self._scores: OrderedDict[Key, float] = OrderedDict()
        self._lock = threading.Lock()

    def lookup(self, keys: list[Key]) -> list[float | None]:
        """Each key's score, or None where the text has not been scored (or has been pushed out)."""
        if not self.entries:
            return [None] * len(keys)
        found: list[float | None] = []
        with self._lock:
            for key in keys:
                score = self._scores.get(key)
                if score is not None:
                    self._scores.move_to_end(key)
                found.append(score)
        return found

    def store(self, keys: list[Key], scores: list[float]) -> None:
        if not self.entries:
            return
        with self._lock:
            for key, score in zip(keys, scores):
                self._scores[key] = score
                self._scores.move_to_end(key)
            while len(self._scores) > self.entries:
                self._scores.popitem(last=False)
