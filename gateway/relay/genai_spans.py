"""What an upstream call's CLIENT span says of its answer, in the OpenTelemetry GenAI semantic conventions.

The span follows the conventions' inference client span (https://opentelemetry.io/docs/specs/semconv/gen-ai/gen-ai-spans/,
now kept in the open-telemetry/semantic-conventions-genai repository, `docs/gen-ai/client-inference.md`):

- set when the attempt starts (gateway/relay/upstream.py): `gen_ai.operation.name`, `gen_ai.provider.name`,
  `gen_ai.request.model`, `gen_ai.request.stream`, `gen_ai.request.max_tokens` / `temperature` / `top_p` where the
  request names them, `server.address`, `server.port`;
- set as the answer arrives: `gen_ai.response.time_to_first_chunk` (seconds from the request sent to the first chunk
  of a streaming answer: the conventions' attribute, registered as `gen_ai.response.time_to_first_chunk`), and at its
  end those below (`response_attributes`);
- `error.type` on an attempt that failed: the upstream's status where it answered 400 or more, else the gateway's
  error code.

`gen_ai.provider.name` is the API the gateway speaks to the pool (`openai` or `anthropic`): the conventions name the
provider "as identified by the client", so an OpenAI-compatible server (vLLM, the bundled engine) is `openai`.
What the conventions do not cover (pools, attempts, fallbacks, the WAF's and the guard's decisions) is under the
project's `portcullis.*` namespace; docs/metrics.md lists both.
"""

from __future__ import annotations

from opentelemetry.util.types import AttributeValue

from gateway.apis.answers import token_count
from gateway.context import Usage

TIME_TO_FIRST_CHUNK = "gen_ai.response.time_to_first_chunk"


def response_attributes(usage: Usage) -> dict[str, AttributeValue]:
    """The answer's attributes: its id and model, finish reasons, and the token counts the upstream reported (only
    those that are counts; cache reads and reasoning where the answer reports some)."""
    attributes: dict[str, AttributeValue] = {}
    if usage.response_id is not None:
        attributes["gen_ai.response.id"] = usage.response_id
    if usage.response_model is not None:
        attributes["gen_ai.response.model"] = usage.response_model
    if usage.finish_reasons:
        attributes["gen_ai.response.finish_reasons"] = usage.finish_reasons
    for attribute, reported in (
        ("gen_ai.usage.input_tokens", usage.prompt_tokens),
        ("gen_ai.usage.output_tokens", usage.completion_tokens),
    ):
        if (count := token_count(reported)) is not None:
            attributes[attribute] = count
    for attribute, reported in (  # the conventions want these where they are non-zero
        ("gen_ai.usage.cache_read.input_tokens", usage.cached_tokens),
        ("gen_ai.usage.reasoning.output_tokens", usage.reasoning_tokens),
    ):
        if count := token_count(reported):
            attributes[attribute] = count
    return attributes
