"""OpenAI request bodies: typed fields, sampling parameters, prompts and one generation job per choice.

Every rejection is an `APIError` with OpenAI's status, message and offending parameter.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from typing import Any

import orjson
from starlette.requests import Request

from backend_engine.engine import LLMEngine
from backend_engine.http.openai_protocol.errors import APIError
from backend_engine.model.prompt import PromptError, prompt_too_long
from backend_engine.sequence import MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, SamplingParams

MAX_N = 16  # choices per prompt
MAX_CHOICES = 64  # prompts x n per request
MAX_TOKEN_ID_DIGITS = 18  # a logit_bias key longer than this is no vocabulary's token id (and still fits an int64)
# The salt is hashed into every KV block of its request on the engine thread, which every running request waits on:
# a 20 MB salt cost a 1,400-token prompt 3.6 s of hashing there. The gateway's salts are 16 characters.
MAX_CACHE_SALT_CHARS = 1024
MAX_BODY_BYTES = 32 << 20  # far above any prompt the context holds, or a batch of embedding inputs

_MISSING = object()


def field(body: dict[str, Any], key: str, types: type | tuple[type, ...], default: Any = None) -> Any:
    """body[key] checked against `types` (an int is accepted as a float; a bool is never a number);
    `default` when it is absent or null."""
    v = body.get(key, _MISSING)
    if v is _MISSING or v is None:
        return default
    if types is float and isinstance(v, int) and not isinstance(v, bool):
        return float(v)
    if not isinstance(v, types) or (isinstance(v, bool) and types in (int, float)):
        names = types.__name__ if isinstance(types, type) else "/".join(t.__name__ for t in types)
        raise APIError(400, f"'{key}' must be of type {names}", param=key, code="invalid_type")
    return v


def check_choices(num_prompts: int, n: int) -> None:
    if num_prompts * n > MAX_CHOICES:
        raise APIError(400, f"at most {MAX_CHOICES} choices (prompts x n) per request", param="prompt")


def is_token_id(value: Any) -> bool:
    """An int that is not a bool (JSON's true would otherwise pass as token 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def token_ids(value: Any, limit: int, param: str) -> list[int] | None:
    """A copy of `value` if it is a non-empty list of token ids, else None. One longer than `limit` is refused (400)
    before any id is looked at: walking ten million ids took seconds of a core the engine's steps share, only for
    the prompt to be refused as longer than the context."""
    if not isinstance(value, list) or not value:
        return None
    if len(value) > limit:
        raise APIError(
            400,
            f"'{param}' holds {len(value)} token ids, more than the {limit} this model's context can take",
            param=param,
            code="context_length_exceeded",
        )
    return list(value) if all(is_token_id(t) for t in value) else None


def _bounded(items: list[Any], limit: int, param: str) -> list[Any]:
    """`items`, or a 400 when there are more than `limit`: counted before they are walked, which for millions of
    them took a second of the core the engine's steps share."""
    if len(items) > limit:
        raise APIError(400, f"'{param}' may hold at most {limit} items", param=param)
    return items


def known_fields(body: dict[str, Any], allowed: frozenset[str]) -> None:
    """400 for the first field outside `allowed`, as OpenAI rejects parameters it does not know."""
    for key in body:
        if key not in allowed:
            raise APIError(400, f"Unknown parameter: '{key}'.", param=key, code="unknown_parameter")


def sampling_params(body: dict[str, Any], max_tokens_default: int, chat: bool) -> SamplingParams:
    """SamplingParams from a completions or chat body (their logprobs and max-token fields differ)."""
    if field(body, "best_of", int, 1) not in (1,):
        raise APIError(400, "best_of is not supported", param="best_of")
    for k in ("presence_penalty", "frequency_penalty"):
        if field(body, k, float, 0.0) != 0.0:
            raise APIError(400, f"{k} is not supported by this engine", param=k)
    if field(body, "echo", bool, False):
        raise APIError(400, "echo is not supported", param="echo")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, list) and all(isinstance(s, str) for s in _bounded(stop, MAX_STOP_STRINGS, "stop"))):
        raise APIError(400, "'stop' must be a string or a list of strings", param="stop")
    stop_ids = _bounded(field(body, "stop_token_ids", list, []), MAX_STOP_TOKEN_IDS, "stop_token_ids")
    if not all(is_token_id(t) for t in stop_ids):
        raise APIError(400, "'stop_token_ids' must be a list of integers", param="stop_token_ids")
    if chat:
        want = field(body, "logprobs", bool, False)
        top = field(body, "top_logprobs", int, 0 if want else None)
        if top is not None and not want:
            raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
        logprobs = top if want else None
        # max_completion_tokens wins when present; an `or` here read 0 as absent, so 0 ran to the end of the context
        max_tokens = field(body, "max_completion_tokens", int, None)
        if max_tokens is None:
            max_tokens = field(body, "max_tokens", int, None)
    else:
        logprobs = field(body, "logprobs", int, None)
        max_tokens = field(body, "max_tokens", int, None)
    return SamplingParams(
        max_tokens=max_tokens if max_tokens is not None else max_tokens_default,
        temperature=field(body, "temperature", float, 1.0),
        top_p=field(body, "top_p", float, 1.0),
        top_k=field(body, "top_k", int, 0),
        seed=field(body, "seed", int, None),
        stop=stop,
        stop_token_ids=stop_ids,
        ignore_eos=field(body, "ignore_eos", bool, False),
        logprobs=logprobs,
        skip_special_tokens=field(body, "skip_special_tokens", bool, True),
        include_stop_str_in_output=field(body, "include_stop_str_in_output", bool, False),
        logit_bias=logit_bias(body),
    )


def refuse_what_chat_cannot_honour(body: dict[str, Any]) -> None:
    """400 for chat fields this engine would otherwise drop: tools it cannot call (unless tool_choice is "none") and
    structured output it cannot enforce. Answering without them looked like success to a client that relied on them."""
    for key in ("tools", "functions"):
        if field(body, key, list, []) and body.get("tool_choice", body.get("function_call")) != "none":
            raise APIError(
                400, f"{key} are not supported by this engine (with tool_choice 'none' they are ignored)", param=key
            )
    kind = field(body, "response_format", dict, {}).get("type", "text")
    if kind != "text":
        raise APIError(
            400, f"response_format {kind!r} is not supported by this engine, only 'text'", param="response_format"
        )


def logit_bias(body: dict[str, Any]) -> dict[int, float]:
    """OpenAI's logit_bias: token ids (JSON object keys, so strings of digits) to numbers; the numbers' range is
    checked with the other sampling parameters, the ids against the vocabulary by the engine. A key must be ASCII
    digits, at most MAX_TOKEN_ID_DIGITS of them: str.isdigit() alone also takes digits such as '²' that int()
    refuses, and int() refuses strings past 4,300 digits, which made both a 500."""
    bias = {}
    for token, value in field(body, "logit_bias", dict, {}).items():
        if (
            not (token.isascii() and token.isdigit() and len(token) <= MAX_TOKEN_ID_DIGITS)
            or not isinstance(value, (int, float))
            or isinstance(value, bool)
        ):
            raise APIError(400, "'logit_bias' maps token ids to numbers", param="logit_bias")
        bias[int(token)] = float(value)
    return bias


async def read_body(request: Request, idle_timeout: float, timeout: float) -> bytes:
    """The body, bounded in bytes as it arrives (413), and in time between its chunks and in all (408): without
    these, one client could fill the engine's memory, or hold a connection and its buffer forever by sending a byte
    just inside each idle wait. A 408 closes the connection, where the rest of such a body would keep it open."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise _too_large()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout_at(min(loop.time() + idle_timeout, deadline)) as timer:  # moved on by each chunk
            async for chunk in request.stream():
                size += len(chunk)
                if size > MAX_BODY_BYTES:
                    raise _too_large()
                chunks.append(chunk)
                timer.reschedule(min(loop.time() + idle_timeout, deadline))
    except TimeoutError:
        message = (
            f"request body not complete within {timeout:g}s"
            if timer.when() == deadline
            else f"request body stalled for {idle_timeout:g}s"
        )
        raise APIError(408, message, code="body_timeout", headers={"connection": "close"}) from None
    return b"".join(chunks)


def _too_large() -> APIError:
    return APIError(413, f"request body exceeds the {MAX_BODY_BYTES}-byte limit", code="request_too_large")


async def json_object(request: Request, idle_timeout: float, timeout: float) -> dict[str, Any]:
    """The body (read within `read_body`'s bounds) as a JSON object. Strict JSON, as the gateway parses it: Python's
    json module would also take NaN and Infinity (a NaN temperature) and strings with lone surrogates (which the
    tokenizer cannot encode)."""
    try:
        body = orjson.loads(await read_body(request, idle_timeout, timeout))
    except orjson.JSONDecodeError:
        raise APIError(400, "request body must be valid JSON", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object", code="invalid_json")
    return body


@dataclass
class GenerationRequest:
    """A parsed completions or chat request: one (prompt ids, params) job per choice, in OpenAI's choice order."""

    jobs: list[tuple[list[int], SamplingParams]]
    n: int
    stream: bool
    include_usage: bool
    cache_salt: str | None


class RequestParser:
    """Parses bodies against one engine: its model name, tokenizer, chat template and limits."""

    def __init__(self, engine: LLMEngine, model_name: str):
        self.engine = engine
        self.renderer = engine.loaded.renderer
        self.model_name = model_name
        # A prompt text longer than this cannot fit the context window, so it is refused untokenized: tokenizing runs
        # on the event loop, and 30 MB of text held every other request for a minute only to be refused. Four times
        # the bound a token's bytes give, for normalizers that compose characters (fewer bytes than the input has).
        self.max_prompt_chars = 4 * engine.max_model_len * engine.tokenizer.max_token_bytes

    async def body(self, request: Request) -> dict[str, Any]:
        """The request's body as a JSON object, read within this engine's body timeouts."""
        config = self.engine.config
        return await json_object(request, config.body_idle_timeout, config.body_timeout)

    def check_model(self, body: dict[str, Any]) -> None:
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist.", "not_found_error", "model_not_found", "model")

    def chat_ids(self, body: dict[str, Any], max_chars: int | None = None) -> list[int]:
        try:
            return self.renderer.chat_ids(
                body.get("messages"),
                field(body, "add_generation_prompt", bool, True),
                field(body, "chat_template_kwargs", dict, {}),
                max_chars=max_chars,
            )
        except PromptError as e:
            raise APIError(400, str(e), param=e.param) from None

    def prompt_list(self, body: dict[str, Any], n: int) -> list[list[int]]:
        """A completions prompt: text, token ids, or a batch (list) of either; `n` choices each. The batch's size is
        checked before anything is tokenized, which runs on the event loop: a batch of millions of prompts held
        every other request until all were tokenized, only to be refused."""
        prompt = body.get("prompt")

        def one(p: Any) -> list[int]:
            if isinstance(p, str):
                if len(p) > self.max_prompt_chars:
                    raise APIError(400, prompt_too_long(len(p)), param="prompt", code="context_length_exceeded")
                return self.engine.tokenizer.encode(p)
            ids = token_ids(p, self.engine.max_model_len - 1, "prompt")  # leaving room for one generated token
            if ids is not None:
                return ids
            raise APIError(400, "'prompt' must be text, token ids, or a list of either", param="prompt")

        if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            check_choices(len(prompt), n)
            return [one(p) for p in prompt]
        return [one(prompt)]

    def tokenize_ids(self, body: dict[str, Any]) -> list[int]:
        """/tokenize: a chat (messages) or a plain text prompt."""
        self.check_model(body)
        if "messages" in body:
            return self.chat_ids(body)
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise APIError(400, "'prompt' must be a string", param="prompt")
        return self.engine.tokenizer.encode(prompt, add_bos=field(body, "add_special_tokens", bool, None))

    def detokenize(self, body: dict[str, Any]) -> str:
        """/detokenize: the text of the token ids, each in the vocabulary (special tokens kept), at most a context's
        worth: counted before they are walked, since a 32 MiB body of the longest token's id decoded to 450 MB."""
        tokens = body.get("tokens")
        ids = [] if tokens == [] else token_ids(tokens, self.engine.max_model_len, "tokens")
        vs = self.engine.tokenizer.vocab_size
        if ids is None or not all(0 <= t < vs for t in ids):
            raise APIError(400, "'tokens' must be a list of valid token ids", param="tokens")
        return self.engine.tokenizer.decode(ids, skip_special_tokens=False)

    def generation(self, body: dict[str, Any], chat: bool) -> GenerationRequest:
        jobs = self._jobs(body, chat)
        stream = field(body, "stream", bool, False)
        so = field(body, "stream_options", dict, {}) or {}
        include_usage = field(so, "include_usage", bool, False)  # bool() of it took "false" as true
        salt = field(body, "cache_salt", str, None)
        if salt is not None and len(salt) > MAX_CACHE_SALT_CHARS:
            raise APIError(400, f"'cache_salt' must be at most {MAX_CACHE_SALT_CHARS} characters", param="cache_salt")
        return GenerationRequest(jobs, field(body, "n", int, 1), stream, include_usage, salt)

    def room(self, ids: list[int]) -> int:
        """The most tokens a completion of `ids` can have: the rest of the context window (at least one)."""
        return max(self.engine.max_model_len - len(ids), 1)

    def check_job(self, ids: list[int], sp: SamplingParams, max_tokens_param: str | None) -> None:
        """400 unless the engine can serve `ids` with `sp`; when the client chose the completion's length (in
        `max_tokens_param`), prompt and completion must fit the context window together."""
        max_model_len = self.engine.max_model_len
        if max_tokens_param is not None and len(ids) + sp.max_tokens > max_model_len:
            raise APIError(
                400,
                f"This model's maximum context length is {max_model_len} tokens. "
                f"However, you requested {len(ids) + sp.max_tokens} tokens ({len(ids)} in the "
                f"prompt, {sp.max_tokens} for the completion).",
                param=max_tokens_param,
                code="context_length_exceeded",
            )
        try:
            self.engine.validate(ids, sp)
        except ValueError as e:
            raise APIError(400, str(e)) from e

    def _jobs(self, body: dict[str, Any], chat: bool) -> list[tuple[list[int], SamplingParams]]:
        """One (prompt ids, params) job per choice: prompts x n, in OpenAI's choice order."""
        self.check_model(body)
        if chat:
            refuse_what_chat_cannot_honour(body)
        n = field(body, "n", int, 1)
        if not 1 <= n <= MAX_N:
            raise APIError(400, f"n must be between 1 and {MAX_N}", param="n")
        prompts = [self.chat_ids(body, self.max_prompt_chars)] if chat else self.prompt_list(body, n)
        explicit_max = body.get("max_tokens") is not None or body.get("max_completion_tokens") is not None
        jobs = []
        for ids in prompts:
            sp = sampling_params(body, self.room(ids) if chat else 16, chat)
            self.check_job(ids, sp, "max_tokens" if explicit_max else None)
            for j in range(n):  # distinct seeds so seeded n>1 samples differ but stay reproducible
                jobs.append((ids, replace(sp, seed=sp.seed + j if sp.seed is not None else None)))
        return jobs
