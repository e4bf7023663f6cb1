"""OpenAI response bodies and SSE chunks from the engine's outputs, for completions and chat.

Usage counts prompt tokens once per prompt (not per choice) and completion tokens over all choices.
A stream that breaks ends with an SSE error event and then `data: [DONE]`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any

import orjson

from backend_engine.async_engine import ChoiceOutputs
from backend_engine.engine import RequestOutput
from backend_engine.http.openai_protocol.errors import APIError
from backend_engine.http.streaming import outputs_or_error, per_choice
from backend_engine.model.tokenizer import Tokenizer
from backend_engine.sequence import TokenLogprob


def usage(lasts: list[RequestOutput | None], n: int) -> dict[str, Any]:
    """Prompt tokens once per prompt (not per n), completion tokens summed over choices."""
    firsts = [o for k, o in enumerate(lasts) if k % n == 0 and o is not None]
    prompt = sum(o.num_prompt_tokens for o in firsts)
    completion = sum(o.num_output_tokens for o in lasts if o is not None)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in firsts)},
    }


class ResponseShaper:
    """Builds the bodies one model's responses share: its name, and its tokenizer for logprob token text."""

    def __init__(self, model_name: str, tokenizer: Tokenizer):
        self.model_name = model_name
        self.tokenizer = tokenizer

    def completion_logprobs(self, lps: list[TokenLogprob], offset0: int) -> dict[str, Any]:
        tok = self.tokenizer
        tokens, token_lps, tops, offsets = [], [], [], []
        off = offset0
        for lp in lps:
            t = tok.token_text(lp.token_id)
            tokens.append(t)
            token_lps.append(lp.logprob)
            top: dict[str, float] = {}
            for i, v in lp.top:
                top.setdefault(tok.token_text(i), v)
            tops.append(top)
            offsets.append(off)
            off += len(t)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def chat_logprobs(self, lps: list[TokenLogprob]) -> dict[str, Any]:
        tok = self.tokenizer

        def entry(i: int, v: float) -> dict[str, Any]:
            return {"token": tok.token_text(i), "logprob": v, "bytes": list(tok.token_bytes[i])}

        return {
            "content": [
                {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(i, v) for i, v in lp.top]} for lp in lps
            ]
        }

    def final_body(self, per: list[list[RequestOutput]], n: int, rid: str, chat: bool) -> dict[str, Any]:
        """The non-streaming response: each choice's text and logprobs joined from its outputs."""
        choices = []
        for idx, outs in enumerate(per):
            last = outs[-1]
            text = "".join(o.new_text for o in outs)
            lps = [lp for o in outs for lp in o.logprobs]
            if chat:
                choices.append(
                    {
                        "index": idx,
                        "message": {"role": "assistant", "content": text},
                        "logprobs": self.chat_logprobs(lps) if lps else None,
                        "finish_reason": last.finish_reason,
                        "stop_reason": last.stop_reason,
                    }
                )
            else:
                choices.append(
                    {
                        "index": idx,
                        "text": text,
                        "logprobs": self.completion_logprobs(lps, 0) if lps else None,
                        "finish_reason": last.finish_reason,
                        "stop_reason": last.stop_reason,
                    }
                )
        return {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": usage([o[-1] for o in per], n),
        }

    async def sse(
        self,
        outputs: AsyncGenerator[ChoiceOutputs, None],
        num_choices: int,
        n: int,
        rid: str,
        chat: bool,
        include_usage: bool,
    ) -> AsyncIterator[bytes]:
        """The streaming response: one write per engine step of every chunk the step makes, one chunk per choice
        that got text, logprobs or a finish (a choice's steps joined into one when the reader fell behind), a chat's
        role chunks first, the usage chunk last when asked for, then `data: [DONE]`."""
        obj = "chat.completion.chunk" if chat else "text_completion"
        envelope: dict[str, Any] = {"id": rid, "object": obj, "created": int(time.time()), "model": self.model_name}
        # A chunk is head + its choices + tail: only the choices are serialised per chunk.
        head = b"data: " + orjson.dumps(envelope)[:-1] + b',"choices":['
        tail = b'],"usage":null}\n\n' if include_usage else b"]}\n\n"
        lasts: list[RequestOutput | None] = [None] * num_choices
        text_off = [0] * num_choices
        if chat:
            role = {"role": "assistant", "content": ""}
            yield b"".join(
                head + orjson.dumps({"index": i, "delta": role, "logprobs": None, "finish_reason": None}) + tail
                for i in range(num_choices)
            )
        failed = False
        async with aclosing(outputs_or_error(outputs, rid)) as batches:
            async for batch in batches:
                if isinstance(batch, APIError):
                    yield b"data: " + orjson.dumps(batch.body()) + b"\n\n"
                    failed = True
                    break
                chunks = []
                for idx, o in per_choice(batch):
                    lasts[idx] = o
                    if o.new_text or o.finished or o.logprobs:
                        chunks.append(head + orjson.dumps(self._chunk_choice(idx, o, text_off[idx], chat)) + tail)
                        text_off[idx] += len(o.new_text)
                if chunks:
                    yield b"".join(chunks)
        end = b""
        if include_usage and not failed:
            end = b"data: " + orjson.dumps(envelope | {"choices": [], "usage": usage(lasts, n)}) + b"\n\n"
        yield end + b"data: [DONE]\n\n"

    def _chunk_choice(self, idx: int, o: RequestOutput, text_offset: int, chat: bool) -> dict[str, Any]:
        """One choice's delta in a chunk; a finished choice also carries its stop reason."""
        fin = o.finish_reason if o.finished else None
        choice: dict[str, Any]
        if chat:
            choice = {
                "index": idx,
                "delta": {"content": o.new_text} if o.new_text else {},
                "logprobs": self.chat_logprobs(o.logprobs) if o.logprobs else None,
                "finish_reason": fin,
            }
        else:
            choice = {
                "index": idx,
                "text": o.new_text,
                "logprobs": self.completion_logprobs(o.logprobs, text_offset) if o.logprobs else None,
                "finish_reason": fin,
            }
        if fin is not None:
            choice["stop_reason"] = o.stop_reason
        return choice
