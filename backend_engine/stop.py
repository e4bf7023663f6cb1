"""Stop conditions: after a token is appended, whether its sequence is done, and why.

The precedence is OpenAI's and vLLM's: end-of-sequence, then a stop token id, then a stop string in
the detokenized text, then the length limits. A stop string cuts the text where it starts (or where it
ends, with include_stop_str_in_output); until a sequence stops, the last characters that could still
begin a stop string are held back from the client.
"""

from __future__ import annotations

from collections.abc import Collection

from backend_engine.sequence import SamplingParams, Sequence


def find_stop_string(text: str, new_from: int, stops: list[str]) -> tuple[int, str] | None:
    """The earliest stop string that ends at or after `new_from`: (its index in text, the string)."""
    best: tuple[int, str] | None = None
    for s in stops:
        if not s:
            continue
        i = text.find(s, max(0, new_from - len(s) + 1))
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return best


def apply_stop_conditions(seq: Sequence, token: int, eos_ids: Collection[int], max_model_len: int) -> str | None:
    """The finish reason ("stop" or "length") once `token` is appended to seq, or None to go on.

    Detokenizes the token into seq.output_text unless it is an end-of-sequence or stop token id,
    trims a matched stop string, sets seq.stop_reason, and flushes the detokenizer when finishing
    (a dangling partial character becomes U+FFFD)."""
    p = seq.params
    reason: str | None = None
    if token in eos_ids and not p.ignore_eos:
        reason, seq.stop_reason = "stop", None
    elif token in p.stop_token_ids:
        reason, seq.stop_reason = "stop", token
    else:
        before = len(seq.output_text)
        seq.output_text += seq.detokenizer.push(token)
        if p.stop:
            hit = find_stop_string(seq.output_text, before, p.stop)
            if hit is not None:
                idx, s = hit
                seq.output_text = seq.output_text[: idx + (len(s) if p.include_stop_str_in_output else 0)]
                reason, seq.stop_reason = "stop", s
    if reason is None and (seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= max_model_len):
        reason = "length"
    if reason is not None and not isinstance(seq.stop_reason, str):
        seq.output_text += seq.detokenizer.flush()
    return reason


def held_back_chars(params: SamplingParams) -> int:
    """Characters withheld from a running stream: enough to hide any stop string's unfinished start. Empty stop
    strings match nothing (find_stop_string skips them) and hide nothing: counted, they made this -1, and every
    token's text lost its first character."""
    return max((len(s) - 1 for s in params.stop if s), default=0)
