"""Tool definitions pinned by hash: a tool as its server defines it (its name, description and input schema, and every
other field it sends: title, output schema, annotations) approved once, and any later change refused until the
policy accepts its new hash.

The catalog is what this process last saw of each server's tools, through tools/list answers it relayed: a call is
let through only for a tool whose definition, as last listed to the caller's tenant, was approved (pinned, and
passed by that tenant's guard policy). A tool no list has shown the tenant yet is looked up by a tools/list of the
gateway's own before its call (gateway/mcp/relay.py). With `pin: learn` the first hash seen of each tool is pinned
in this process's memory.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from gateway.mcp.spec import McpSpec

Standing = Literal["approved", "unpinned", "changed", "poisoned"]


def tool_hash(tool: dict[str, Any]) -> str:
    """`sha256:` and the hex digest of the whole tool definition as canonical JSON (keys sorted): a change to any
    of it, however small, is a new hash; what a client may show a model is never outside what was approved."""
    return "sha256:" + hashlib.sha256(orjson.dumps(tool, option=orjson.OPT_SORT_KEYS)).hexdigest()


# Tools remembered per process: a server that lists ever new names cannot grow the catalog past this. Beyond it a
# tool is judged afresh (a lookup) at each call.
MAX_ENTRIES = 100_000


@dataclass
class Catalog:
    """Each tool's standing as last listed to each tenant (a tenant's guard policy is its own); and, in `learn` mode,
    the hashes learned, whoever listed them."""

    standing: dict[tuple[str | None, str, str], Standing] = field(default_factory=dict)
    learned: dict[tuple[str, str], str] = field(default_factory=dict)

    def judge(self, spec: McpSpec, server: str, name: str, digest: str) -> Standing:
        """Whether this definition of the tool may reach a model, by its hash (the guard's verdict comes apart)."""
        if spec.pin == "learn":
            first = self.learned.get((server, name))
            if first is None and len(self.learned) < MAX_ENTRIES:
                first = self.learned[(server, name)] = digest
            return "approved" if first == digest else "changed"
        policy = spec.servers.get(server)
        pinned = policy.pinned.get(name) if policy is not None else None
        if pinned is None:
            return "unpinned"
        return "approved" if pinned == digest else "changed"

    def record(self, tenant: str | None, server: str, name: str, standing: Standing) -> None:
        key = (tenant, server, name)
        if key in self.standing or len(self.standing) < MAX_ENTRIES:
            self.standing[key] = standing

    def of(self, tenant: str | None, server: str, name: str) -> Standing | None:
        """The tool's standing as last listed to the tenant; None when no list has shown it."""
        return self.standing.get((tenant, server, name))
