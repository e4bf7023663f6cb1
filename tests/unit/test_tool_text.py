"""The walk over tool definitions that the WAF's prompt part and the guard's `tool_definitions` role share."""

from __future__ import annotations

from gateway.tool_text import dotted, tool_descriptions


def test_every_description_in_document_order_however_deep():
    schema: dict = {"type": "object"}
    node = schema
    for _ in range(5000):  # deeper than Python's recursion limit
        node["items"] = {}
        node = node["items"]
    node["description"] = "deepest"
    payload = {
        "tools": [
            {"type": "function", "function": {"name": "f", "description": "top", "parameters": schema}},
            {
                "type": "function",
                "function": {
                    "name": "g",
                    "parameters": {
                        "properties": {
                            "description": {"type": "string", "description": "a parameter named description"}
                        }
                    },
                },
            },
        ],
        "functions": [{"name": "h", "description": "legacy"}],
    }
    found = [(dotted(loc), holder[key]) for holder, key, loc in tool_descriptions(payload)]
    assert [text for _, text in found] == ["top", "deepest", "a parameter named description", "legacy"]
    assert found[0][0] == "tools[0].function.description"
    assert found[2][0] == "tools[1].function.parameters.properties.description.description"
    assert found[3][0] == "functions[0].description"


def test_descriptions_are_rewritable_in_place():
    payload = {"tools": [{"type": "function", "function": {"name": "f", "description": "key AKIA..."}}]}
    for holder, key, _ in tool_descriptions(payload):
        holder[key] = "[REDACTED]"
    assert payload["tools"][0]["function"]["description"] == "[REDACTED]"
    assert list(tool_descriptions({"messages": []})) == [] and list(tool_descriptions("x")) == []
