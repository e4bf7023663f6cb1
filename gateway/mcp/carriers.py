"""What MCP's JSON-RPC messages carry, in the content inventory's vocabulary (gateway/apis/inventory.py): the
client's messages (a tools/call's arguments are text a model wrote, `tool_arguments`), and the answers whose text
enters a model: tool definitions (`tool_definitions`), tool results (`tool_result`), resources read and prompts got
(`document`). Whatever a table does not name is unknown content, read by everyone.
"""

from __future__ import annotations

from gateway.apis.carriers import DEFINITION
from gateway.apis.inventory import (
    FIELD,
    IDENTIFIER,
    SETTINGS,
    TEXT,
    Arr,
    Carrier,
    Either,
    Map,
    Obj,
    Opaque,
    Ref,
    Spec,
    Switch,
    Tree,
    said_by,
)

_META = {"_meta": SETTINGS}
_ARGUMENTS = Carrier(Tree("text", "tool_arguments"))

CLIENT_MESSAGE = Obj(
    {
        "jsonrpc": FIELD,
        "id": IDENTIFIER,
        "method": IDENTIFIER,
        "params": Obj(
            {
                "name": IDENTIFIER,  # a tool's or a prompt's
                "arguments": _ARGUMENTS,  # a tool's, or the strings a prompt template is filled with
                "uri": IDENTIFIER,
                "cursor": IDENTIFIER,
                "protocolVersion": FIELD,
                "capabilities": SETTINGS,
                "clientInfo": SETTINGS,
                "level": FIELD,
                "ref": SETTINGS,
                "argument": Obj({"name": IDENTIFIER, "value": Carrier(Tree("text", "user"))}),
                "context": SETTINGS,
                "requestId": IDENTIFIER,
                "reason": TEXT,
                "progressToken": IDENTIFIER,
                "progress": FIELD,
                "total": FIELD,
                "message": TEXT,
                **_META,
            }
        ),
        # a client's answer to a request the server sent (relayed only where the policy relays that method)
        "result": Tree("text", "user"),
        "error": SETTINGS,
    }
)

# A content block of a tool result or a prompt message; its texts are of the enclosing carrier's provenance.
_ANNOTATIONS = {"annotations": SETTINGS, **_META}
_RESOURCE = Obj({"uri": IDENTIFIER, "mimeType": FIELD, "text": TEXT, "blob": Opaque(), **_META})
CONTENT_BLOCK = Switch(
    "type",
    {
        "text": Obj({"type": FIELD, "text": TEXT, **_ANNOTATIONS}),
        **dict.fromkeys(("image", "audio"), Obj({"type": FIELD, "data": Opaque(), "mimeType": FIELD, **_ANNOTATIONS})),
        "resource": Obj({"type": FIELD, "resource": _RESOURCE, **_ANNOTATIONS}),
        "resource_link": Obj(
            {
                "type": FIELD,
                "uri": IDENTIFIER,
                "name": IDENTIFIER,
                "title": TEXT,
                "description": TEXT,
                "mimeType": FIELD,
                "size": FIELD,
                "icons": SETTINGS,
                **_ANNOTATIONS,
            }
        ),
    },
)

_RESULT_FIELDS = {"resultType": FIELD, "ttlMs": FIELD, "cacheScope": FIELD, "nextCursor": IDENTIFIER, **_META}


def _answer(result: dict[str, Spec]) -> Obj:
    """A JSON-RPC answer whose result holds these fields (an error answer's fields are the server's own)."""
    return Obj({"jsonrpc": FIELD, "id": IDENTIFIER, "result": Obj({**_RESULT_FIELDS, **result}), "error": SETTINGS})


# A tool's schemas as the classifier reads them: their descriptions, each on its own. The rest of a schema (titles
# a library derives from parameter names, types, enums) is no prose the classifier can judge: it scores generated
# titles such as "addOutput" as instructions. It is the pin's to hold (gateway/mcp/pins.py hashes all of a tool).
_DESCRIBED = Ref(lambda: DESCRIBED_SCHEMA)
_DESCRIBED_EITHER = Either(obj=_DESCRIBED, array=Arr(_DESCRIBED))
DESCRIBED_SCHEMA: Spec = Obj(
    {
        "description": DEFINITION,
        **dict.fromkeys(("properties", "patternProperties", "$defs", "definitions"), Map(_DESCRIBED)),
        **dict.fromkeys(("items", "additionalItems"), _DESCRIBED_EITHER),
        **dict.fromkeys(("prefixItems", "anyOf", "oneOf", "allOf"), Arr(_DESCRIBED)),
        **dict.fromkeys(("additionalProperties", "not", "if", "then", "else"), Either(obj=_DESCRIBED)),
    },
    rest=SETTINGS,
)
# One tool of a tools/list answer: each description read as a passage of its own.
TOOL = said_by(
    "tool_definitions",
    Obj(
        {
            "name": IDENTIFIER,
            "title": DEFINITION,
            "description": DEFINITION,
            "inputSchema": DESCRIBED_SCHEMA,
            "outputSchema": DESCRIBED_SCHEMA,
            "annotations": Obj({"title": DEFINITION}, rest=SETTINGS),
            **_META,
        },
        rest=SETTINGS,
    ),
)

# The answers whose text enters a model, by the method they answer.
ANSWERS: dict[str, Spec] = {
    "tools/call": _answer(
        {
            "content": Carrier(Arr(CONTENT_BLOCK), "tool_result"),
            "structuredContent": Carrier(Tree("text", "tool_result")),
            "isError": FIELD,
        }
    ),
    "resources/read": _answer({"contents": Carrier(Arr(_RESOURCE), "document")}),
    "prompts/get": _answer(
        {
            "description": Carrier(TEXT, "document"),
            "messages": Carrier(Arr(Obj({"role": FIELD, "content": CONTENT_BLOCK})), "document"),
        }
    ),
}
