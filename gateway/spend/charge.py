"""What a finished request is charged: its tokens, reconciled the same way for token limits, budgets and billing,
and their cost from the policy's price table."""

from __future__ import annotations

from typing import NamedTuple

from gateway.apis.answers import token_count
from gateway.context import RequestContext
from gateway.policy.model import PriceTable


class Charge(NamedTuple):
    prompt: int
    cached: int  # of the prompt tokens, served from a prefix cache
    completion: int
    cost_nanos: int
    # completion tokens the upstream reported beyond the request's output budget (max_tokens x n), which its
    # reservation did not hold: charged all the same, and flagged
    over_reservation: int
    cache_hit: bool = False  # answered from the response cache: its tokens priced at the `cached` price


def charge(ctx: RequestContext, prices: PriceTable) -> Charge:
    """What the ended request is charged at `prices`: worked out once, for its budgets' settlement and its bill."""
    known = ctx.charged
    if known is not None and known[0] is prices:
        return known[1]
    prompt, completion = charged_tokens(ctx)
    reported = ctx.usage.cached_tokens
    cached = min(reported, prompt) if isinstance(reported, int) and reported > 0 else 0
    over = completion - ctx.max_tokens if ctx.max_tokens is not None and completion > ctx.max_tokens else 0
    if ctx.served_from_cache:
        charged = Charge(prompt, 0, completion, prices.cache_hit_nanos(ctx.model, prompt + completion), 0, True)
    else:
        charged = Charge(prompt, cached, completion, prices.cost_nanos(ctx.model, prompt, cached, completion), over)
    ctx.charged = prices, charged
    return charged


def charged_tokens(ctx: RequestContext) -> tuple[int, int]:
    """Prompt and completion tokens a finished request is charged.

    What the upstream reports is charged exactly, each part on its own. A part it did not report is inferred:
    - the upstream never accepted the request (it answered an error status such as 502/503/504, could not be
      reached, timed out before answering, or a later stage refused the request): nothing. An upstream that failed
      a request has not served its prompt (OpenAI and vLLM bill nothing for an error), and a client must not pay
      for the upstream's failure; the slot and the request rate still bound how often it can try;
    - the upstream accepted it (200) and so read the prompt, or the response cache answered it: the prompt as
      counted by the tokenize stage. The
      completion costs nothing when no output reached the gateway (the stream ended or broke, or the client left,
      before any token); once output was seen, an unreported completion keeps its whole reservation, since how
      much more the upstream generated is unknown and a client must not skip the bill by hanging up.
    """
    usage = ctx.usage
    accepted = (ctx.replica is not None or ctx.served_from_cache) and ctx.status == 200
    prompt, completion = token_count(usage.prompt_tokens), token_count(usage.completion_tokens)
    if prompt is None:
        prompt = (ctx.prompt_tokens or 0) if accepted else 0
    if completion is None:
        completion = (ctx.max_tokens or 0) if accepted and usage.generated else 0
    return prompt, completion
