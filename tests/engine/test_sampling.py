"""Sampling over one row of logits: every temperature the request validation lets through must give a token."""

import math

import numpy as np
import pytest

from backend_engine.sampling import sample_token
from backend_engine.sequence import SamplingParams

LOGITS = np.random.default_rng(0).standard_normal(49152).astype(np.float32) * 4


@pytest.mark.parametrize("extra", [{}, {"top_k": 40}, {"top_p": 0.9}, {"top_k": 40, "top_p": 0.5}])
@pytest.mark.parametrize("temperature", [1e-310, 5e-324, 1e-30])
def test_a_tiny_temperature_is_the_greedy_choice(temperature, extra):
    """logits / 1e-310 overflowed to inf, and inf - inf made every probability NaN: the step raised."""
    params = SamplingParams(temperature=temperature, **extra)
    params.validate(max_logprobs=20)
    rng = np.random.default_rng(1)
    assert {sample_token(LOGITS, params, rng) for _ in range(5)} == {int(np.argmax(LOGITS))}


def test_a_huge_temperature_samples_every_token_alike():
    params = SamplingParams(temperature=1e300)
    rng = np.random.default_rng(2)
    picks = {sample_token(LOGITS, params, rng) for _ in range(200)}
    assert len(picks) > 190  # near-uniform over 49k tokens: almost never the same token twice


@pytest.mark.parametrize("temperature", [math.nan, math.inf, -math.inf, -0.5])
def test_a_temperature_that_is_not_a_non_negative_number_is_refused(temperature):
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=temperature).validate(max_logprobs=20)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_logit_bias_bans_and_forces_tokens(temperature):
    top = int(np.argmax(LOGITS))
    rng = np.random.default_rng(3)
    banned = SamplingParams(temperature=temperature, top_k=1 if temperature else 0, logit_bias={top: -100})
    assert {sample_token(LOGITS, banned, rng) for _ in range(20)} == {int(np.argsort(-LOGITS)[1])}
    forced = SamplingParams(temperature=temperature, logit_bias={7: 100})
    assert {sample_token(LOGITS, forced, rng) for _ in range(20)} == {7}
    assert LOGITS[7] < LOGITS[top]  # the row itself is untouched: log-probs come from the model's own


@pytest.mark.parametrize("bias", [{5: 101.0}, {5: math.nan}, {i: 1.0 for i in range(1025)}])
def test_a_logit_bias_out_of_range_is_refused(bias):
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=bias).validate(max_logprobs=20)
