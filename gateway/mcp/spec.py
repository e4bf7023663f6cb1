"""The `mcp` section of the policy model (spec.mcp): which tools each tenant (and, narrower, each key) may call on
each MCP server, which tool definitions the security team approved (pinned by hash), and which methods beyond the
ones the gateway reads are relayed.

In a TenantPolicy overlay a server's entry replaces the base's `tools` for that tenant and adds to its `keys` (by
key id); `pin`, `pinned` and `relay` are the base policy's only: a tool's definition is the same text whoever lists
it, so it is approved once.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

# A server's name as portcullis.yaml gives it (gateway/config.py), and a tool's as MCP names them (letters, digits,
# '_', '-', '.', '/', 1-128 characters).
SERVER_NAME = r"^[a-z0-9][a-z0-9_-]{0,63}$"
TOOL_NAME = r"^[A-Za-z0-9_./-]{1,128}$"
TOOL_HASH = r"^sha256:[0-9a-f]{64}$"
ANY_TOOL = "*"

ToolName = Annotated[str, Field(pattern=TOOL_NAME)]
ToolEntry = Annotated[str, Field(pattern=rf"{TOOL_NAME[:-1]}|^\*$")]  # a tool's name, or '*' for every tool


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class McpServerPolicy(_Strict):
    """One upstream MCP server: the tools callers may use and the definitions approved."""

    tools: list[ToolEntry] = Field(
        default_factory=list,
        description=(
            "tools a caller may list and call ('*': every tool); default none. A tenant's overlay replaces the list "
            "for that tenant"
        ),
    )
    keys: dict[Annotated[str, Field(pattern=r"^[0-9a-f]{12}$")], list[ToolEntry]] = Field(
        default_factory=dict,
        description=(
            "per API key (its id, as `portcullis keys` and the audit log show it): a narrower allow-list, what both "
            "it and `tools` name; a key not here has `tools`"
        ),
    )
    pinned: dict[ToolName, Annotated[str, Field(pattern=TOOL_HASH)]] = Field(
        default_factory=dict,
        description=(
            "each approved tool's definition hash ('sha256:' and 64 hex digits of the whole definition: name, "
            "description, inputSchema and the rest; the gateway logs the hash of every tool it leaves out): a tool "
            "whose hash is not here is left out of tools/list and its calls are refused while `pin` is required"
        ),
    )


class McpSpec(_Strict):
    pin: Literal["required", "learn"] = Field(
        default="required",
        description=(
            "required: only tools whose definition hash is pinned are listed and called; learn: the first "
            "definition each gateway process sees of a tool is pinned in its memory and a later change is refused "
            "(trusts whatever a server shows first: for trying a server out, not for production)"
        ),
    )
    relay: list[Annotated[str, Field(pattern=r"^[a-z][A-Za-z0-9_/]{0,63}$")]] = Field(
        default_factory=list,
        description=(
            "methods and notifications, either way, relayed beyond those the gateway reads (e.g. "
            "sampling/createMessage, elicitation/create, roots/list); anything else is refused or dropped"
        ),
    )
    servers: dict[Annotated[str, Field(pattern=SERVER_NAME)], McpServerPolicy] = Field(
        default_factory=dict,
        description="per server named in portcullis.yaml's mcp_servers; a server not here: no tools",
    )

    def allowed(self, server: str, tool: str, key_id: str | None) -> bool:
        """Whether the server's allow-list names the tool, and the calling key's own list too where it has one."""
        policy = self.servers.get(server)
        if policy is None or not _names(policy.tools, tool):
            return False
        own = policy.keys.get(key_id) if key_id else None
        return own is None or _names(own, tool)


def _names(allowed: list[str], tool: str) -> bool:
    return ANY_TOOL in allowed or tool in allowed


def overlay(base: McpSpec, tenant: McpSpec | None) -> McpSpec:
    """The tenant's effective spec: the base's, each server the overlay names with the overlay's tool list and its
    keys' lists added to the base's."""
    if tenant is None or not tenant.servers:
        return base
    servers = dict(base.servers)
    for name, given in tenant.servers.items():
        kept = base.servers.get(name) or McpServerPolicy()
        keys = {**kept.keys, **given.keys}  # a key's narrower list stays narrow under its tenant's overlay
        servers[name] = McpServerPolicy(tools=given.tools, keys=keys, pinned=kept.pinned)
    return base.model_copy(update={"servers": servers})
