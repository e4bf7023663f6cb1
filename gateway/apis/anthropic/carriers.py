"""What an Anthropic Messages request carries, as a table for the content inventory (gateway/apis/inventory.py),
written from the Messages API reference and the official SDK's request types (tests/unit/test_inventory_sdk.py holds
the table to every string those types declare).

A message's role is the provenance of its text blocks; a tool_result block's content is `tool_result`; documents,
search results and what the server tools fetched (web search results, fetched pages) are `document`; a tool_use
block's input is `tool_arguments`; thinking is `reasoning`. Blocks nest (a tool result holds documents, a fetched
page is a document): a block keeps the provenance of the carrier it is in unless it names its own.
"""

from __future__ import annotations

from gateway.apis.carriers import DEFINITION, SCHEMA
from gateway.apis.inventory import (
    FIELD,
    IDENTIFIER,
    SETTINGS,
    TEXT,
    Arr,
    Carrier,
    Either,
    FileData,
    Map,
    MediaUrl,
    ModelChoice,
    Obj,
    Opaque,
    Ref,
    Run,
    Spec,
    Switch,
    Tree,
    said_by,
    text,
)

_BLOCK = Ref(lambda: BLOCK)
_BLOCKS = Either(string=TEXT, array=Run(_BLOCK))
_CACHE = {"cache_control": SETTINGS}
_CALLER = Obj({"type": FIELD, "tool_id": IDENTIFIER})
_ARGUMENTS = Tree("text", "tool_arguments")
_OPAQUE = Opaque()

_CITATION = said_by(
    "document",
    Obj(
        {
            "type": FIELD,
            "cited_text": TEXT,
            "document_title": TEXT,
            "title": TEXT,
            "url": IDENTIFIER,
            "source": IDENTIFIER,
            "file_id": IDENTIFIER,
            "encrypted_index": _OPAQUE,
            **dict.fromkeys(
                (
                    "document_index",
                    "search_result_index",
                    "start_char_index",
                    "end_char_index",
                    "start_page_number",
                    "end_page_number",
                    "start_block_index",
                    "end_block_index",
                ),
                FIELD,
            ),
        }
    ),
)
TEXT_BLOCK = Obj({"type": FIELD, "text": TEXT, "citations": Arr(_CITATION), **_CACHE})
_IMAGE_SOURCE = Switch(
    "type",
    {
        "base64": Obj({"type": FIELD, "media_type": FIELD, "data": FileData(type_key="media_type")}),
        "url": Obj({"type": FIELD, "url": MediaUrl()}),
        "file": Obj({"type": FIELD, "file_id": IDENTIFIER}),
    },
)
_IMAGE = Obj({"type": FIELD, "source": _IMAGE_SOURCE, "transformations": SETTINGS, **_CACHE})
_DOCUMENT_SOURCE = Switch(
    "type",
    {
        "base64": Obj({"type": FIELD, "media_type": FIELD, "data": FileData(type_key="media_type")}),
        "text": Obj({"type": FIELD, "media_type": FIELD, "data": TEXT}),
        "content": Obj({"type": FIELD, "content": _BLOCKS}),
        "url": Obj({"type": FIELD, "url": MediaUrl()}),
        "file": Obj({"type": FIELD, "file_id": IDENTIFIER}),
    },
)
DOCUMENT = Carrier(
    Obj(
        {
            "type": FIELD,
            "source": _DOCUMENT_SOURCE,
            "title": TEXT,
            "context": TEXT,
            "citations": SETTINGS,
            **_CACHE,
        }
    ),
    "document",
)
_SEARCH_RESULT = Carrier(
    Obj(
        {
            "type": FIELD,
            "source": IDENTIFIER,
            "title": TEXT,
            "content": Run(_BLOCK),
            "citations": SETTINGS,
            **_CACHE,
        }
    ),
    "document",
)
_TOOL_USE = Carrier(
    Obj(
        {
            "type": FIELD,
            "id": IDENTIFIER,
            "name": IDENTIFIER,
            "input": _ARGUMENTS,
            "caller": _CALLER,
            "toolset_name": IDENTIFIER,
            "server_name": IDENTIFIER,
            **_CACHE,
        }
    ),
)
_ERROR = {"type": FIELD, "error_code": FIELD, "error_message": TEXT}
_OUTPUT_FILES = Arr(Obj({"type": FIELD, "file_id": IDENTIFIER}))
_EXECUTION_RESULT = Switch(
    "type",
    {
        **dict.fromkeys(
            ("code_execution_result", "bash_code_execution_result"),
            Obj({"type": FIELD, "stdout": TEXT, "stderr": TEXT, "return_code": FIELD, "content": _OUTPUT_FILES}),
        ),
        "encrypted_code_execution_result": Obj(
            {"type": FIELD, "encrypted_stdout": _OPAQUE, "stderr": TEXT, "return_code": FIELD, "content": _OUTPUT_FILES}
        ),
        "text_editor_code_execution_view_result": Obj(
            {
                "type": FIELD,
                "content": TEXT,
                "file_type": FIELD,
                "num_lines": FIELD,
                "start_line": FIELD,
                "total_lines": FIELD,
            }
        ),
        "text_editor_code_execution_create_result": Obj({"type": FIELD, "is_file_update": FIELD}),
        "text_editor_code_execution_str_replace_result": Obj(
            {
                "type": FIELD,
                "lines": Arr(TEXT),
                **dict.fromkeys(("new_lines", "new_start", "old_lines", "old_start"), FIELD),
            }
        ),
        **dict.fromkeys(
            (
                "code_execution_tool_result_error",
                "bash_code_execution_tool_result_error",
                "text_editor_code_execution_tool_result_error",
            ),
            Obj(_ERROR),
        ),
    },
)
_TOOL_REFERENCE = Obj({"type": FIELD, "tool_name": IDENTIFIER})
_BROWSER_STATE = Obj(
    {
        "type": FIELD,
        "tabs": Arr(Obj({"tab_id": IDENTIFIER, "title": TEXT, "url": IDENTIFIER, "active": FIELD})),
        "state_changes": Arr(
            Obj(
                {
                    "type": FIELD,
                    "tab_id": IDENTIFIER,
                    "download_id": IDENTIFIER,
                    "url": IDENTIFIER,
                    "path": IDENTIFIER,
                    "size_bytes": FIELD,
                    "error": TEXT,
                }
            )
        ),
    }
)


def _server_result(content: Spec, provenance: str = "tool_result") -> Spec:
    """A result block of a tool Anthropic runs: the call's id, and what it returned."""
    return Carrier(
        Obj({"type": FIELD, "tool_use_id": IDENTIFIER, "caller": _CALLER, "content": content, **_CACHE}),
        provenance,  # type: ignore[arg-type]
    )


BLOCK: Spec = Switch(
    "type",
    {
        "text": TEXT_BLOCK,
        "image": _IMAGE,
        "document": DOCUMENT,
        "search_result": _SEARCH_RESULT,
        "thinking": said_by("reasoning", Obj({"type": FIELD, "thinking": TEXT, "signature": _OPAQUE})),
        "redacted_thinking": Obj({"type": FIELD, "data": _OPAQUE}),
        "tool_use": _TOOL_USE,
        "server_tool_use": _TOOL_USE,
        "mcp_tool_use": _TOOL_USE,
        "tool_result": Carrier(
            Obj(
                {
                    "type": FIELD,
                    "tool_use_id": IDENTIFIER,
                    "content": _BLOCKS,
                    "is_error": FIELD,
                    "toolset_name": IDENTIFIER,
                    **_CACHE,
                }
            ),
            "tool_result",
        ),
        "mcp_tool_result": Carrier(
            Obj({"type": FIELD, "tool_use_id": IDENTIFIER, "content": _BLOCKS, "is_error": FIELD, **_CACHE}),
            "tool_result",
        ),
        "web_search_tool_result": _server_result(
            Either(
                array=Arr(
                    Obj(
                        {
                            "type": FIELD,
                            "title": TEXT,
                            "url": IDENTIFIER,
                            "page_age": FIELD,
                            "encrypted_content": _OPAQUE,
                        }
                    )
                ),
                obj=Obj(_ERROR),
            ),
            "document",
        ),
        "web_fetch_tool_result": _server_result(
            Switch(
                "type",
                {
                    "web_fetch_result": Obj(
                        {"type": FIELD, "url": IDENTIFIER, "retrieved_at": FIELD, "content": DOCUMENT}
                    ),
                    "web_fetch_tool_result_error": Obj(_ERROR),
                },
            ),
            "document",
        ),
        **dict.fromkeys(
            (
                "code_execution_tool_result",
                "bash_code_execution_tool_result",
                "text_editor_code_execution_tool_result",
            ),
            _server_result(_EXECUTION_RESULT),
        ),
        "tool_search_tool_result": _server_result(
            Switch(
                "type",
                {
                    "tool_search_tool_search_result": Obj({"type": FIELD, "tool_references": Arr(_TOOL_REFERENCE)}),
                    "tool_search_tool_result_error": Obj(_ERROR),
                },
            )
        ),
        "tool_reference": _TOOL_REFERENCE,
        "browser_state": said_by("tool_result", _BROWSER_STATE),
        "container_upload": Obj({"type": FIELD, "file_id": IDENTIFIER, **_CACHE}),
        # what the advisor tool's model advised: a tool's result, or the provider's encrypted form of it
        "advisor_tool_result": _server_result(
            Switch(
                "type",
                {
                    "advisor_result": Obj({"type": FIELD, "text": TEXT, "stop_reason": FIELD}),
                    "advisor_redacted_result": Obj({"type": FIELD, "encrypted_content": _OPAQUE, "stop_reason": FIELD}),
                    "advisor_tool_result_error": Obj(_ERROR),
                },
            )
        ),
        # a summary of the turns it replaces, which the model reads in their place (in the message's role)
        "compaction": Obj(
            {
                "type": FIELD,
                "content": TEXT,
                "encrypted_content": _OPAQUE,
                "signature": _OPAQUE,
                "tool_changes": Arr(Ref(lambda: _TOOL_CHANGE)),
                **_CACHE,
            }
        ),
        "tool_addition": Ref(lambda: _TOOL_CHANGE),
        "tool_removal": Ref(lambda: _TOOL_CHANGE),
        "mcp_tool_listing": Obj(
            {"type": FIELD, "mcp_server_name": IDENTIFIER, "tools": Arr(Ref(lambda: _MCP_TOOL)), **_CACHE}
        ),
        # where an earlier answer moved to another model: a record the provider checks, not rendered into the prompt
        "fallback": Obj({"type": FIELD, "from": Obj({"model": FIELD}), "to": Obj({"model": FIELD}), **_CACHE}),
    },
)

_MESSAGE = Obj({"role": FIELD, "content": _BLOCKS})
MESSAGE = Switch(
    "role",
    {
        "user": said_by("user", _MESSAGE),
        "assistant": said_by("assistant", _MESSAGE),
        "system": said_by("system", _MESSAGE),
    },
)

_DOMAINS = Arr(IDENTIFIER)
# a tool an MCP server listed, as it listed it: its description and schema are what the model is told of it
_MCP_TOOL: Spec = Carrier(Obj({"name": IDENTIFIER, "description": DEFINITION, "input_schema": SCHEMA}))
_URL_SOURCE = Obj({"type": FIELD, "tools": Arr(Obj({"type": FIELD, "name": IDENTIFIER}))})
TOOL = Obj(
    {
        "type": FIELD,
        "name": IDENTIFIER,
        "description": DEFINITION,
        "input_schema": SCHEMA,
        "input_examples": Arr(Tree("text", "tool_definitions")),
        "allowed_callers": Arr(FIELD),
        "allowed_domains": _DOMAINS,
        "blocked_domains": _DOMAINS,
        "user_location": SETTINGS,
        "url_sources": Map(_URL_SOURCE),
        "citations": SETTINGS,
        "configs": SETTINGS,
        "default_config": SETTINGS,
        "caching": SETTINGS,
        "mcp_server_name": IDENTIFIER,
        "tools": Arr(_MCP_TOOL),
        "model": ModelChoice(),  # the advisor tool's: another model, which the gateway has not authorised
        **dict.fromkeys(
            (
                "max_tokens",
                "strict",
                "defer_loading",
                "eager_input_streaming",
                "max_uses",
                "max_content_tokens",
                "max_characters",
                "use_cache",
                "response_inclusion",
                "display_width_px",
                "display_height_px",
                "display_number",
                "enable_zoom",
            ),
            FIELD,
        ),
        **_CACHE,
    }
)

# a tool made available or withdrawn mid-conversation: by name, or defined inline as a `tools` entry is
_TOOL_CHANGE: Spec = Obj(
    {
        "type": FIELD,
        "tool": Switch(
            "type",
            {
                "tool_reference": Obj({"type": FIELD, "name": IDENTIFIER}),
                "mcp_tool_reference": Obj({"type": FIELD, "name": IDENTIFIER, "server_name": IDENTIFIER}),
                "mcp_toolset_reference": Obj({"type": FIELD, "server_name": IDENTIFIER}),
                "tool_definition": Obj({"type": FIELD, "definition": Carrier(TOOL)}),
            },
        ),
        **_CACHE,
    }
)
_OUTPUT_CONFIG = Obj({"effort": FIELD, "task_budget": SETTINGS, "format": Obj({"type": FIELD, "schema": SCHEMA})})
_INSTRUCTIONS = text("system")  # what the client tells the model to summarise by: its own instructions

MESSAGES: Spec = Obj(
    {
        **dict.fromkeys(
            (
                "model",
                "max_tokens",
                "stream",
                "temperature",
                "top_k",
                "top_p",
                "service_tier",
                "speed",
                "inference_geo",
            ),
            FIELD,
        ),
        "system": said_by("system", _BLOCKS),
        "messages": Arr(MESSAGE),
        "tools": Arr(Carrier(TOOL)),
        "tool_choice": Obj({"type": FIELD, "name": IDENTIFIER, "disable_parallel_tool_use": FIELD}),
        "stop_sequences": Arr(FIELD),
        "metadata": Obj({"user_id": FIELD}),
        "thinking": SETTINGS,
        "cache_control": SETTINGS,
        "output_config": _OUTPUT_CONFIG,
        "container": Either(
            string=IDENTIFIER,
            obj=Obj({"id": IDENTIFIER, "skills": Arr(Obj({"type": FIELD, "skill_id": IDENTIFIER, "version": FIELD}))}),
        ),
        "diagnostics": Obj({"previous_message_id": IDENTIFIER}),
        "user_profile_id": IDENTIFIER,
        "workspace_id": IDENTIFIER,
        # remote MCP servers (beta): the connection is the client's, its token must reach the provider as sent
        "mcp_servers": Arr(
            Obj(
                {
                    "type": FIELD,
                    "url": IDENTIFIER,
                    "name": IDENTIFIER,
                    "authorization_token": FIELD,
                    "tool_configuration": Obj({"enabled": FIELD, "allowed_tools": Arr(IDENTIFIER)}),
                }
            )
        ),
        # server-side fallbacks: other models the provider would run, which the gateway has not authorised
        "fallbacks": Either(
            string=ModelChoice(),
            array=Arr(
                Obj(
                    {
                        "model": ModelChoice(),
                        "max_tokens": FIELD,
                        "speed": FIELD,
                        "thinking": SETTINGS,
                        "output_config": _OUTPUT_CONFIG,
                    }
                )
            ),
        ),
        "fallback_credit_token": Either(string=_OPAQUE, obj=Obj({"token": _OPAQUE, "mode": FIELD})),
        "thread": Obj({"type": FIELD, "previous_message_id": IDENTIFIER}),
        "compaction": Obj({"type": FIELD, "instructions": _INSTRUCTIONS}),
        "context_management": Obj(
            {
                "edits": Arr(
                    Obj(
                        {
                            "type": FIELD,
                            "instructions": _INSTRUCTIONS,
                            "clear_tool_inputs": Arr(IDENTIFIER),
                            "exclude_tools": Arr(IDENTIFIER),
                            **dict.fromkeys(("keep", "trigger", "clear_at_least"), SETTINGS),
                            "pause_after_compaction": FIELD,
                        }
                    )
                )
            }
        ),
        "betas": Arr(FIELD),  # the SDK's beta names (it sends them as the `anthropic-beta` header)
    }
)
