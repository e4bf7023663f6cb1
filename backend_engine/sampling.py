"""Pick the next token from one row of logits, per request's SamplingParams.

Log-probs are of the model's raw distribution (before logit_bias / temperature / top-k / top-p), as vLLM
reports them by default. Top-p sorts only a top-256 candidate set unless that set holds less than
top_p of the mass, so a 49k vocabulary is not fully sorted every token.
"""

from __future__ import annotations

import numpy as np

from backend_engine.sequence import SamplingParams, TokenLogprob

_CANDIDATES = 256


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float32) - logits.max()
    return x - np.log(np.exp(x).sum(dtype=np.float64)).astype(np.float32)


def _top_ids(x: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest values, best first."""
    k = min(k, x.shape[-1])
    part = np.argpartition(-x, k - 1)[:k]
    return part[np.argsort(-x[part], kind="stable")]


def sample_token(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    x = logits
    if params.logit_bias:
        x = logits.astype(np.float64)  # a copy: the raw row still gives the log-probs
        ids = np.fromiter(params.logit_bias.keys(), np.int64, len(params.logit_bias))
        x[ids] += np.fromiter(params.logit_bias.values(), np.float64, len(params.logit_bias))
    if params.greedy:
        return int(np.argmax(x))
    # shifted before the division: a tiny temperature then sends every other logit to -inf (probability 0) instead of
    # overflowing the largest to inf, whose inf - inf made every probability NaN
    x = x.astype(np.float64, copy=False)
    x = (x - x.max()) / params.temperature
    k = params.top_k if params.top_k and params.top_k > 0 else 0
    if k or params.top_p < 1.0:
        cand = _top_ids(x, k or _CANDIDATES)
        p = np.exp(x[cand] - x[cand[0]])
        if params.top_p < 1.0:
            mass = p.sum() / np.exp(x - x[cand[0]]).sum()
            if not k and mass < params.top_p:  # candidate set too small to decide: sort everything
                cand = np.argsort(-x, kind="stable")
                p = np.exp(x[cand] - x[cand[0]])
            cum = np.cumsum(p) / (np.exp(x - x[cand[0]]).sum() if not k else p.sum())
            keep = int(np.searchsorted(cum, params.top_p, side="left")) + 1
            cand, p = cand[:keep], p[:keep]
        p /= p.sum()
        return int(cand[rng.choice(len(cand), p=p)])
    p = np.exp(x - x.max())
    p /= p.sum()
    return int(rng.choice(len(p), p=p))


def token_logprob(logits: np.ndarray, token_id: int, k: int) -> TokenLogprob:
    lp = log_softmax(logits)
    top = [(int(i), float(lp[i])) for i in _top_ids(lp, k)] if k > 0 else []
    return TokenLogprob(token_id, float(lp[token_id]), top)
