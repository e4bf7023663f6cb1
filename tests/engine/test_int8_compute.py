"""`--compute int8`: the GGUF's quantized matrices multiplied by onnxruntime's MatMulNBits with int8 activations.

Not bit-exact with the float32 reference by design (activations are rounded to int8), so these tests bound the
difference: the real kernel on the real weights, then the whole engine against both shared references.
"""

import gguf
import numpy as np
import pytest

from backend_engine.config import EngineConfig, default_model_path
from backend_engine.engine import LLMEngine
from backend_engine.model import load_model
from backend_engine.model.int8_matmul import Int8Matmul
from backend_engine.model.quant_blocks import from_gguf
from backend_engine.sequence import SamplingParams

from .conftest import reference
from .test_reference import out_logprobs

CASES = reference()["cases"]


@pytest.fixture(scope="module")
def bundled_tensors():
    """The bundled model's first Q4_1 matrix (with per-block offsets) and its Q8_0 embedding / LM head."""
    reader = gguf.GGUFReader(default_model_path())
    wanted = {"blk.0.ffn_down.weight", "token_embd.weight"}
    return {t.name: t for t in reader.tensors if t.name in wanted}


@pytest.mark.parametrize("name,kind", [("blk.0.ffn_down.weight", "Q4_1"), ("token_embd.weight", "Q8_0")])
def test_blocks_decode_exactly_like_the_gguf_package(bundled_tensors, name, kind):
    t = bundled_tensors[name]
    assert t.tensor_type.name == kind
    rows, cols = int(t.shape[1]), int(t.shape[0])
    want = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32).reshape(rows, cols)
    np.testing.assert_array_equal(from_gguf(t.data, kind, rows, cols).dequantize(), want)


@pytest.mark.parametrize("name", ["blk.0.ffn_down.weight", "token_embd.weight"])
def test_int8_matmul_stays_within_int8_rounding_of_float32(bundled_tensors, name):
    t = bundled_tensors[name]
    blocks = from_gguf(t.data, t.tensor_type.name, int(t.shape[1]), int(t.shape[0]))
    x = np.random.default_rng(0).standard_normal((7, blocks.shape[1])).astype(np.float32)
    want = x @ blocks.dequantize().T
    got = Int8Matmul(blocks)(x)
    assert got.shape == want.shape and got.dtype == np.float32
    error = np.abs(got - want).max() / np.abs(want).max()
    assert 1e-5 < error < 2e-2  # int8 activations: close, and not secretly a float32 product


@pytest.fixture(scope="module")
def int8_engine(cpu_backend):
    loaded = load_model(default_model_path(), cpu_backend, compute="int8")
    return LLMEngine(
        EngineConfig(device="cpu", compute="int8", kv_cache_bytes=64 << 20), loaded=loaded, backend=cpu_backend
    )


def test_int8_weights_stay_quantized_in_memory(int8_engine, loaded):
    # 4-bit codes + scales vs float32; the float32 embedding rows for lookup remain in both
    assert int8_engine.model.weight_bytes() < 0.45 * loaded.model.weight_bytes()


def test_int8_engine_tracks_the_references(int8_engine):
    """llama.cpp runs these weights the same way; like it, top-1 must mostly agree with float32."""
    top1, early = 0, 0
    seqs = int8_engine.generate([c["prompt_ids"] for c in CASES], SamplingParams(max_tokens=8, temperature=0))
    for case, seq in zip(CASES, seqs):
        (lp,) = out_logprobs(int8_engine, case["prompt_ids"])
        ref = case["first_step_top5"]
        top1 += lp.top[0][0] == ref[0]["id"]
        for token, logprob in lp.top:
            match = next((r for r in ref if r["id"] == token), None)
            if match is not None:
                assert abs(logprob - match["logprob"]) < 0.5
        early += seq.output_token_ids[:4] == case["greedy_ids"][:4]
    assert top1 >= len(CASES) - 1 and early >= len(CASES) - 1


def test_int8_needs_cpu_and_a_gguf(cpu_backend, tmp_path):
    with pytest.raises(ValueError, match="int8"):
        load_model(str(tmp_path), cpu_backend, compute="int8")  # a (HF) folder: no quantized blocks to keep
