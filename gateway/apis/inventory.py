"""The content inventory of a request: every string it carries, what it is, and where it lives.

Every stage that reads content reads this, and only this: the WAF (its `args` and `prompt` parts), the guard
(the classifier and the PII/secret detectors), redaction, and token counting where it reads texts. Each string leaf
of the payload appears in it exactly once (a string that holds JSON, a tool call's arguments, as the strings in it),
classified as:

- `text`: what a model reads, with its provenance: `system`, `developer`, `user`, `assistant` (earlier turns),
  `reasoning`, `tool_result`, `document` (attached files, retrieved documents, search results), `tool_arguments`
  (calls a model wrote), `tool_definitions` (tool and output-schema descriptions), `prompt` (role-less: completions
  prompts, embeddings inputs), or `unknown`;
- `identifier`: ids, call ids, names, tool names, URLs the provider fetches;
- `field`: an application field (model, sampling settings, metadata);
- `opaque`: what no detector here can read: media the model sees or hears rather than reads (images, audio,
  video, non-text files), as valid base64 or as the http(s) URL the provider fetches it from, and a provider's
  encrypted state (valid base64 too). A value that claims to be one and is not is unknown text.

Numbers are listed too, as fields (the WAF's `args` reads them). Token-id prompts are listed apart, to be decoded.

Each request shape describes its payload as a table of carriers (`Spec`s built from the constructors below); one
walker, `take`, visits every node of the payload with the spec its table gives it. Coverage is the walker's
structure, not a list of fields to read: a container's spec hands every child a spec, a key or type the table does
not know gets `UNKNOWN`, and so does a value of a type the table did not expect. Unknown content is read by
everyone: the guard and the WAF's prompt packs as text, and the WAF's argument packs too (an unknown object's `type`
only by the argument packs: a label). `guard.unknown_content: refuse` refuses a request that has any.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from gateway.apis import encoded
from gateway.apis.encoded import DecodedText
from gateway.guard.folding import folded
from gateway.json_path import dotted

Location = tuple[str | int, ...]  # keys and indices from the payload's root
Kind = Literal["text", "identifier", "field", "opaque"]
# Where a text of a conversation came from (a policy names these to choose what the guard scans, and how) ...
MessageProvenance = Literal[
    "system",
    "developer",
    "user",
    "assistant",
    "reasoning",
    "tool_result",
    "document",
    "tool_arguments",
    "tool_definitions",
]
# ... and the texts that have none: role-less prompts (completions, embeddings), and content no shape classifies
Provenance = Literal[MessageProvenance, "prompt", "unknown"]


@dataclass(slots=True, eq=False)
class Carried:
    """One leaf of the payload: where it is, what it is, and the holder (dict or list) to rewrite it in.

    `unit` is the carrier a text is read with: a message's content, a block, a document, a tool call's arguments, a
    tool definition; the guard's classifier reads each unit's texts together. A decoded text (a file sent as base64,
    a token-id prompt) keeps its decoder in `decoded`; one without a holder cannot be rewritten. A string inside a
    JSON text (a tool call's arguments) has the parsed JSON's container as its holder, and `embedded` writes the JSON
    back."""

    loc: Location
    holder: Any
    kind: Kind
    provenance: Provenance | None
    unit: Location
    decoded: DecodedText | None = None
    embedded: encoded.EmbeddedJson | None = None

    @property
    def key(self) -> str | int:
        return self.loc[-1]

    @property
    def text(self) -> str:
        """The text as its reader reads it: decoded where it was sent encoded; numbers as JSON writes them."""
        if self.decoded is not None:
            return self.decoded.text
        value = self.holder[self.loc[-1]]
        return value if type(value) is str else _number(value)

    @property
    def where(self) -> str:
        return where(self.loc)

    def rewrite(self, text: str) -> None:
        """Put a rewritten text (a redaction) where this one came from, encoded as it was sent."""
        if self.holder is None:
            raise ValueError(f"{dotted(self.loc)} cannot be rewritten")
        self.holder[self.loc[-1]] = text if self.decoded is None else self.decoded.encode(text)
        if self.embedded is not None:
            self.embedded.write_back()


@dataclass(frozen=True, slots=True)
class TokenPrompt:
    """A prompt sent as token ids: the model reads them as surely as text, so the guard decodes and scans them."""

    ids: list[int]
    loc: Location


@dataclass(slots=True, eq=False)
class Passage:
    """One unit of text as the guard's classifier reads it: the texts of one carrier and provenance, joined, each as
    its reader sees it (gateway/guard/folding.py: NFKC, invisible characters removed)."""

    provenance: Provenance
    unit: Location
    parts: list[Carried]

    @property
    def text(self) -> str:
        if len(self.parts) == 1:
            return folded(self.parts[0].text)
        return "\n".join(folded(part.text) for part in self.parts)

    @property
    def where(self) -> str:
        return where(self.unit)


@dataclass(slots=True, eq=False)
class Inventory:
    """What one request carries, in payload order, and the JSON shape the WAF counts (keys, depth)."""

    carried: list[Carried] = field(default_factory=list)
    token_prompts: list[TokenPrompt] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)  # every object key, wherever it is
    # models the request asks its provider to run besides its own (`ModelChoice`): the parse stage refuses them
    other_models: list[Location] = field(default_factory=list)
    runs: list[Location] = field(default_factory=list)  # the arrays whose texts are read as one run (`Run`)
    depth: int = 0  # containers nested, 0 for no JSON body
    _by_loc: dict[Location, Carried] | None = None

    def texts(self) -> list[Carried]:
        return [c for c in self.carried if c.kind == "text"]

    def unknown(self) -> list[Carried]:
        return [c for c in self.carried if c.provenance == "unknown"]

    def at(self, loc: Location) -> Carried | None:
        by_loc = self._by_loc
        if by_loc is None:
            by_loc = self._by_loc = {c.loc: c for c in self.carried}
        return by_loc.get(loc)


def passages(texts: list[Carried], arrays: list[Location]) -> list[Passage]:
    """The texts grouped into the units the classifier reads, in the order their first text comes: a `Run` array's
    texts (a message's content parts, `arrays`) are one unit, as its reader reads them, named by the array where
    it has two or more."""
    find = _runs_finder(arrays)
    out: dict[tuple[Location, str | None], Passage] = {}
    for carried in texts:
        found = find(carried.loc)
        unit = carried.unit if found is None else found[0]
        key = (unit, carried.provenance)
        passage = out.get(key)
        if passage is None:  # named by its one text's unit until a second part joins it
            out[key] = Passage(carried.provenance or "unknown", carried.unit, [carried])
        else:
            passage.parts.append(carried)
            passage.unit = unit
    return list(out.values())


def runs(texts: list[Carried], arrays: list[Location]) -> list[list[Carried]]:
    """The texts of `Run` arrays that its reader reads as one text, two or more in a row: those of parts next to
    each other (a key split across two content parts in a row is whole there; an image or a tool result between
    two parts ends a run). A text belongs to the innermost run array it is in."""
    find = _runs_finder(arrays)
    out: list[list[Carried]] = []
    last: dict[Location, tuple[int, list[Carried]]] = {}  # each array's current run, and the part it reached
    for carried in texts:
        found = find(carried.loc)
        if found is None:
            continue
        array, part = found
        reached = last.get(array)
        if reached is not None and part - reached[0] <= 1:
            reached[1].append(carried)
            last[array] = (part, reached[1])
        else:
            last[array] = (part, [carried])
            out.append(last[array][1])
    return [parts for parts in out if len(parts) > 1]


def _runs_finder(arrays: list[Location]) -> Callable[[Location], tuple[Location, int] | None]:
    """The innermost of these arrays a location is in, and the index of its part there."""
    depths = sorted({len(a) for a in arrays}, reverse=True)
    known = set(arrays)

    def find(loc: Location) -> tuple[Location, int] | None:
        for depth in depths:
            if depth < len(loc) and type(loc[depth]) is int and loc[:depth] in known:
                return loc[:depth], int(loc[depth])
        return None

    return find


def where(loc: Location) -> str:
    """A place for people: the message or part a text is the content of ("messages[2]", "messages[0].content[1]"),
    or its own field ("tools[0].function.description")."""
    return dotted(loc[:-1] if len(loc) > 1 and loc[-1] in ("content", "text") else loc)


# -- taking the inventory -------------------------------------------------------------------------------------------


class _Walk:
    __slots__ = ("stack", "inventory")

    def __init__(self) -> None:
        self.stack: list[tuple[Spec, Any, Location, Any, Provenance | None, Location | None]] = []
        self.inventory = Inventory()

    def leaf(
        self, kind: Kind, loc: Location, holder: Any, provenance: Provenance | None, unit: Location | None
    ) -> None:
        if holder is not None:  # (the payload itself is an object: a leaf always has a holder)
            self.inventory.carried.append(Carried(loc, holder, kind, provenance, unit or loc))

    def text(
        self,
        loc: Location,
        holder: Any,
        provenance: Provenance | None,
        unit: Location | None,
        decoded: DecodedText | None = None,
    ) -> None:
        if holder is not None:
            self.inventory.carried.append(Carried(loc, holder, "text", provenance or "unknown", unit or loc, decoded))


def take(spec: Spec, payload: Any) -> Inventory:
    """The inventory of a payload under a shape's table (explicit stack: a payload may nest as deep as its limits
    let it)."""
    walk = _Walk()
    stack = walk.stack
    inventory = walk.inventory
    carried, keys = inventory.carried, inventory.keys
    deepest = 0
    stack.append((spec, payload, (), None, None, None))
    while stack:
        spec, node, loc, holder, provenance, unit = stack.pop()
        kind = type(node)
        if kind is dict:
            keys.extend(node)
            if len(loc) >= deepest:
                deepest = len(loc) + 1
        elif kind is list:
            if len(loc) >= deepest:
                deepest = len(loc) + 1
        elif kind is not str:
            if (kind is int or kind is float) and holder is not None:
                carried.append(Carried(loc, holder, "field", None, loc))
            continue  # true, false, null: nothing to read
        spec.visit(node, loc, holder, provenance, unit, walk)
    inventory.depth = deepest
    return inventory


# -- the table's vocabulary -----------------------------------------------------------------------------------------


class Spec:
    """How one node of a payload, and everything under it, is classified."""

    __slots__ = ()

    def visit(
        self, node: Any, loc: Location, holder: Any, provenance: Provenance | None, unit: Location | None, walk: _Walk
    ) -> None:
        """`node` is a string, an object or an array (the walker handles numbers and the rest)."""
        raise NotImplementedError


class Leaf(Spec):
    """A string of one kind (text: of this provenance, or the enclosing carrier's when None)."""

    __slots__ = ("kind", "provenance")

    def __init__(self, kind: Kind, provenance: Provenance | None = None) -> None:
        self.kind = kind
        self.provenance = provenance

    def visit(self, node, loc, holder, provenance, unit, walk):  # type: ignore[no-untyped-def]
        if type(node) is not str:
            UNKNOWN.visit(node, loc, holder, provenance, unit, walk)
        elif self.kind == "text":
            walk.text(loc, holder, self.provenance or provenance, unit)
        else:
            walk.leaf(self.kind, loc, holder, None, unit)


class Tree(Spec):
    """A value of any shape, every string in it of one kind: a tool call's input object (model-written
    arguments), metadata (application fields). A text tree is one unit (its strings are read together), or part of
    the carrier that holds it."""

    __slots__ = ("kind", "provenance", "_inner")

    def __init__(self, kind: Kind, provenance: Provenance | None = None, *, root: bool = True) -> None:
        self.kind = kind
        self.provenance = provenance
        self._inner = Tree(kind, provenance, root=False) if root else self

    def visit(self, node, loc, holder, provenance, unit, walk):  # type: ignore[no-untyped-def]
        if self._inner is not self:  # the tree's root: a unit of its own, unless a carrier holds it
            unit = unit or loc
            provenance = self.provenance or provenance
        if type(node) is str:
            if self.kind == "text":
                walk.text(loc, holder, provenance, unit)
            else:
                walk.leaf(self.kind, loc, holder, None, unit)
            return
        inner = self._inner
        if type(node) is dict:
            walk.stack.extend([(inner, v, (*loc, k), node, provenance, unit) for k, v in reversed(node.items())])
        else:
            walk.stack.extend(
                [(inner, node[i], (*loc, i), node, provenance, unit) for i in range(len(node) - 1, -1, -1)]
            )


UNKNOWN = Tree("text", "unknown")  # what the table does not know: read by everyone, as text and as arguments


class Obj(Spec):
    """An object of known keys; any other key is unknown content."""

    __slots__ = ("fields", "rest")

    def __init__(self, fields: Mapping[str, Spec], rest: Spec | None = None) -> None:
        self.fields = dict(fields)
        self.rest = rest or UNKNOWN

    def visit(self, node, loc, holder, provenance, unit, walk):  # type: ignore[no-untyped-def]
        if type(node) is not dict:
            UNKNOWN.visit(node, loc, holder, provenance, unit, walk)
            return
        fields, rest = self.fields, self.rest
        walk.stack.extend(
            [(fields.get(k, rest), v, (*loc, k), node, provenance, unit) for k, v in reversed(node.items())]
        )

    def extended(self, fields: Mapping[str, Spec]) -> Obj:
        return Obj({**self.fields, **fields}, self.rest)


class Arr(Spec):
    """An array whose every item is `item`."""

    __slots__ = ("item",)

    def __init__(self, item: Spec) -> None:
        self.item = item

    def visit(self, node, loc, holder, provenance, unit, walk):  # type: ignore[no-untyped-def]
        if type(node) is not list:
            UNKNOWN.visit(node, loc, holder, provenance, unit, walk)
            return
        item = self.item
        walk.stack.extend([(item, node[i], (*loc, i), node, provenance, unit) for i in range(len(node) - 1, -1, -1)])


class Run(Arr):
    """An array of parts its reader reads one after another, as one text (a message's content parts or blocks):
    the detectors read its texts joined as well as each alone."""

    __slots__ = ()

    def visit(self, node, loc, holder, provenance, unit, walk):  # type: ignore[no-untyped-def]
        if type(node) is list:
            walk.inventory.runs.append(loc)
        super().visit(node, loc, holder, provenance, unit, walk)


class Map(Spec):
    """An object with keys of the client's choosing, every value `value`."""

    __slots__ = ("value",)

    def __init__(self, value: Spec) -> None:
        self.value = value

    def visit(self, node, loc, holder, provenance, unit, walk):  # type: ignore[no-untyped-def]
        if type(node) is not dict:
            UNKNOWN.visit(node, loc, holder, provenance, unit, walk)
            return
        value = self.value
        walk.stack.extend([(value, v, (*loc, k), node, provenance, unit) for k, v in reversed(node.items())])


class UnknownTag(Spec):
    """The discriminator of an object the table does not know: unknown content, read by the WAF as an argument (it
    is a label, which the classifier would read as noise beside the object's text), and refused where the policy
    refuses unknown content."""

    __slots__ = ()

    def visit(self, node, loc, holder, provenance, unit, walk):  # type: ignore[no-untyped-def]
        walk.inventory.carried.append(Carried(loc, holder, "identifier", "unknown", unit or loc))


class Switch(Spec):
    """An object whose discriminator (`type`, `role`) picks its spec; a value the table does not know is unknown
    content, and so is an object without one unless `absent` says what that is."""

    __slots__ = ("key", "cases", "absent", "_unknown")

    def __init__(self, key: str, cases: Mapping[str, Spec], absent: Spec | None = None) -> None:
        self.key = key
        self.cases = dict(cases)
        self.absent = absent
        self._unknown = Obj({key: UnknownTag()})

    def visit(self, node, loc, holder, provenance, unit, walk):  # type: ignore[no-untyped-def]
        spec: Spec | None = None
        if type(node) is dict:
            tag = node.get(self.key)
            if type(tag) is str:
                spec = self.cases.get(tag) or self._unknown
            elif tag is None:
                spec = self.absent
        (spec or UNKNOWN).visit(node, loc, holder, provenance, unit, walk)


class Either(Spec):
    """A value that may be a string, an array or an object, each read its own way."""

    __slots__ = ("string", "array", "obj")

    def __init__(self, string: Spec | None = None, array: Spec | None = None, obj: Spec | None = None) -> None:
        self.string = string
        self.array = array
        self.obj = obj

    def visit(self, node, loc, holder, provenance, unit, walk):  # type: ignore[no-untyped-def]
        kind = type(node)
        spec = self.string if kind is str else self.array if kind is list else self.obj
        (spec or UNKNOWN).visit(node, loc, holder, provenance, unit, walk)


class Carrier(Spec):
    """A unit the guard reads whole (a document, a tool result, a tool call), and the provenance of the texts in it
    that do not name their own."""

    __slots__ = ("spec", "provenance", "unit")

    def __init__(self, spec: Spec, provenance: Provenance | None = None, *, unit: bool = True) -> None:
        self.spec = spec
        self.provenance = provenance
        self.unit = unit

    def visit(self, node, loc, holder, provenance, unit, walk):  # type: ignore[no-untyped-def]
        self.spec.visit(node, loc, holder, self.provenance or provenance, loc if self.unit else unit, walk)


def said_by(provenance: Provenance, spec: Spec) -> Carrier:
    """The texts under `spec` are of this provenance (a message's role), each its own unit."""
    return Carrier(spec, provenance, unit=False)


class Ref(Spec):
    """A spec defined later (recursive shapes: JSON Schema, blocks that hold blocks)."""

    __slots__ = ("_target", "_spec")

    def __init__(self, target: Callable[[], Spec]) -> None:
        self._target = target
        self._spec: Spec | None = None

    @property
    def spec(self) -> Spec:
        if self._spec is None:
            self._spec = self._target()
        return self._spec

    def visit(self, node, loc, holder, provenance, unit, walk):  # type: ignore[no-untyped-def]
        self.spec.visit(node, loc, holder, provenance, unit, walk)


class FileData(Spec):
    """A file's bytes as a data: URL or base64: read as the document it is when it is text, opaque when it is valid
    base64 of another type, else unknown text. A bare base64 file's type is `declared`, or a sibling field's:
    `type_key` (a media type), or `name_key` (a file name, whose extension declares it)."""

    __slots__ = ("declared", "type_key", "name_key")

    def __init__(self, declared: str = "", *, type_key: str | None = None, name_key: str | None = None) -> None:
        self.declared = declared
        self.type_key = type_key
        self.name_key = name_key

    def visit(self, node, loc, holder, provenance, unit, walk):  # type: ignore[no-untyped-def]
        if type(node) is not str:
            UNKNOWN.visit(node, loc, holder, provenance, unit, walk)
            return
        declared = self.declared
        if type(holder) is dict:
            if self.type_key is not None and isinstance(holder.get(self.type_key), str):
                declared = holder[self.type_key]
            elif self.name_key is not None:
                declared = encoded.declared_type(holder.get(self.name_key))
        reading, decoded = encoded.read_file(node, declared)
        _classify(reading, decoded, loc, holder, unit, walk)


class MediaUrl(Spec):
    """An image's or file's URL: an http(s) URL is opaque (the model sees what it points to, which the gateway does
    not fetch); a data: URL is read as a file."""

    __slots__ = ()

    def visit(self, node, loc, holder, provenance, unit, walk):  # type: ignore[no-untyped-def]
        if type(node) is not str:
            UNKNOWN.visit(node, loc, holder, provenance, unit, walk)
            return
        reading, decoded = encoded.read_media_url(node)
        if reading == "url":
            walk.leaf("opaque", loc, holder, None, unit)
        else:
            _classify(reading, decoded, loc, holder, unit, walk)


class ModelChoice(Spec):
    """A model the provider would run for this request besides the one it names at its top (a server-side fallback
    chain, a tool that consults another model): an application field, and listed apart, because the gateway
    authorises, limits and charges one model per attempt (gateway/stages/authority.py) and has not decided this
    one. The parse stage refuses a request that names any; it walks only a body that holds a `model` key twice, a
    `fallbacks` key or an escape (gateway/stages/parse.py), so this spec goes under one of those two keys."""

    __slots__ = ()

    def visit(self, node, loc, holder, provenance, unit, walk):  # type: ignore[no-untyped-def]
        walk.inventory.other_models.append(loc)
        if type(node) is str:
            walk.leaf("field", loc, holder, None, unit)
        else:
            UNKNOWN.visit(node, loc, holder, provenance, unit, walk)


class Opaque(Spec):
    """A provider's encrypted state (reasoning, signatures, search indices): opaque when it is base64 text as it must
    be, else unknown text."""

    __slots__ = ()

    def visit(self, node, loc, holder, provenance, unit, walk):  # type: ignore[no-untyped-def]
        if type(node) is str and encoded.is_opaque(node):
            walk.leaf("opaque", loc, holder, None, unit)
        else:
            UNKNOWN.visit(node, loc, holder, provenance, unit, walk)


class JsonText(Spec):
    """A string that is JSON text (a tool call's arguments, model-written): when it holds an object or array, each
    string in it is a text of its own, read with its escapes decoded as the tool will read it, and rewritten there
    (the JSON written back), and so is each key (renamed where the JSON is written back); otherwise the string is
    read as the text it is. The carrier is one unit."""

    __slots__ = ("provenance",)

    def __init__(self, provenance: Provenance) -> None:
        self.provenance = provenance

    def visit(self, node, loc, holder, provenance, unit, walk):  # type: ignore[no-untyped-def]
        if type(node) is not str:
            UNKNOWN.visit(node, loc, holder, provenance, unit, walk)
            return
        unit = unit or loc
        doc = encoded.read_json(node) if holder is not None else None
        if doc is None:
            walk.text(loc, holder, self.provenance, unit)
            return
        embedded = encoded.EmbeddedJson(holder, loc[-1], doc, loc)
        carried = walk.inventory.carried
        keys: list[Carried] = []
        stack: list[tuple[Location, Any]] = [(loc, doc)]
        while stack:  # explicit stack, in document order
            at, container = stack.pop()
            items = list(container.items()) if type(container) is dict else list(enumerate(container))
            children = []
            for key, value in items:
                if type(container) is dict:  # the model reads the keys it wrote too
                    name = encoded.EmbeddedKey(container, embedded)
                    keys.append(Carried((*at, key), name, "text", self.provenance, unit, embedded=embedded))
                if type(value) is str:
                    container[key] = encoded.readable(value)
                    carried.append(Carried((*at, key), container, "text", self.provenance, unit, embedded=embedded))
                elif type(value) is dict or type(value) is list:
                    children.append(((*at, key), value))
            stack.extend(reversed(children))
        carried.extend(keys)


class PromptInput(Spec):
    """A completions prompt or embeddings input: a text, texts, token ids, or lists of token ids."""

    __slots__ = ()

    def visit(self, node, loc, holder, provenance, unit, walk):  # type: ignore[no-untyped-def]
        if type(node) is str:
            walk.text(loc, holder, "prompt", unit)
        elif type(node) is list and _token_ids(node):
            walk.inventory.token_prompts.append(TokenPrompt(node, loc))
        elif type(node) is list:
            texts = []
            for i, item in enumerate(node):
                if type(item) is list and _token_ids(item):
                    walk.inventory.token_prompts.append(TokenPrompt(item, (*loc, i)))
                else:
                    texts.append((_PROMPT_TEXT, item, (*loc, i), node, provenance, unit))
            walk.stack.extend(reversed(texts))
        else:
            UNKNOWN.visit(node, loc, holder, provenance, unit, walk)


_PROMPT_TEXT = Leaf("text", "prompt")
TEXT = Leaf("text")  # the enclosing carrier's provenance
IDENTIFIER = Leaf("identifier")
FIELD = Leaf("field")
SETTINGS = Tree("field")  # an application setting of any shape (metadata, options): every string a field


def text(provenance: Provenance) -> Leaf:
    return Leaf("text", provenance)


def _classify(
    reading: str, decoded: DecodedText | None, loc: Location, holder: Any, unit: Location | None, walk: _Walk
) -> None:
    if reading == "text":
        walk.text(loc, holder, "document", unit, decoded)
    elif reading == "binary":
        walk.leaf("opaque", loc, holder, None, unit)
    else:
        walk.text(loc, holder, "unknown", unit)


def _token_ids(value: list[Any]) -> bool:
    return bool(value) and all(type(t) is int and t >= 0 for t in value)


def _number(value: Any) -> str:
    """A number as the WAF has always read it: the JSON text, without the encoder."""
    if type(value) is float:
        return repr(value) if math.isfinite(value) else json.dumps(value)
    return str(value)
