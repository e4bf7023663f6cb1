"""What a request's `model` may be, on every route: 1 to 256 characters of visible ASCII (`!` to `~`).

The model is the one request field that travels furthest as it was sent: it picks the pool and the fallbacks, keys
rate limits, budgets and the spend ledger (SQLite rows, Redis keys), names the trace's spans and the access log's
`model`, and comes back in the `x-portcullis-model` response header. So it is held at parse, before any of that acts
on it or an upstream is paid for it: a 400 in the route's own shape, naming `model`.

Why this set. The ids providers issue are ASCII: OpenAI's (`gpt-4o-mini`, `ft:gpt-4o-mini:org:suffix:id`), Anthropic's
(`claude-sonnet-4-5-20250929`), Bedrock's ARNs and inference profiles, Azure deployment names, Hugging Face repository
ids as vLLM and SGLang serve them (`meta-llama/Llama-3.1-8B-Instruct`), Ollama's tags (`llama3:8b`); 256 characters is
twice the longest of these. A gateway may front a model by another name (a served-model-name is the operator's choice),
but a name outside this set is one no header, metric label or log field carries as it is: a control character (NUL, DEL)
breaks the response, and a name beyond Latin-1 cannot be written in a header at all, and both only once the upstream has
served and charged the request. Spaces are refused too: one at either end is trimmed from a header, so the header would
name another model. The header writer encodes whatever reaches it anyway (gateway/header_values.py: an operator's
configured fallback name may be anything), so this rule is what clients are held to, not what keeps a header valid.
The operator's config (gateway/config.py) names its models by the same rule, so every model a request can reach is
one a client could have asked for by name.
"""

from __future__ import annotations

from gateway.errors import invalid_request

MAX_MODEL_CHARS = 256
_VISIBLE_ASCII = "[!-~]"
MODEL_NAME_PATTERN = rf"^{_VISIBLE_ASCII}{{1,{MAX_MODEL_CHARS}}}$"  # the operator's config names models by this rule


def is_model_name(model: str) -> bool:
    """Whether `model` is a name a request may carry: 1 to MAX_MODEL_CHARS characters of visible ASCII."""
    return 0 < len(model) <= MAX_MODEL_CHARS and _is_visible_ascii(model)


def _is_visible_ascii(text: str) -> bool:
    """Printable ASCII (space to `~`) less the space: str's own checks, a third of a regular expression's cost."""
    return text.isascii() and text.isprintable() and " " not in text


def check_model_name(model: str) -> None:
    """A 400 naming `model` unless it is 1 to MAX_MODEL_CHARS characters of visible ASCII (the shape checked it is a
    non-empty string)."""
    if len(model) > MAX_MODEL_CHARS:
        raise invalid_request(
            f"'model' is longer than {MAX_MODEL_CHARS} characters", param="model", code="string_above_max_length"
        )
    if not model or not _is_visible_ascii(model):
        raise invalid_request(
            "'model' must be visible ASCII (letters, digits and punctuation: no spaces, control characters or other "
            "scripts), as model ids are",
            param="model",
            code="invalid_value",
        )
