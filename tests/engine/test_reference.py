"""The bundled model against the float32 reference (../shared/fixtures, copied into fixtures/)."""

import numpy as np
import pytest

from backend_engine.sampling import log_softmax
from backend_engine.sequence import SamplingParams

from .conftest import reference

CASES = reference()["cases"]


@pytest.fixture(scope="module")
def greedy_run(engine):
    """All eight prompts in one continuous batch, first-step logprobs (top 5) recorded."""
    sp = SamplingParams(max_tokens=32, temperature=0, logprobs=5)
    seqs = engine.generate([c["prompt_ids"] for c in CASES], sp)
    return seqs


def test_tokenizer_matches_reference_ids(loaded):
    for c in CASES:
        assert loaded.tokenizer.encode(c["prompt"]) == c["prompt_ids"], c["prompt"]


@pytest.mark.parametrize("i", range(len(CASES)))
def test_first_step_top5(greedy_run, engine, i):
    c = CASES[i]
    # Recompute the first step's logits directly to read the exact log-probs.
    seq = greedy_run[i]
    assert seq.prompt_token_ids == c["prompt_ids"]
    ref = c["first_step_top5"]
    ids = [r["id"] for r in ref]
    (lp,) = out_logprobs(engine, c["prompt_ids"])
    assert [t for t, _ in lp.top] == ids
    for (_, got), r in zip(lp.top, ref):
        assert abs(got - r["logprob"]) < 1e-3
    assert lp.token_id == ids[0] and abs(lp.logprob - ref[0]["logprob"]) < 1e-3


def out_logprobs(engine, prompt):
    """Logprobs of the first generated token through the engine's own path."""
    outs = []
    seq = engine.add_request(
        f"lp-{len(prompt)}-{id(outs)}", prompt, SamplingParams(max_tokens=1, temperature=0, logprobs=5)
    )
    while not seq.is_finished:
        for o in engine.step():
            if o.request_id == seq.request_id:
                outs.extend(o.logprobs)
    return outs


@pytest.mark.parametrize("i", range(len(CASES)))
def test_greedy_continuation(greedy_run, i):
    c = CASES[i]
    got = greedy_run[i].output_token_ids
    assert got[: len(c["greedy_ids"])] == c["greedy_ids"]


def test_loose_agreement_with_llamacpp(greedy_run):
    """llama.cpp runs the quantized weights with int8 activations: top-1 should mostly agree."""
    cpp = reference("smollm2_llamacpp_reference.json")["cases"]
    agree = sum(s.output_token_ids[0] == c["greedy_ids"][0] for s, c in zip(greedy_run, cpp))
    assert agree >= len(cpp) - 1


def test_log_softmax_is_normalised():
    x = np.random.default_rng(0).standard_normal(1000).astype(np.float32) * 10
    assert abs(np.exp(log_softmax(x).astype(np.float64)).sum() - 1) < 1e-5
