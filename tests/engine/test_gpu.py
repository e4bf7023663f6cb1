"""The CuPy (CUDA, float16 weights) path: the same checks as on CPU, skipped without a GPU."""

import pytest

from backend_engine.backend import cuda_available
from backend_engine.sequence import SamplingParams

from .conftest import reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA GPU")]
CASES = reference()["cases"]


@pytest.fixture(scope="module")
def gpu_engine():
    from backend_engine.config import EngineConfig
    from backend_engine.engine import LLMEngine

    return LLMEngine(EngineConfig(device="cuda", kv_cache_bytes=256 << 20))


def test_gpu_first_step_top5(gpu_engine):
    # float16 weights: same top-5 ranking, log-probs within a looser 3e-2.
    for c in CASES:
        seq = gpu_engine.add_request(
            f"g{len(c['prompt_ids'])}", c["prompt_ids"], SamplingParams(max_tokens=1, temperature=0, logprobs=5)
        )
        lps = []
        while not seq.is_finished:
            for o in gpu_engine.step():
                lps.extend(o.logprobs)
        top = lps[0].top
        assert top[0][0] == c["first_step_top5"][0]["id"]
        for (tid, lp), ref in zip(top, c["first_step_top5"]):
            assert abs(lp - ref["logprob"]) < 3e-2 or tid != ref["id"]


def test_gpu_alone_equals_inside_batch(gpu_engine):
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    target = CASES[4]["prompt_ids"]
    alone = gpu_engine.generate([target], sp)[0].output_token_ids
    others = [c["prompt_ids"] for c in CASES[:4]] + [c["prompt_ids"] for c in CASES[5:]]
    batch = gpu_engine.generate(others + [target], sp)
    assert batch[-1].output_token_ids == alone


def test_gpu_prefix_cache_and_preemption(gpu_engine):
    from backend_engine.config import EngineConfig
    from backend_engine.engine import LLMEngine

    prefix = list(range(3000, 3200))
    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    cold = gpu_engine.generate([prefix + [5]], sp)[0]
    warm = gpu_engine.generate([prefix + [5]], sp)[0]
    assert warm.num_cached_tokens == 192 and warm.output_token_ids == cold.output_token_ids
    tiny = LLMEngine(
        EngineConfig(device="cuda", kv_cache_bytes=gpu_engine.model.kv_bytes_per_token() * 16 * 12),
        loaded=gpu_engine.loaded,
        backend=gpu_engine.backend,
    )
    prompts = [c["prompt_ids"] for c in CASES[:6]]
    want = [s.output_token_ids for s in gpu_engine.generate(prompts, sp)]
    assert [s.output_token_ids for s in tiny.generate(prompts, sp)] == want
    assert tiny.scheduler.num_preemptions > 0
