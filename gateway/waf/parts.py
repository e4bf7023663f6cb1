"""The request as the WAF sees it: named parts, each a list of values, extracted once and cached per request.

A `RequestView` is built from raw HTTP parts (method, raw path, raw query, headers, body) plus what the gateway
knows (parsed JSON, tenant, API key label, client IP). The same view serves the gateway stage, the CLI and the
corpus harness, so all three decide alike.

Which parts hold what:
- `args`: query and form arguments (URL-decoded once), and, of the JSON body's content inventory
  (gateway/apis/inventory.py), every identifier, application field and number, and every unknown text;
  `args_names`: their names (JSON keys included). The text a model reads (messages, prompts, tool results,
  documents, tool and parameter descriptions, the arguments of earlier tool calls) is its own part, `prompt`,
  because it may legitimately talk about SQL, shell or HTML (a `run_sql` tool's description, the query the model
  passed it); LLM packs read it, web-attack packs do not. Unknown text, which the request's shape does not know, is
  in both. Each prompt text is read as sent and, where they differ, in the form detectors match
  (gateway/guard/folding.py: NFKC, invisible characters removed), so a key split by invisible characters
  is still a key, and the encoding packs still see the invisible characters. A request on no known route has no
  prompt: all of it is args.
- `json:PATH` reads the parsed body by dotted path (`*` is any key or index); `prompt:ROLE` one provenance's texts
  (`prompt:document`, `prompt:tool_result`, ...) or one role's: `user` (with role-less prompts), `system` (with
  tool definitions), `assistant` (with reasoning and tool-call arguments), `tool` (tool results).
- `header_values`: the headers a client fills with free text that servers log or act on (User-Agent, Referer,
  X-Forwarded-*, X-Api-Version, any custom header: where real exploit traffic such as Log4Shell arrives), each
  read the way its syntax says: Referer and Origin as the URL and its decoded query values, X-Forwarded-For and
  Forwarded item by item. Left out are the headers whose syntax the gateway itself checks or that carry
  credentials (Host, Content-*, Accept*, Authorization, API keys, Cookie: its values are `cookies`).
- `foreign_urls`: query and form arguments that are a URL to another host than the request's Host (an off-site
  reference: what remote file inclusion sends).
- `lookalike_urls`: query and form arguments that are a URL borrowing the request's Host to go elsewhere: its own
  name on another port, or a host that begins with its name (example.com.evil.net).
- `param_names`: the names of query and form arguments (not JSON keys: a link or a form can plant those).
- `multipart_names`: the `name` and `filename` parameters of a multipart body's Content-Disposition lines, as sent
  (quotes, semicolons and backslashes in them are where multipart parsers disagree).
- `referer_site`: `none`, `same` (the Host or a subdomain of it) or `other`.
- `base64`: every argument, cookie and header value that is base64 text, or a data: URI's base64 payload (see
  `gateway/waf/decode.py`), decoded.
"""

from __future__ import annotations

import html
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, unquote_to_bytes

from gateway.apis.carriers import PASSTHROUGH
from gateway.apis.inventory import Carried, Inventory, take
from gateway.apis.routes import BY_NAME
from gateway.apis.shape import Api
from gateway.guard.folding import folded
from gateway.waf.decode import base64_layers

# A value and where it came from (for explanations, and for redaction inside the JSON body).
Location = tuple[str | int, ...]  # keys and indices from the parsed JSON body's root
Value = tuple[str, str, Location | None]  # (part name, text, location in the payload or None)


@dataclass
class RequestView:
    method: str = "GET"
    path: str = "/"
    query: str = ""  # raw, as sent
    headers: list[tuple[str, str]] = field(default_factory=list)  # (lowercased name, value), in order
    body: bytes = b""
    payload: Any = None  # parsed JSON body, when there is one
    route: str = ""
    client_ip: str = ""
    tenant: str | None = None
    key_label: str | None = None
    model: str = ""
    # the payload's content inventory, when the caller has taken it already (the gateway's stages share one)
    inventory: Inventory | None = field(default=None, repr=False)
    # What is extracted once per request: each part's values, and the pieces several parts are made of.
    _values: dict[str, list[Value]] = field(default_factory=dict, init=False, repr=False)
    _headers_by_name: dict[str, list[str]] | None = field(default=None, init=False, repr=False)
    _form: list[tuple[str, str]] | None = field(default=None, init=False, repr=False)
    _cookie_pairs: list[tuple[str, str]] | None = field(default=None, init=False, repr=False)

    # -- raw pieces -------------------------------------------------------------------------------------------
    def header(self, name: str) -> list[str]:
        return self._header_index().get(name, [])

    def _header_index(self) -> dict[str, list[str]]:
        by_name = self._headers_by_name
        if by_name is None:
            by_name = self._headers_by_name = {}
            for k, v in self.headers:
                by_name.setdefault(k, []).append(v)
        return by_name

    def sources(self) -> set[str]:
        """What the request has of the sources `part_source` names: its header names, and ARGUMENTS when it has
        query or form arguments."""
        out = set(self._header_index())
        if self.query or (self.payload is None and self.body):
            out.add(ARGUMENTS)
        return out

    def content_type(self) -> str:
        values = self.header("content-type")
        return values[0].split(";", 1)[0].strip().lower() if values else ""

    def _query_args(self) -> list[tuple[str, str]]:
        return parse_qsl(self.query, keep_blank_values=True) if self.query else []

    def _form_args(self) -> list[tuple[str, str]]:
        """Body arguments of a non-JSON body: form fields, multipart fields, XML attribute values and text, or the
        whole body as one argument named 'body' for any other type."""
        if self._form is not None:
            return self._form
        out: list[tuple[str, str]] = []
        if self.payload is None and self.body:
            ctype = self.content_type()
            text = self.body.decode("utf-8", errors="replace")
            if ctype in ("", "application/x-www-form-urlencoded"):
                out = parse_qsl(text, keep_blank_values=True)
            elif ctype.startswith("multipart/"):
                out = _multipart(text, self.header("content-type")[0])
            elif ctype.endswith("xml"):
                out = [("xml", html.unescape(a or b)) for a, b in _XML_VALUES.findall(text) if (a or b).strip()]
            else:
                out = [("body", text)]
        self._form = out
        return out

    def _multipart_names(self) -> list[str]:
        if not self.body or not self.content_type().startswith("multipart/"):
            return []
        text = self.body.decode("utf-8", errors="replace")
        return [a or b for line in _DISPOSITION.findall(text) for a, b in _DISPOSITION_NAME.findall(line)]

    def _cookies(self) -> list[tuple[str, str]]:
        if self._cookie_pairs is not None:
            return self._cookie_pairs
        out = []
        for header in self.header("cookie"):
            for pair in header.split(";"):
                name, sep, value = pair.strip().partition("=")
                if name or value:
                    out.append((name, value) if sep else ("", name))
        self._cookie_pairs = out
        return out

    def _url_site(self, value: str) -> tuple[str, str, str, str] | None:
        """(URL host, URL port, Host, Host port) when the value is a URL; userinfo aside."""
        match = _URL_HOST.match(value.strip())
        if match is None:
            return None
        given = self.header("host")
        host, _, port = (given[0].lower() if given else "").rpartition("@")[2].partition(":")
        return match.group(1).lower(), match.group(2) or "", host, port

    def _foreign(self, value: str) -> bool:
        """Whether the value is a URL to another site than the request's Host: another host that is not a
        subdomain of it, or another port (80 and 443 are the Host's own when it names none)."""
        site = self._url_site(value)
        if site is None:
            return False
        url_host, url_port, host, port = site
        same_port = url_port == port or (not port and url_port in ("", "80", "443"))
        return not (same_port and host and (url_host == host or url_host.endswith("." + host)))

    def _referer_site(self) -> str:
        """`none` without a Referer, `same` for the Host or a subdomain of it (any port), else `other`."""
        referer = self.header("referer")
        if not referer:
            return "none"
        site = self._url_site(referer[0])
        if site is None:
            return "other"
        url_host, _, host, _ = site
        return "same" if host and (url_host == host or url_host.endswith("." + host)) else "other"

    def _lookalike(self, value: str) -> bool:
        """Whether the value is a URL that borrows the request's Host to reach somewhere else: the Host (or a
        subdomain) on another explicit port, an internal service behind the site's own name, or a host that starts
        with the Host's name without being it or under it (example.com.evil.net, example.com-cdn.io), the shape
        that slips past an allow-list testing a prefix."""
        site = self._url_site(value)
        if site is None or not site[2]:
            return False
        url_host, url_port, host, port = site
        own = url_host == host or url_host.endswith("." + host)
        if own:
            return url_port not in ("", port) and not (not port and url_port in ("80", "443"))
        return url_host.startswith((host + ".", host + "-"))

    # -- parts ------------------------------------------------------------------------------------------------
    def values(self, target: str) -> list[Value]:
        cached = self._values.get(target)
        if cached is None:
            cached = self._values[target] = self._extract(target)
        return cached

    def _extract(self, target: str) -> list[Value]:
        kind, _, param = target.partition(":")
        if param:
            return PARAM_PARTS[kind](self, param, target)
        return PARTS[target](self)

    def carried(self) -> Inventory:
        """The payload's content inventory: what the request's shape says each string is (off the model routes,
        all of it application fields)."""
        if self.inventory is None:
            api = self.api()
            self.inventory = api.inventory(self.payload) if api is not None else take(PASSTHROUGH, self.payload)
        return self.inventory

    def api(self) -> Api | None:
        """The request's shape, which says what its payload carries; None off the model routes."""
        return BY_NAME.get(self.route)

    def _prompt(self, role: str | None) -> list[Value]:
        """The texts a model reads, or one provenance's or role's, each as sent and, where it differs, folded."""
        wanted = None if role is None else ROLE_PROVENANCES.get(role, frozenset((role,)))
        name = f"prompt:{role}" if role else "prompt"
        out: list[Value] = []
        for carried in self.carried().carried:
            if carried.kind != "text" or (wanted is not None and carried.provenance not in wanted):
                continue
            text = carried.text
            out.append((name, text, carried.loc))
            normal = folded(text)
            if normal is not text and normal != text:
                out.append((name, normal, carried.loc))
        return out


# `prompt:ROLE` for a message role: that role's texts and the texts that speak with its voice.
ROLE_PROVENANCES: dict[str, frozenset[str]] = {
    "user": frozenset(("user", "prompt")),
    "system": frozenset(("system", "tool_definitions")),
    "assistant": frozenset(("assistant", "reasoning", "tool_arguments")),
    "tool": frozenset(("tool_result",)),
    "function": frozenset(("tool_result",)),
}


def _is_argument(carried: Carried) -> bool:
    """What the web-attack packs read of the body: identifiers, application fields, numbers, and unknown text."""
    kind = carried.kind
    return kind == "identifier" or kind == "field" or carried.provenance == "unknown"


def _json_strings(inventory: Inventory) -> list[Value]:
    """Every string and number of the body as sent (encoded files as their encoding, a string that holds JSON as
    that JSON text, once), token ids included."""
    out: list[Value] = []
    embedded: set[int] = set()
    for carried in inventory.carried:
        outer = carried.embedded
        if outer is not None:
            if id(outer) not in embedded:
                embedded.add(id(outer))
                out.append((_json_part(outer.loc), outer.holder[outer.key], outer.loc))
            continue
        value = carried.holder[carried.key]
        out.append((_json_part(carried.loc), value if type(value) is str else carried.text, carried.loc))
    for prompt in inventory.token_prompts:
        out.extend((_json_part((*prompt.loc, i)), str(t), (*prompt.loc, i)) for i, t in enumerate(prompt.ids))
    return out


# Headers whose syntax the gateway checks, that hold credentials, or whose values are read elsewhere (cookies).
_OPAQUE_HEADERS = frozenset(
    {
        "host",
        "content-type",
        "content-length",
        "content-encoding",
        "transfer-encoding",
        "accept",
        "accept-encoding",
        "accept-language",
        "accept-charset",
        "authorization",
        "proxy-authorization",
        "x-api-key",
        "api-key",
        "cookie",
        "connection",
        "traceparent",
        "tracestate",
    }
)


ARGUMENTS = "?arguments"  # not a header name: the source of the parts read from query and form arguments
_ARGUMENT_PARTS = frozenset({"param_names", "foreign_urls", "lookalike_urls"})


def part_source(target: str) -> str | None:
    """The one source a part is read from, when there is one: a header's name (cookies: `cookie`; a multipart body's
    names need its Content-Type), or ARGUMENTS. A request without that source has nothing in the part, which
    `RequestView.sources` tells by a lookup, without extracting the part."""
    kind, _, param = target.partition(":")
    if kind == "header" and param:
        return param.lower()
    if kind == "cookie" or target in ("cookies", "cookie_names"):
        return "cookie"
    if target == "multipart_names":
        return "content-type"
    if (kind == "arg" and param) or target in _ARGUMENT_PARTS:
        return ARGUMENTS
    return None


def _header_items(name: str, value: str) -> list[str]:
    """A header value as its syntax splits it: a URL and its decoded query values, or a list's items."""
    if name in ("referer", "origin"):
        _, _, query = value.partition("?")
        return [value, *(v for _, v in parse_qsl(query, keep_blank_values=True))] if query else [value]
    if name in ("x-forwarded-for", "forwarded", "via"):
        return [item.strip() for item in value.split(",")] if "," in value else [value]
    return [value]


_URL_HOST = re.compile(r"(?i)[a-z][a-z0-9+.-]*://(?:[^/?#@]*@)?(\[[^\]]*\]|[^/?#:]*)(?::(\d*))?")

_DISPOSITION = re.compile(r"(?im)^content-disposition:([^\r\n]*)")
_DISPOSITION_NAME = re.compile(r'(?i)\b(?:file)?name\*?\s*=\s*(?:"([^"]*)"|([^;\s]*))')

_XML_VALUES = re.compile(r'(?<==)"([^"]*)"|>([^<]+)<')


def _multipart(text: str, content_type: str) -> list[tuple[str, str]]:
    boundary = content_type.partition("boundary=")[2].strip().strip('"')
    if not boundary:
        return [("body", text)]
    out = []
    for chunk in text.split("--" + boundary):
        head, sep, body = chunk.replace("\r\n", "\n").partition("\n\n")
        if not sep:
            continue
        name = re.search(r'name="([^"]*)"', head)
        filename = re.search(r'filename="([^"]*)"', head)
        if filename:
            out.append(("filename", filename.group(1)))
        out.append((name.group(1) if name else "", body.rstrip("\n")))
    return out


def _invalid_utf8(view: RequestView) -> int:
    count = 0
    for text in [view.path, view.query]:
        if "%" in text:
            try:
                unquote_to_bytes(text).decode("utf-8")
            except UnicodeDecodeError:
                count += 1
    if view.body and view.payload is None:
        try:
            view.body.decode("utf-8")
        except UnicodeDecodeError:
            count += 1
    return count


def _prompt_size(view: RequestView) -> int:
    return sum(len(c.text) for c in view.carried().carried if c.kind == "text")


# Parts that are a count: a `number` condition reads them as the int they are, any other operator as its text.
COUNTS: dict[str, Callable[[RequestView], int]] = {
    "body_size": lambda v: len(v.body),
    "header_count": lambda v: len(v.headers),
    "arg_count": lambda v: len(v._query_args()) + len(v._form_args()),
    "json_depth": lambda v: v.carried().depth,
    "json_keys": lambda v: len(v.carried().keys),
    "invalid_utf8": _invalid_utf8,
    "prompt_size": _prompt_size,
}

PartReader = Callable[[RequestView], list[Value]]


def _one(target: str, read: Callable[[RequestView], object]) -> PartReader:
    """A part with one value (or none, where `read` gives None)."""

    def part(view: RequestView) -> list[Value]:
        value = read(view)
        return [] if value is None else [(target, str(value), None)]

    return part


def _args(v: RequestView) -> list[Value]:
    out: list[Value] = [(f"arg:{k}", text, None) for k, text in v._query_args() + v._form_args()]
    return out + [(_json_part(c.loc), c.text, c.loc) for c in v.carried().carried if _is_argument(c)]


def _args_names(v: RequestView) -> list[Value]:
    out: list[Value] = [("args_names", k, None) for k, _ in v._query_args() + v._form_args()]
    return out + [("args_names", k, None) for k in v.carried().keys]


def _header_values(v: RequestView) -> list[Value]:
    return [
        (f"header:{k}", item, None)
        for k, value in v.headers
        if k not in _OPAQUE_HEADERS
        for item in _header_items(k, value)
    ]


def _base64(v: RequestView) -> list[Value]:
    sources = [value for t in ("args", "cookies", "header_values") for value in v.values(t)]
    return [(f"{part} (base64)", text, None) for part, raw, _ in sources for text in base64_layers(raw)]


# Every request part a condition can name (gateway/waf/model.py's targets come from here), in the order the policy
# schema lists them: a new part is its reader here, and its line in docs/policies.md's Targets.
PARTS: dict[str, PartReader] = {
    "method": _one("method", lambda v: v.method),
    "path": _one("path", lambda v: v.path),
    "uri": _one("uri", lambda v: v.path + ("?" + v.query if v.query else "")),
    "query": _one("query", lambda v: v.query or None),
    "args": _args,
    "args_names": _args_names,
    "headers": lambda v: [(f"header:{k}", value, None) for k, value in v.headers],
    "header_values": _header_values,
    "header_names": lambda v: [("header_names", k, None) for k, _ in v.headers],
    "cookies": lambda v: [(f"cookie:{k}", value, None) for k, value in v._cookies()],
    "cookie_names": lambda v: [("cookie_names", k, None) for k, _ in v._cookies() if k],
    "body": _one("body", lambda v: v.body.decode("utf-8", errors="replace") if v.body else None),
    "prompt": lambda v: v._prompt(None),
    "model": _one("model", lambda v: v.model or None),
    "tenant": _one("tenant", lambda v: v.tenant),
    "key_label": _one("key_label", lambda v: v.key_label or None),
    "route": _one("route", lambda v: v.route or None),
    "client_ip": _one("client_ip", lambda v: v.client_ip or None),
    "content_type": _one("content_type", lambda v: v.content_type() or None),
    "json_strings": lambda v: _json_strings(v.carried()),
    "base64": _base64,
    "foreign_urls": lambda v: [
        (f"arg:{k}", value, None) for k, value in v._query_args() + v._form_args() if v._foreign(value)
    ],
    "lookalike_urls": lambda v: [
        (f"arg:{k}", value, None) for k, value in v._query_args() + v._form_args() if v._lookalike(value)
    ],
    "param_names": lambda v: [("param_names", k, None) for k, _ in v._query_args() + v._form_args()],
    "multipart_names": lambda v: [("multipart_names", name, None) for name in v._multipart_names()],
    "referer_site": _one("referer_site", RequestView._referer_site),
    **{name: _one(name, count) for name, count in COUNTS.items()},
}

# Parts named with a parameter (`header:NAME`): (view, the parameter, the whole target) -> its values.
PARAM_PARTS: dict[str, Callable[[RequestView, str, str], list[Value]]] = {
    "header": lambda v, name, target: [(target, value, None) for value in v.header(name.lower())],
    "cookie": lambda v, name, target: [(target, value, None) for k, value in v._cookies() if k == name],
    "arg": lambda v, name, target: [
        (target, value, None) for k, value in v._query_args() + v._form_args() if k == name
    ],
    "json": lambda v, path, target: [(target, text, loc) for loc, text in _json_path(v.payload, path.split("."))],
    "prompt": lambda v, role, target: v._prompt(role),
}


def _scalar(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else json.dumps(value)  # the same text, without the encoder
    return None


def _json_path(payload: Any, steps: list[str]) -> list[tuple[Location, str]]:
    frontier: list[tuple[Location, Any]] = [((), payload)]
    for step in steps:
        nxt: list[tuple[Location, Any]] = []
        for loc, node in frontier:
            if isinstance(node, dict):
                items = node.items() if step == "*" else ([(step, node[step])] if step in node else [])
                nxt.extend(((*loc, k), v) for k, v in items)
            elif isinstance(node, list):
                if step == "*":
                    nxt.extend(((*loc, i), v) for i, v in enumerate(node))
                elif step.lstrip("-").isdigit() and -len(node) <= int(step) < len(node):
                    i = int(step) % len(node)
                    nxt.append(((*loc, i), node[i]))
        frontier = nxt
    return [(loc, text) for loc, node in frontier if (text := _scalar(node)) is not None]


_PART_NAMES: dict[Location, str] = {}  # the same locations recur request after request (model, messages.0.role)


def _json_part(loc: Location) -> str:
    name = _PART_NAMES.get(loc)
    if name is None:
        if len(_PART_NAMES) > 4096:
            _PART_NAMES.clear()
        name = _PART_NAMES[loc] = f"json:{_dotted(loc)}"
    return name


def _dotted(loc: Location) -> str:
    return ".".join(str(p) for p in loc)


def header_text(raw: bytes) -> str:
    """A header value as text: UTF-8 when it is (a cookie or Referer carrying U+2019 reads as that quote), else
    byte for byte (latin-1), so no byte is lost or replaced."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("latin-1")


def from_raw_http(method: str, uri: str, headers: list[tuple[str, str]], body: bytes, **known: Any) -> RequestView:
    """A view of a raw HTTP request (the corpus harness, `portcullis policy test`); JSON bodies are parsed."""
    path, _, query = uri.partition("?")
    lowered = [(k.lower(), v) for k, v in headers]
    view = RequestView(method=method.upper(), path=path or "/", query=query, headers=lowered, body=body, **known)
    if body and "payload" not in known and "json" in view.content_type():
        try:
            view.payload = json.loads(body)
        except (UnicodeDecodeError, ValueError):
            pass
    return view
