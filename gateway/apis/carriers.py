"""Carriers every shape shares: JSON Schema (tool parameters, output formats) and the passthrough body.

A schema is text the model reads where it describes (descriptions, titles, enum values, examples), identifiers
where it names (required properties, references), and application fields where it constrains (types, formats,
bounds). Its keys of the client's choosing are property names: the WAF's `args_names` read every key.
"""

from __future__ import annotations

from gateway.apis.inventory import FIELD, IDENTIFIER, SETTINGS, Arr, Either, Map, Obj, Ref, Spec, Tree, text

DEFINITION = text("tool_definitions")
_SCHEMA = Ref(lambda: SCHEMA)
_SCHEMAS = Map(_SCHEMA)
_SCHEMA_OR_SCHEMAS = Either(obj=_SCHEMA, array=Arr(_SCHEMA))
_DEFINITION_VALUES = Tree("text", "tool_definitions")

SCHEMA: Spec = Obj(
    {
        **dict.fromkeys(("description", "title", "$comment", "const"), DEFINITION),
        "enum": Arr(DEFINITION),
        "default": _DEFINITION_VALUES,
        "examples": _DEFINITION_VALUES,
        "type": Either(string=FIELD, array=Arr(FIELD)),
        **dict.fromkeys(("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"), _SCHEMAS),
        "items": _SCHEMA_OR_SCHEMAS,
        "additionalItems": _SCHEMA_OR_SCHEMAS,
        "prefixItems": Arr(_SCHEMA),
        **dict.fromkeys(("anyOf", "oneOf", "allOf"), Arr(_SCHEMA)),
        **dict.fromkeys(
            (
                "additionalProperties",
                "unevaluatedProperties",
                "unevaluatedItems",
                "contains",
                "propertyNames",
                "not",
                "if",
                "then",
                "else",
            ),
            _SCHEMA,
        ),
        "required": Arr(IDENTIFIER),
        "dependentRequired": Map(Arr(IDENTIFIER)),
        **dict.fromkeys(("$ref", "$id", "$anchor", "$dynamicRef", "$dynamicAnchor"), IDENTIFIER),
        "discriminator": Obj({"propertyName": IDENTIFIER, "mapping": Map(IDENTIFIER)}),
        **dict.fromkeys(
            (
                "$schema",
                "format",
                "pattern",
                "contentEncoding",
                "contentMediaType",
                "minimum",
                "maximum",
                "exclusiveMinimum",
                "exclusiveMaximum",
                "multipleOf",
                "minLength",
                "maxLength",
                "minItems",
                "maxItems",
                "uniqueItems",
                "minProperties",
                "maxProperties",
                "minContains",
                "maxContains",
                "nullable",
                "deprecated",
                "readOnly",
                "writeOnly",
                "strict",
            ),
            FIELD,
        ),
        "$vocabulary": SETTINGS,
    }
)

PASSTHROUGH: Spec = SETTINGS  # a route the gateway does not read as a model request: all of it application fields
