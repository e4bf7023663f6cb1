"""What each OpenAI request shape carries (chat completions, completions, embeddings, Responses), as tables for the
content inventory (gateway/apis/inventory.py), written from the API references and the official SDK's request
types (tests/unit/test_inventory_sdk.py holds the tables to every string those types declare).

A message's role is the provenance of what it says; a tool's output is `tool_result`, an attached file
`document`, a call the model made `tool_arguments`, a tool's or output schema's description `tool_definitions`.
Each tool definition is one unit for the guard: its description and its parameters' read together.
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
    JsonText,
    Map,
    MediaUrl,
    Obj,
    Opaque,
    PromptInput,
    Ref,
    Run,
    Spec,
    Switch,
    Tree,
    said_by,
    text,
)

ARGUMENTS = text("tool_arguments")
JSON_ARGUMENTS = JsonText("tool_arguments")  # a function call's arguments: JSON text, read as the tool parses it
MEDIA_URL = MediaUrl()
MEDIA_BYTES = FileData("application/octet-stream")  # base64 audio and images: opaque when valid base64
OPAQUE = Opaque()
STRINGS = Either(string=FIELD, array=Arr(FIELD))
METADATA = Map(FIELD)

# Sampling and serving fields of chat and completions, OpenAI's and those vLLM-style servers (the bundled engine
# among them) accept; what they set is never read by a model.
_GENERATION = dict.fromkeys(
    (
        "model",
        "stream",
        "max_tokens",
        "max_completion_tokens",
        "n",
        "temperature",
        "top_p",
        "presence_penalty",
        "frequency_penalty",
        "seed",
        "logprobs",
        "top_logprobs",
        "user",
        "safety_identifier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "service_tier",
        "store",
        "parallel_tool_calls",
        "reasoning_effort",
        "verbosity",
        "best_of",
        "echo",
        "top_k",
        "min_p",
        "repetition_penalty",
        "length_penalty",
        "min_tokens",
        "ignore_eos",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "include_stop_str_in_output",
        "add_generation_prompt",
        "continue_final_message",
        "add_special_tokens",
        "use_beam_search",
        "truncate_prompt_tokens",
        "return_tokens_as_token_ids",
        "priority",
        "cache_salt",
    ),
    FIELD,
) | {
    "stop": STRINGS,
    "stop_token_ids": Arr(FIELD),
    "logit_bias": Map(FIELD),
    "metadata": METADATA,
    "stream_options": SETTINGS,
    "modalities": Arr(FIELD),
    "prompt_cache_options": SETTINGS,
    "moderation": SETTINGS,
    "request_id": IDENTIFIER,
}

# -- chat completions -----------------------------------------------------------------------------------------------

_BREAKPOINT = {"prompt_cache_breakpoint": SETTINGS}
_TEXT_PART = Obj({"type": FIELD, "text": TEXT, **_BREAKPOINT})
_URL_OBJECT = Either(string=MEDIA_URL, obj=Obj({"url": MEDIA_URL, "detail": FIELD}))
CHAT_PART = Switch(
    "type",
    {
        "text": _TEXT_PART,
        "refusal": Obj({"type": FIELD, "refusal": TEXT}),
        "image_url": Obj({"type": FIELD, "image_url": _URL_OBJECT, **_BREAKPOINT}),
        "video_url": Obj({"type": FIELD, "video_url": _URL_OBJECT, **_BREAKPOINT}),
        "audio_url": Obj({"type": FIELD, "audio_url": _URL_OBJECT, **_BREAKPOINT}),
        "input_audio": Obj({"type": FIELD, "input_audio": Obj({"data": MEDIA_BYTES, "format": FIELD}), **_BREAKPOINT}),
        "file": Obj(
            {
                "type": FIELD,
                "file": Obj(
                    {"file_data": FileData(name_key="filename"), "file_id": IDENTIFIER, "filename": IDENTIFIER}
                ),
                **_BREAKPOINT,
            }
        ),
    },
)
_CALL_FUNCTION = Obj({"name": IDENTIFIER, "arguments": JSON_ARGUMENTS})
_FUNCTION_CALL = Obj({"id": IDENTIFIER, "type": FIELD, "index": FIELD, "function": _CALL_FUNCTION})
_TOOL_CALL = Switch(
    "type",
    {
        "function": _FUNCTION_CALL,
        "custom": Obj(
            {"id": IDENTIFIER, "type": FIELD, "index": FIELD, "custom": Obj({"name": IDENTIFIER, "input": ARGUMENTS})}
        ),
    },
    absent=_FUNCTION_CALL,
)
_MESSAGE = Obj(
    {
        "role": FIELD,
        "content": Either(string=TEXT, array=Run(CHAT_PART)),
        "name": IDENTIFIER,
        "tool_call_id": IDENTIFIER,
        "tool_calls": Arr(_TOOL_CALL),
        "function_call": _CALL_FUNCTION,
        "refusal": TEXT,
        "audio": Obj({"id": IDENTIFIER}),
        "reasoning_content": text("reasoning"),
        "reasoning": text("reasoning"),
    }
)
CHAT_MESSAGE = Switch(
    "role",
    {
        "system": said_by("system", _MESSAGE),
        "developer": said_by("developer", _MESSAGE),
        "user": said_by("user", _MESSAGE),
        "assistant": said_by("assistant", _MESSAGE),
        "tool": said_by("tool_result", _MESSAGE),
        "function": said_by("tool_result", _MESSAGE),  # the legacy form of tool results
    },
)

FUNCTION_DEFINITION = Obj({"name": IDENTIFIER, "description": DEFINITION, "parameters": SCHEMA, "strict": FIELD})
CUSTOM_FORMAT = Obj(
    {
        "type": FIELD,
        "grammar": Obj({"definition": DEFINITION, "syntax": FIELD}),
        "definition": DEFINITION,
        "syntax": FIELD,
    }
)
_CHAT_TOOL = Switch(
    "type",
    {
        "function": Obj({"type": FIELD, "function": FUNCTION_DEFINITION}),
        "custom": Obj(
            {
                "type": FIELD,
                "custom": Obj({"name": IDENTIFIER, "description": DEFINITION, "format": CUSTOM_FORMAT}),
            }
        ),
    },
)
TOOL_REFERENCE = Obj(
    {
        "type": FIELD,
        "name": IDENTIFIER,
        "server_label": IDENTIFIER,
        "function": Obj({"name": IDENTIFIER}),
        "custom": Obj({"name": IDENTIFIER}),
    }
)
_CHAT_TOOL_CHOICE = Either(
    string=FIELD,
    obj=Obj(
        {
            "type": FIELD,
            "function": Obj({"name": IDENTIFIER}),
            "custom": Obj({"name": IDENTIFIER}),
            "allowed_tools": Obj({"mode": FIELD, "tools": Arr(TOOL_REFERENCE)}),
        }
    ),
)
RESPONSE_FORMAT = Obj(
    {
        "type": FIELD,
        "json_schema": Obj({"name": IDENTIFIER, "description": DEFINITION, "schema": SCHEMA, "strict": FIELD}),
    }
)
_TOOLS = {
    "tools": Arr(Carrier(_CHAT_TOOL)),
    "functions": Arr(Carrier(FUNCTION_DEFINITION)),
    "tool_choice": _CHAT_TOOL_CHOICE,
    "function_call": Either(string=FIELD, obj=Obj({"name": IDENTIFIER})),
    "response_format": RESPONSE_FORMAT,
}

CHAT: Spec = Obj(
    {
        **_GENERATION,
        **_TOOLS,
        "messages": Arr(CHAT_MESSAGE),
        "audio": Obj({"format": FIELD, "voice": Either(string=FIELD, obj=Obj({"id": IDENTIFIER}))}),
        "prediction": said_by("assistant", Obj({"type": FIELD, "content": Either(string=TEXT, array=Run(_TEXT_PART))})),
        "web_search_options": Obj({"search_context_size": FIELD, "user_location": SETTINGS}),
        "documents": Arr(Tree("text", "document")),  # vLLM: retrieved documents the chat template renders
    }
)

# -- completions and embeddings -------------------------------------------------------------------------------------

COMPLETIONS: Spec = Obj({**_GENERATION, **_TOOLS, "prompt": PromptInput(), "suffix": text("prompt")})

EMBEDDINGS: Spec = Obj(
    {
        **dict.fromkeys(
            (
                "model",
                "user",
                "dimensions",
                "encoding_format",
                "truncate_prompt_tokens",
                "add_special_tokens",
                "priority",
            ),
            FIELD,
        ),
        "input": PromptInput(),
    }
)

# -- Responses ------------------------------------------------------------------------------------------------------

_ANNOTATION = Obj(
    {
        "type": FIELD,
        "file_id": IDENTIFIER,
        "filename": IDENTIFIER,
        "container_id": IDENTIFIER,
        "url": IDENTIFIER,
        "title": text("document"),
        "index": FIELD,
        "start_index": FIELD,
        "end_index": FIELD,
    }
)
_INPUT_TEXT = Obj({"type": FIELD, "text": TEXT, **_BREAKPOINT})
_INPUT_IMAGE = Obj({"type": FIELD, "image_url": MEDIA_URL, "file_id": IDENTIFIER, "detail": FIELD, **_BREAKPOINT})
_INPUT_FILE = Obj(
    {
        "type": FIELD,
        "file_data": FileData(name_key="filename"),
        "file_id": IDENTIFIER,
        "file_url": IDENTIFIER,
        "filename": IDENTIFIER,
        "detail": FIELD,
        **_BREAKPOINT,
    }
)
RESPONSES_PART = Switch(
    "type",
    {
        "input_text": _INPUT_TEXT,
        "text": _INPUT_TEXT,
        "output_text": Obj(
            {"type": FIELD, "text": TEXT, "annotations": Arr(_ANNOTATION), "logprobs": SETTINGS}
        ),  # logprobs: per-token figures of an earlier answer, which no model reads back
        "refusal": Obj({"type": FIELD, "refusal": TEXT}),
        "input_image": _INPUT_IMAGE,
        "input_file": _INPUT_FILE,
    },
)
_CONTENT = Either(string=TEXT, array=Run(RESPONSES_PART))
_MESSAGE_BODY = Obj(
    {"type": FIELD, "role": FIELD, "id": IDENTIFIER, "status": FIELD, "phase": FIELD, "content": _CONTENT}
)
_RESPONSES_MESSAGE = Switch(
    "role",
    {
        "user": said_by("user", _MESSAGE_BODY),
        "system": said_by("system", _MESSAGE_BODY),
        "developer": said_by("developer", _MESSAGE_BODY),
        "assistant": said_by("assistant", _MESSAGE_BODY),
    },
)
_CALLER = Obj({"type": FIELD, "caller_id": IDENTIFIER})
_ITEM = {"type": FIELD, "id": IDENTIFIER, "call_id": IDENTIFIER, "status": FIELD, "caller": _CALLER}
_SAFETY_CHECKS = Arr(Obj({"id": IDENTIFIER, "code": FIELD, "message": TEXT}))
_COMPUTER_ACTION = Obj(
    {
        "type": FIELD,
        "button": FIELD,
        "x": FIELD,
        "y": FIELD,
        "scroll_x": FIELD,
        "scroll_y": FIELD,
        "ms": FIELD,
        "path": SETTINGS,  # points
        "keys": Arr(ARGUMENTS),
        "text": ARGUMENTS,
    }
)
_SKILL = Obj(
    {
        "type": FIELD,
        "name": IDENTIFIER,
        "description": DEFINITION,
        "path": IDENTIFIER,
        "skill_id": IDENTIFIER,
        "version": FIELD,
        "source": Obj({"type": FIELD, "media_type": FIELD, "data": FileData(type_key="media_type")}),
    }
)
_NETWORK_POLICY = Obj(
    {
        "type": FIELD,
        "allowed_domains": Arr(IDENTIFIER),
        # a credential the provider presents to a domain on the client's behalf, as the client chose to send it
        "domain_secrets": Arr(Obj({"domain": IDENTIFIER, "name": IDENTIFIER, "value": FIELD})),
    }
)
_ENVIRONMENT = Obj(
    {
        "type": FIELD,
        "container_id": IDENTIFIER,
        "file_ids": Arr(IDENTIFIER),
        "memory_limit": FIELD,
        "network_policy": _NETWORK_POLICY,
        "skills": Arr(_SKILL),
    }
)
_FILTER: Obj = Obj({"type": FIELD, "key": IDENTIFIER, "value": STRINGS, "filters": Arr(Ref(lambda: _FILTER))})
_TOOL_NAMES = Obj({"read_only": FIELD, "tool_names": Arr(IDENTIFIER)})
RESPONSES_TOOL: Spec = Obj(
    {
        "type": FIELD,
        "name": IDENTIFIER,
        "description": DEFINITION,
        "parameters": SCHEMA,
        "output_schema": SCHEMA,
        "strict": FIELD,
        "async": FIELD,
        "defer_loading": FIELD,
        "allowed_callers": Arr(FIELD),
        "format": CUSTOM_FORMAT,
        "tools": Arr(Ref(lambda: RESPONSES_TOOL)),  # a namespace's tools
        # file search
        "vector_store_ids": Arr(IDENTIFIER),
        "filters": Either(obj=_FILTER.extended({"allowed_domains": Arr(IDENTIFIER)})),
        "max_num_results": FIELD,
        "ranking_options": SETTINGS,
        # computer use, web search, image generation, shell: settings
        **dict.fromkeys(
            (
                "display_width",
                "display_height",
                "search_context_size",
                "external_web_access",
                "action",
                "background",
                "complexity",
                "frame_count",
                "frame_duration_ms",
                "input_fidelity",
                "model",
                "moderation",
                "output_compression",
                "output_format",
                "partial_images",
                "quality",
                "size",
                "execution",
            ),
            FIELD,
        ),
        "search_content_types": Arr(FIELD),
        "user_location": SETTINGS,
        "svg": SETTINGS,
        "input_image_mask": Obj({"file_id": IDENTIFIER, "image_url": MEDIA_URL}),
        "environment": Either(string=FIELD, obj=_ENVIRONMENT),
        "container": Either(string=IDENTIFIER, obj=_ENVIRONMENT),
        # remote MCP servers
        "server_label": IDENTIFIER,
        "server_url": IDENTIFIER,
        "server_description": DEFINITION,
        "connector_id": FIELD,
        "tunnel_id": IDENTIFIER,
        "authorization": FIELD,  # the client's credential for its MCP server: it must reach the provider as sent
        "headers": METADATA,
        "allowed_tools": Either(array=Arr(IDENTIFIER), obj=_TOOL_NAMES),
        "require_approval": Either(string=FIELD, obj=Obj({"always": _TOOL_NAMES, "never": _TOOL_NAMES})),
    }
)
RESPONSES_TOOLS = Arr(Carrier(RESPONSES_TOOL))


def _item(**fields: Spec) -> Obj:
    return Obj({**_ITEM, **fields})


def _output(**fields: Spec) -> Spec:
    """An item that carries what a tool returned."""
    return said_by("tool_result", _item(**fields))


RESPONSES_ITEM = Switch(
    "type",
    {
        "message": _RESPONSES_MESSAGE,
        "function_call": _item(name=IDENTIFIER, namespace=IDENTIFIER, arguments=JSON_ARGUMENTS, **{"async": FIELD}),
        "function_call_output": _output(name=IDENTIFIER, namespace=IDENTIFIER, output=_CONTENT),
        "custom_tool_call": _item(name=IDENTIFIER, namespace=IDENTIFIER, input=ARGUMENTS, **{"async": FIELD}),
        "custom_tool_call_output": _output(output=_CONTENT),
        "file_search_call": _item(
            queries=Arr(ARGUMENTS),
            results=Arr(
                Carrier(
                    Obj(
                        {
                            "file_id": IDENTIFIER,
                            "filename": IDENTIFIER,
                            "score": FIELD,
                            "attributes": METADATA,
                            "text": TEXT,
                        }
                    ),
                    "document",
                )
            ),
        ),
        "web_search_call": _item(
            action=Obj(
                {
                    "type": FIELD,
                    "query": ARGUMENTS,
                    "queries": Arr(ARGUMENTS),
                    "pattern": ARGUMENTS,
                    "url": IDENTIFIER,
                    "sources": Arr(Obj({"type": FIELD, "url": IDENTIFIER})),
                }
            )
        ),
        "computer_call": _item(
            action=_COMPUTER_ACTION,
            actions=Arr(_COMPUTER_ACTION),
            pending_safety_checks=said_by("assistant", _SAFETY_CHECKS),
        ),
        "computer_call_output": _output(
            output=Obj({"type": FIELD, "file_id": IDENTIFIER, "image_url": MEDIA_URL}),
            acknowledged_safety_checks=said_by("user", _SAFETY_CHECKS),
        ),
        "code_interpreter_call": _item(
            code=ARGUMENTS,
            container_id=IDENTIFIER,
            outputs=said_by(
                "tool_result",
                Arr(
                    Switch(
                        "type",
                        {
                            "logs": Obj({"type": FIELD, "logs": TEXT}),
                            "image": Obj({"type": FIELD, "url": MEDIA_URL}),
                        },
                    )
                ),
            ),
        ),
        "image_generation_call": _item(
            result=MEDIA_BYTES,
            revised_prompt=ARGUMENTS,
            error=said_by(
                "tool_result",
                Obj(
                    {
                        "type": FIELD,
                        "code": FIELD,
                        "param": FIELD,
                        "message": TEXT,
                        "moderation_details": Obj({"categories": Arr(FIELD), "moderation_stage": FIELD}),
                    }
                ),
            ),
            **dict.fromkeys(("action", "background", "output_format", "quality", "size"), FIELD),
            svg_usage=SETTINGS,
        ),
        "local_shell_call": _item(
            action=Obj(
                {
                    "type": FIELD,
                    "command": Arr(ARGUMENTS),
                    "env": Map(ARGUMENTS),
                    "timeout_ms": FIELD,
                    "user": ARGUMENTS,
                    "working_directory": ARGUMENTS,
                }
            )
        ),
        "local_shell_call_output": _output(output=TEXT),
        "shell_call": _item(
            action=Obj({"commands": Arr(ARGUMENTS), "max_output_length": FIELD, "timeout_ms": FIELD}),
            environment=Either(obj=_ENVIRONMENT),
        ),
        "shell_call_output": _output(
            max_output_length=FIELD,
            output=Arr(Obj({"outcome": SETTINGS, "stdout": TEXT, "stderr": TEXT})),
        ),
        "apply_patch_call": _item(operation=Obj({"type": FIELD, "path": ARGUMENTS, "diff": ARGUMENTS})),
        "apply_patch_call_output": _output(output=TEXT),
        "mcp_list_tools": _item(
            server_label=IDENTIFIER,
            error=said_by("tool_result", TEXT),
            tools=Arr(
                Carrier(
                    Obj(
                        {
                            "name": IDENTIFIER,
                            "description": DEFINITION,
                            "input_schema": SCHEMA,
                            "annotations": Tree("text", "tool_definitions"),
                        }
                    )
                )
            ),
        ),
        "mcp_approval_request": _item(server_label=IDENTIFIER, name=IDENTIFIER, arguments=JSON_ARGUMENTS),
        "mcp_approval_response": _item(approval_request_id=IDENTIFIER, approve=FIELD, reason=text("user")),
        "mcp_call": _item(
            server_label=IDENTIFIER,
            name=IDENTIFIER,
            arguments=JSON_ARGUMENTS,
            approval_request_id=IDENTIFIER,
            output=text("tool_result"),
            error=said_by(
                "tool_result",
                Either(
                    string=TEXT,
                    obj=Obj({"type": FIELD, "code": FIELD, "message": TEXT, "content": Tree("text", "tool_result")}),
                ),
            ),
        ),
        "tool_search_call": _item(execution=FIELD, arguments=Tree("text", "tool_arguments")),
        "tool_search_output": _item(execution=FIELD, tools=RESPONSES_TOOLS),
        "additional_tools": _item(role=FIELD, tools=RESPONSES_TOOLS),
        "configuration_update": _item(reasoning=SETTINGS, text=Ref(lambda: _TEXT_CONFIG)),
        "reasoning": _item(
            summary=Arr(Obj({"type": FIELD, "text": text("reasoning")})),
            content=Arr(Obj({"type": FIELD, "text": text("reasoning")})),
            encrypted_content=OPAQUE,
        ),
        "compaction": _item(encrypted_content=OPAQUE),
        "compaction_trigger": _item(),
        "item_reference": _item(),
        "program": _item(code=ARGUMENTS, fingerprint=OPAQUE),
        "program_output": _output(result=TEXT),
    },
    # an EasyInputMessage may leave its type out, and so may an item reference (which has no role)
    absent=Switch("role", _RESPONSES_MESSAGE.cases, absent=_item()),
)

_TEXT_CONFIG: Spec = Obj(
    {
        "verbosity": FIELD,
        "format": Obj(
            {"type": FIELD, "name": IDENTIFIER, "description": DEFINITION, "schema": SCHEMA, "strict": FIELD}
        ),
    }
)

RESPONSES: Spec = Obj(
    {
        **dict.fromkeys(
            (
                "model",
                "stream",
                "background",
                "max_output_tokens",
                "max_tool_calls",
                "parallel_tool_calls",
                "prompt_cache_key",
                "prompt_cache_retention",
                "safety_identifier",
                "service_tier",
                "store",
                "temperature",
                "top_logprobs",
                "top_p",
                "truncation",
                "user",
            ),
            FIELD,
        ),
        "instructions": text("system"),
        "input": Either(string=text("user"), array=Arr(RESPONSES_ITEM)),
        "previous_response_id": IDENTIFIER,
        "conversation": Either(string=IDENTIFIER, obj=Obj({"id": IDENTIFIER})),
        # a stored prompt's variables: what the client fills into it, as a user turn would
        "prompt": Obj(
            {
                "id": IDENTIFIER,
                "version": FIELD,
                "variables": said_by("user", Map(Either(string=TEXT, obj=RESPONSES_PART))),
            }
        ),
        "metadata": METADATA,
        "include": Arr(FIELD),
        "tools": RESPONSES_TOOLS,
        "tool_choice": Either(
            string=FIELD,
            obj=TOOL_REFERENCE.extended({"mode": FIELD, "tools": Arr(TOOL_REFERENCE)}),
        ),
        "text": _TEXT_CONFIG,
        "reasoning": SETTINGS,
        "stream_options": SETTINGS,
        "prompt_cache_options": Obj(
            {"comparison_response_id": IDENTIFIER, "mode": FIELD, "prewarm": FIELD, "ttl": FIELD}
        ),
        "background_options": Obj({"completion_window": FIELD, "continuation_id": IDENTIFIER}),
        "context_management": Arr(SETTINGS),
        "moderation": SETTINGS,
        "image": SETTINGS,
        "access_programs": SETTINGS,
    }
)
