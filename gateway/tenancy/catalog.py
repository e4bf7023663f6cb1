"""The reviewed list of upstream paths a pool may pass through (`passthrough:` in portcullis.yaml), by the API its
replicas speak: paths known to be stateless, and collections of objects the gateway keeps apart by tenant.

Every tenant reaches a pool's upstream with the pool's one key, so whatever one tenant makes there (a file, a batch,
a stored response) any other could read, list or delete by asking for it. A collection here is a path whose objects
the gateway records with their tenant when they are made, and serves to that tenant only
(gateway/tenancy/passthrough.py). A stateless path makes nothing another request could reach.

Fail closed: a path in neither list is not known to be safe. A passthrough pattern that could reach one is refused at
start (`uncovered`); a request for one that a pattern's prefix admits anyway (`/v1/filesX`, or a path with dot
segments, which the upstream URL would resolve to another route) is a 404 before anything goes upstream (`classify`).

A model a tenant makes (a fine-tune, named in its job's `fine_tuned_model` and its checkpoints'
`fine_tuned_model_checkpoint`) is an object of kind "model": recorded like the others, named by the rule every
request's `model` is held to (gateway/apis/model_name.py: OpenAI's `ft:gpt-4o-mini:org:suffix:id` has colons, which
no other id has), deleted at `/v1/models/{model}`, and called on the model routes (gateway/tenancy/models.py).

From the public API references: platform.openai.com (Files, Uploads, Batch, Vector stores, Assistants, Threads,
Fine-tuning and its checkpoints, Models, Conversations, Responses, Containers, Videos; Audio, Images, Moderations) and
docs.anthropic.com (Files, Message Batches). Stored chat completions (`/v1/chat/completions/{id}`), evals, realtime
sessions (which mint credentials), checkpoint permissions (`/v1/fine_tuning/checkpoints/...`, which share a model with
other organizations), the organization admin API and anything else are not listed: unknown, so never passed through.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from gateway.apis.model_name import is_model_name

ApiName = Literal["openai", "anthropic"]

_SEGMENT = re.compile(r"[A-Za-z0-9_-]{1,256}")  # an object id or a sub-route's name: no dots, no escapes, no '/'
# a model's name in a path (`/v1/models/ft:gpt-4o-mini:org:suffix:id`): what providers name fine-tunes and their
# checkpoints with; no leading dot (a dot segment), nothing a URL reads as more than a path segment
_MODEL_SEGMENT = re.compile(r"[A-Za-z0-9_:-][A-Za-z0-9_.:-]{0,255}")
_PATH_SEGMENT = re.compile(r"[A-Za-z0-9._~:@!$&'()*+,;=-]+")  # a route unknown to the catalog: any plain segment
MODEL = "model"  # the kind of a model a tenant made


@dataclass(frozen=True, slots=True)
class Named:
    """A member of an answer that names an object the upstream made for the answer's owner (a batch's output file):
    that object is the owner's too. `path` leads to an id, or to a list of ids."""

    path: tuple[str, ...]
    kind: str


@dataclass(frozen=True, slots=True)
class Collection:
    """Objects of one kind under one path: `root` (POST: create, GET: list), `root/{id}` (GET, POST, DELETE) and
    anything under `root/{id}/` (an object's content, sub-objects, actions)."""

    root: str
    kind: str
    creates: bool = True  # POST on the root makes one
    lists: bool = False  # GET on the root lists them, a page at a time
    default_limit: int = 20  # a list page's size where the client names none (the upstream's default)
    max_limit: int = 100
    names: tuple[Named, ...] = ()  # in its objects' and its create answers
    # POST root/<action>: a name under the root that is not an object id, and what its answer names
    actions: Mapping[str, tuple[Named, ...]] = field(default_factory=dict)
    # members of a create's body naming a file of requests (JSONL) the upstream makes later with the pool's key
    request_files: tuple[str, ...] = ()
    # where a create's body holds those requests inline: (the list's member, each item's request member)
    inline_requests: tuple[str, str] | None = None
    # GET root/{id}/<name>: a page of sub-objects, and what each of them names (a fine-tuning job's checkpoints)
    sub_lists: Mapping[str, tuple[Named, ...]] = field(default_factory=dict)
    ids: re.Pattern[str] = _SEGMENT  # what an object's id may be in a path


@dataclass(frozen=True, slots=True)
class Pages:
    """How an API's lists page: the cursor query parameters (an object id each)."""

    after: str
    before: str


@dataclass(frozen=True, slots=True)
class ObjectRoute:
    """A request's path within a collection: the collection itself (`object_id` and `action` None), an action on it,
    or one object and what follows its id (`rest`)."""

    collection: Collection
    object_id: str | None = None
    rest: tuple[str, ...] = ()
    action: str | None = None


STATELESS: Literal["stateless"] = "stateless"
Route = ObjectRoute | Literal["stateless"]

_FILES = Collection("/v1/files", "file", lists=True, default_limit=10_000, max_limit=10_000)
OPENAI_COLLECTIONS = (
    _FILES,
    Collection("/v1/uploads", "upload", names=(Named(("file", "id"), "file"),)),  # complete: the file it made
    Collection(
        "/v1/batches",
        "batch",
        lists=True,
        names=(Named(("output_file_id",), "file"), Named(("error_file_id",), "file")),
        request_files=("input_file_id",),
    ),
    Collection("/v1/vector_stores", "vector_store", lists=True),
    Collection("/v1/assistants", "assistant", lists=True),
    Collection("/v1/threads", "thread", actions={"runs": (Named(("thread_id",), "thread"),)}),  # create and run
    Collection(
        "/v1/fine_tuning/jobs",
        "fine_tuning_job",
        lists=True,
        names=(Named(("result_files",), "file"), Named(("fine_tuned_model",), MODEL)),
        sub_lists={"checkpoints": (Named(("fine_tuned_model_checkpoint",), MODEL),)},
    ),
    # GET /v1/models is the gateway's own list (gateway/app.py); one model is read or deleted here
    Collection("/v1/models", MODEL, creates=False, ids=_MODEL_SEGMENT),
    Collection("/v1/conversations", "conversation"),
    # made by POST /v1/responses (a model route, gateway/tenancy/stage.py); input_tokens counts a request's tokens
    Collection("/v1/responses", "response", creates=False, actions={"input_tokens": ()}),
    Collection("/v1/containers", "container", lists=True),
    Collection("/v1/videos", "video", lists=True),
)
ANTHROPIC_COLLECTIONS = (
    Collection("/v1/files", "file", lists=True, max_limit=1000),
    Collection(
        "/v1/messages/batches", "message_batch", lists=True, max_limit=1000, inline_requests=("requests", "params")
    ),
)
COLLECTIONS: dict[ApiName, tuple[Collection, ...]] = {"openai": OPENAI_COLLECTIONS, "anthropic": ANTHROPIC_COLLECTIONS}
PAGES: dict[ApiName, Pages] = {"openai": Pages("after", "before"), "anthropic": Pages("after_id", "before_id")}
# Paths that make nothing a later request could reach (vLLM's rerank and score are stateless too).
STATELESS_PATHS: dict[ApiName, frozenset[str]] = {
    "openai": frozenset(
        {
            "/v1/audio/speech",
            "/v1/audio/transcriptions",
            "/v1/audio/translations",
            "/v1/images/generations",
            "/v1/images/edits",
            "/v1/images/variations",
            "/v1/moderations",
            "/v1/rerank",
            "/v1/score",
        }
    ),
    "anthropic": frozenset(),
}


def classify(api: ApiName, path: str) -> Route | None:
    """What a request path is to a pool speaking `api`: a stateless path, a place in a collection, or None (unknown:
    not passed through)."""
    if path in STATELESS_PATHS[api]:
        return STATELESS
    for collection in COLLECTIONS[api]:
        if path == collection.root:
            return ObjectRoute(collection)
        if path.startswith(collection.root + "/"):
            first, *rest = path[len(collection.root) + 1 :].split("/")
            if not (collection.ids.fullmatch(first) and all(_SEGMENT.fullmatch(s) for s in rest)):
                return None
            if first in collection.actions:
                return ObjectRoute(collection, action=first) if not rest else None
            return ObjectRoute(collection, object_id=first, rest=tuple(rest))
    return None


def is_plain_path(path: str) -> bool:
    """Whether `path` names one resource as it reads: absolute, each segment made of URL path characters (RFC 3986's
    pchar, decoded, less '%') and neither '.' nor '..', none empty but a trailing slash's. The upstream URL is the
    decoded path: a dot segment, a '?' or '#' decoded from %3F or %23, an empty segment or a space would make it
    another route than the one a passthrough pattern admitted."""
    first, *segments = path.split("/")
    if first or not segments:
        return False
    if segments[-1] == "":
        segments.pop()
    return all(_PATH_SEGMENT.fullmatch(s) is not None and s not in (".", "..") for s in segments)


def uncovered(api: ApiName, pattern: str) -> str | None:
    """Why a pool speaking `api` may not pass `pattern` through (a path, or a prefix ending in '*'), or None: every
    path it matches is in the catalog, or is refused per request by `classify` (a prefix's stray extensions)."""
    stem = pattern.removesuffix("*")
    base = stem.rstrip("/") if pattern.endswith("*") else stem
    if base in STATELESS_PATHS[api] or any(base == c.root or base.startswith(c.root + "/") for c in COLLECTIONS[api]):
        return None
    nearby = sorted(p for p in known_patterns(api) if p.startswith(stem) or stem.startswith(p.removesuffix("*")))
    known = f"known under {stem!r}: {', '.join(nearby)}" if nearby else f"known: {', '.join(known_patterns(api))}"
    return (
        f"{pattern!r} reaches paths not known to be stateless, nor objects the gateway keeps apart by tenant: every "
        f"tenant would reach the others' objects there with the pool's one upstream key; {known}"
    )


def known_patterns(api: ApiName) -> list[str]:
    """Every pattern `uncovered` accepts at its widest: each collection's, then each stateless path."""
    return [c.root + "*" for c in COLLECTIONS[api]] + sorted(STATELESS_PATHS[api])


def named_ids(answer: dict[str, Any], names: tuple[Named, ...]) -> list[tuple[str, str]]:
    """(id, kind) of each object an answer names at `names` (ids that are not plausible ids of their kind are left
    out)."""
    found: list[tuple[str, str]] = []
    for named in names:
        value: Any = answer
        for key in named.path:
            value = value.get(key) if isinstance(value, dict) else None
        for item in value if isinstance(value, list) else [value]:
            if is_object_id(item, named.kind):
                found.append((item, named.kind))
    return found


def is_object_id(value: Any, kind: str) -> bool:
    """An id the gateway would record for an object of `kind`: a model's name by the request model rule, any other
    what the catalog accepts as a path segment."""
    if not isinstance(value, str):
        return False
    return is_model_name(value) if kind == MODEL else _SEGMENT.fullmatch(value) is not None
