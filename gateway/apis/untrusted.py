"""The strings of an answer that its format's table does not name, by provenance: identifiers, and untrusted text.

A format's table (gateway/apis/answers.py) says where the generated text of each event type it knows is (channels
with their provenance: the answer, reasoning, a refusal, a tool call's arguments or input), and its `Inventory`
which fields hold none: identifiers (ids, types, statuses, model names), opaque blobs (signatures, encrypted
reasoning, base64 media), the request's own settings that a Response echoes. Identifiers come on `Identifier`
channels, for the output guard to read once per distinct value, and so does the key of every object: a name the
client reads, which no redaction could rewrite without breaking the field. Every other string of an event, in an
event type the table knows or not, is text the client reads that no table vouches for: a new provider feature (a
new delta type, an audio transcript, a tool's output), a field a server added, a tool's name, and
an opaque field that holds something other than base64. The output guard scans it as it scans the answer, never
relays it unread.

Each such string is on an `Untrusted` channel named by its event's type and its place: the path to it, with its
event's own place (the top-level `index` and `*_index` fields: the output item, content part or block it belongs to)
and the choice it is in, and with an array's positions left out in a stream, so that a field that grows event by
event (a new kind of delta) is one text, read run together, as its client will join it. In a whole answer each
string is a channel of its own at its full path.
"""

from __future__ import annotations

import re
from collections.abc import Container, Hashable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

Place = tuple[int, Hashable]  # (id of a dict or list, key or index): where a value is held


@dataclass(frozen=True, slots=True)
class Untrusted:
    """A channel of strings that no table names: the event type they come in ("" for a whole answer) and where."""

    kind: str
    path: str


@dataclass(frozen=True, slots=True)
class Identifier:
    """A string of a field that names or labels rather than says (an id, a model, a status, a type): the event type
    it comes in ("" for a whole answer) and where."""

    kind: str
    path: str


# how deep `Inventory.quiet` looks (a chat tool call's arguments are at the seventh level); deeper, the walk reads
QUIET_DEPTH = 8


class _KeyNames:
    """The holder an object's key is read from: the key itself (one instance, nothing made per key)."""

    def __getitem__(self, key: str) -> str:
        return key


KEY_NAMES = _KeyNames()
_BASE64 = re.compile(r"[A-Za-z0-9+/=_\-\r\n]*")  # what an opaque field holds: base64 (standard or URL-safe, wrapped)


@dataclass(frozen=True)
class Inventory:
    """The fields of a format's answers that hold no generated text.

    `identifiers`: keys whose values name or label (ids, enums, models), wherever they appear, with all they hold:
    given on `Identifier` channels. `opaque` keys and `opaque_paths` (by event type, "" for any event and the whole
    answer): base64 blobs (encrypted reasoning, signatures, images, sound) that no reader of the answer reads as
    text: passed over while they are base64, read as text when they are not. `echoed` paths: the request's own
    settings that an answer repeats; `dropped` keys: fields the client never gets. `items`: the arrays whose
    elements are each one item (chat's choices, by their `index`)."""

    identifiers: frozenset[str]
    opaque: frozenset[str] = frozenset()
    opaque_paths: Mapping[str, frozenset[str]] = field(default_factory=dict)
    echoed: Mapping[str, frozenset[str]] = field(default_factory=dict)
    dropped: frozenset[str] = frozenset()
    items: frozenset[str] = frozenset()

    def untrusted(
        self, event: dict[str, Any], known: set[Place], seen: Container[str], *, whole: bool
    ) -> Iterator[tuple[Hashable, Any, Any]]:
        """(channel, holder, key) of each string of `event` that is not in `known` (the places of the texts the
        format read), in document order: an identifier's on an `Identifier` channel (unless its value was `seen`),
        and so is each key (a key names), any other on an `Untrusted` one, but for what the inventory says holds no
        text. `whole`: a whole answer, not a stream event."""
        if not self.quiet(event, known, seen):
            yield from self.walk(event, known, seen, whole=whole)

    def walk(
        self, event: dict[str, Any], known: set[Place], seen: Container[str], *, whole: bool
    ) -> Iterator[tuple[Hashable, Any, Any]]:
        """`untrusted` for any event, each string's channel named by its path: an explicit stack, as the answer is
        whatever the upstream sent."""
        kind = event.get("type")
        kind = kind if not whole and isinstance(kind, str) else ""
        opaque = self.opaque_paths.get("", frozenset()) | self.opaque_paths.get(kind, frozenset())
        echoed = self.echoed.get("", frozenset()) | self.echoed.get(kind, frozenset())
        place = "" if whole else _event_place(event)
        # (value, generalised path, the path it is named by, whether it is an identifier's)
        stack: list[tuple[Any, str, str, bool]] = [(event, "", "", False)]
        while stack:
            value, path, named, naming = stack.pop()
            holder = id(value)
            array = isinstance(value, list)
            items = array and path.rsplit(".", 1)[-1] in self.items
            found: list[tuple[Any, str, str, bool]] = []
            for key, child in enumerate(value) if array else value.items():
                if not array and key not in seen:  # a field's name is text its client reads: named, never rewritten
                    yield Identifier(kind, f"{place}{named or '(answer)'} key"), KEY_NAMES, key
                if not child or not isinstance(child, (str, dict, list)) or (holder, key) in known:
                    continue  # no text in it (an empty value, a number), or a known text, read on its own channel
                names = naming or key in self.identifiers
                if names and isinstance(child, str) and child in seen or key in self.dropped:
                    continue
                if array:  # positions left out of the generalised path, kept where they tell items apart
                    general, where = path + "[]", named + _label(child, key, items, whole)
                else:
                    general, where = (f"{path}.{key}", f"{named}.{key}") if path else (str(key), str(key))
                if general in echoed:
                    continue
                if (key in self.opaque or general in opaque) and isinstance(child, str) and _BASE64.fullmatch(child):
                    continue
                if isinstance(child, str):
                    yield (Identifier if names else Untrusted)(kind, place + where), value, key
                else:
                    found.append((child, general, where, names))
            stack.extend(reversed(found))

    def quiet(
        self,
        value: dict[str, Any] | list[Any],
        known: set[Place],
        seen: Container[str],
        naming: bool = False,
        depth: int = 0,
    ) -> bool:
        """Whether `untrusted` would give nothing: every key was `seen`, and every string in `value` is a known text,
        an identifier whose value was `seen`, base64 under an `opaque` key (OpenAI pads every event so) or under a
        `dropped` key. The common stream event (a delta of known text, its ids and keys read before) is decided here
        with no paths built; any other string, even one the walk would pass over (base64 at an opaque path, an echoed
        setting), and anything nested deeper than a delta is, answers no, and the walk decides. It passes over only
        what the walk passes over, by the same tests, so it cannot hide a string the walk would read."""
        if depth > QUIET_DEPTH:
            return False
        array = isinstance(value, list)
        for key, child in enumerate(value) if isinstance(value, list) else value.items():
            if not array and key not in seen:
                return False
            if not child or not isinstance(child, (str, dict, list)):
                continue
            names = naming or key in self.identifiers
            if names and isinstance(child, str) and child in seen or key in self.dropped or (id(value), key) in known:
                continue
            if key in self.opaque and isinstance(child, str) and _BASE64.fullmatch(child):
                continue
            if isinstance(child, str) or not self.quiet(child, known, seen, names, depth + 1):
                return False
        return True


def _label(element: Any, position: int, item: bool, whole: bool) -> str:
    """An array element's step in the path it is named by: an item's own `index` (chat's choices), its position
    in a whole answer, none in a stream (a field that grows event by event is one text)."""
    if item:
        number = element.get("index") if isinstance(element, dict) else None
        return f"[{number if isinstance(number, int) and not isinstance(number, bool) else position}]"
    return f"[{position}]" if whole else "[]"


def place_of(holder: Any, key: Any) -> Place:
    """Where a known text is held, as `Inventory.untrusted` compares it (a holder standing for another value, such
    as a tool_use block's `input` read as its JSON, names the place of that value)."""
    if type(holder) is dict or type(holder) is list:  # the common holder, without the look-up that fails for it
        return id(holder), key
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
