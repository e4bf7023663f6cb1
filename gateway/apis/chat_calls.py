"""Which tool call a streamed chat fragment belongs to.

OpenAI and vLLM name a fragment's call by its `index`, and give the call's `id` with its first fragment only. Some
OpenAI-compatible servers send no index, or put every call at index 0 (lmdeploy), and tell calls apart by their
ids (SGLang repeats the id on every fragment). A fragment with an id not seen before starts a new call, whatever its
index; one without an id continues the call at its index, and one with neither continues the last call. The Messages
translation (each call its own tool_use block) and the output guard (each call's arguments their own JSON text)
read a stream's calls the same way.
"""

from __future__ import annotations

from typing import Any


class StreamedCalls:
    """One streamed choice's tool calls, numbered 0, 1, ... in the order they start. Looked up, not searched: an
    upstream may send thousands of calls."""

    def __init__(self) -> None:
        self._started = 0
        self._ids: dict[str, int] = {}  # by the id the upstream gave the call
        self._at: dict[int, int] = {}  # the newest call at each upstream index

    def number(self, fragment: dict[str, Any]) -> tuple[int, bool]:
        """The number of the call a fragment belongs to, and whether the fragment starts it. An id or an index of the
        wrong type names no call."""
        upstream_id, index = fragment.get("id"), fragment.get("index")
        upstream_id = upstream_id if isinstance(upstream_id, str) else ""
        index = index if isinstance(index, int) else None
        if upstream_id:
            known = self._ids.get(upstream_id)
        elif index is not None:
            known = self._at.get(index)
        else:
            known = self._started - 1 if self._started else None
        if known is not None:
            return known, False
        number, self._started = self._started, self._started + 1
        if upstream_id:
            self._ids[upstream_id] = number
        if index is not None:
            self._at[index] = number
        return number, True
