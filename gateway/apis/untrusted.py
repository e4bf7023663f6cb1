"""The strings of an answer that its format's table does not name: text the output guard reads as untrusted.

A format's table (gateway/apis/answers.py) says where the generated text of each event type it knows is (channels
with their provenance: the answer, reasoning, a refusal, a tool call's arguments or input), and which fields hold
none (its `Inventory`: ids, enums, opaque blobs such as signatures and encrypted reasoning, the request's own
settings that a Response echoes). Every other string of an event, in an event type the table knows or not, is text
the client reads that no table vouches for: a new provider feature (a new delta type, an audio transcript, a tool's
output), a field a server added, logprobs' tokens, a tool's name. The output guard scans it as it scans the
answer, never relays it unread.

Each such string is on an `Untrusted` channel named by its event's type and its place: the path to it, with its
event's own place (the top-level `index` and `*_index` fields: the output item, content part or block it belongs to)
and the choice it is in, and with an array's positions left out in a stream, so that a field that grows event by
event (a new kind of delta) is one text, read run together, as its client will join it. In a whole answer each
string is a channel of its own at its full path.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

Place = tuple[int, Hashable]  # (id of a dict or list, key or index): where a value is held


@dataclass(frozen=True, slots=True)
class Untrusted:
    """A channel of strings that no table names: the event type they come in ("" for a whole answer) and where."""

    kind: str
    path: str


@dataclass(frozen=True)
class Inventory:
    """The fields of a format's answers that hold no generated text: `keys` wherever they appear, `paths` (in an
    event of the type they are listed under; "" for any event and the whole answer) where they are, each with all it
    holds. `items`: the arrays whose elements are each one item (chat's choices, by their `index`)."""

    keys: frozenset[str]
    paths: Mapping[str, frozenset[str]] = field(default_factory=dict)
    items: frozenset[str] = frozenset()

    def untrusted(
        self, event: dict[str, Any], known: set[Place], *, whole: bool
    ) -> Iterator[tuple[Hashable, Any, Any]]:
        """(channel, holder, key) of each string of `event` that is neither in `known` (the places of the texts the
        format read) nor a field this inventory names, in document order. `whole`: a whole answer, not a stream event.
        An explicit stack: the answer is whatever the upstream sent."""
        kind = event.get("type")
        kind = kind if not whole and isinstance(kind, str) else ""
        listed = self.paths.get("", frozenset()) | self.paths.get(kind, frozenset())
        place = "" if whole else _event_place(event)
        skipped = self.keys
        stack: list[tuple[Any, str, str]] = [(event, "", "")]  # (value, generalised path, the path it is named by)
        while stack:
            value, path, named = stack.pop()
            holder = id(value)
            found: list[tuple[Any, str, str]] = []
            children = (
                (
                    (key, child, f"{path}.{key}" if path else key, f"{named}.{key}" if named else key)
                    for key, child in value.items()
                )
                if isinstance(value, dict)
                else self._elements(value, path, named, whole)
            )
            for key, child, general, where in children:
                if not child or key in skipped or (holder, key) in known or general in listed:
                    continue  # an empty value holds no text; nor does a field the inventory names
                if isinstance(child, str):
                    yield Untrusted(kind, place + where), value, key
                elif isinstance(child, (dict, list)):
                    found.append((child, general, where))
            stack.extend(reversed(found))

    def _elements(self, value: list[Any], path: str, named: str, whole: bool) -> Iterator[tuple[int, Any, str, str]]:
        """(position, element, its generalised path, the path it is named by) of each element of an array: the
        positions are left out of the generalised path, and kept in the named one where they tell items apart (in a
        whole answer; in an `items` array, by the item's own `index`)."""
        items = path.rsplit(".", 1)[-1] in self.items
        general = path + "[]"
        for i, child in enumerate(value):
            number = child.get("index") if items and isinstance(child, dict) else None
            if items:
                label = f"[{number if isinstance(number, int) and not isinstance(number, bool) else i}]"
            else:
                label = f"[{i}]" if whole else "[]"
            yield i, child, general, named + label


def place_of(holder: Any, key: Any) -> Place:
    """Where a known text is held, as `Inventory.untrusted` compares it (a holder standing for another value, such
    as a tool_use block's `input` read as its JSON, names the place of that value)."""
    owner = getattr(holder, "place", None)
    return owner if owner is not None else (id(holder), key)


def _event_place(event: dict[str, Any]) -> str:
    """The item, part or block an event is about, from its top-level index fields: `output_index=1 ` ..."""
    marks = [
        f"{name}={value} "
        for name, value in event.items()
        if (name == "index" or name.endswith("_index")) and isinstance(value, int) and not isinstance(value, bool)
    ]
    return "".join(marks)
