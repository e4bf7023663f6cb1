"""Which tool call a streamed chat fragment belongs to.

OpenAI and vLLM name a fragment's call by its `index`, and give the call's `id` with its first fragment only. Some
OpenAI-compatible servers send no index, or put every call at index 0 (lmdeploy), and tell calls apart by their
ids (SGLang repeats the id on every fragment). A fragment with an id not seen before starts a new call, whatever its
index, and so does one whose id was seen at another index (a server or model that names calls by their function,
`get_weather` twice); one without an id continues the call at its index, and one with neither continues the last
call. The Messages translation (each call its own tool_use block) and the output guard (each call's arguments their
own JSON text) read a stream's calls the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class _Call:
    number: int
    id: str
    index: int | None


class StreamedCalls:
    """One streamed choice's tool calls, numbered 0, 1, ... in the order they start. Looked up, not searched: an
    upstream may send thousands of calls."""

    def __init__(self) -> None:
        self._started = 0
        self._ids: dict[str, _Call] = {}  # the newest call with each id the upstream gave
        self._at: dict[int, _Call] = {}  # the newest call at each upstream index
        self._last: _Call | None = None

    def number(self, fragment: dict[str, Any]) -> tuple[int, bool]:
        """The number of the call a fragment belongs to, and whether the fragment starts it. An id or an index of the
        wrong type names no call."""
        upstream_id, index = fragment.get("id"), fragment.get("index")
        upstream_id = upstream_id if isinstance(upstream_id, str) else ""
        index = index if isinstance(index, int) else None
        known = self._find(upstream_id, index)
        if known is not None:
            return known.number, False
        call = self._last = _Call(self._started, upstream_id, index)
        self._started += 1
        if upstream_id:
            self._ids[upstream_id] = call
        if index is not None:
            self._at[index] = call
        return call.number, True

    def _find(self, upstream_id: str, index: int | None) -> _Call | None:
        if not upstream_id:
            return self._at.get(index) if index is not None else self._last
        call = self._ids.get(upstream_id)
        if call is not None and (index is None or call.index in (None, index)):
            return call
        at = self._at.get(index) if index is not None else None
        return at if at is not None and at.id == upstream_id else None  # an id seen before, at this index
