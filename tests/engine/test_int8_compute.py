"""`--compute int8`: the GGUF's quantized matrices multiplied by onnxruntime's MatMulNBits with int8 activations.

Not bit-exact with the float32 reference by design (activations are rounded to int8), so these tests bound the
difference: the real kernel on the real weights, then the whole engine against the float32 engine along the
reference answers (int8_drift.py), within bounds that hold on every kernel path onnxruntime picks by CPU.
"""

import gguf
import numpy as np
import pytest

import backend_engine.model
from backend_engine.config import EngineConfig, default_model_path
from backend_engine.engine import LLMEngine
from backend_engine.model import load_model
from backend_engine.model.gguf import open_gguf
from backend_engine.model.int8_decode_step import BATCHED_ROWS
from backend_engine.model.int8_matmul import Int8Matmul
from backend_engine.model.int8_rows import row_kernel_available
from backend_engine.model.llama import ForwardBatch, PrefillSpan
from backend_engine.model.quant_blocks import from_gguf, requantized

from . import int8_drift


@pytest.fixture(scope="module")
def bundled_tensors():
    """The bundled model's first Q4_1 matrix (with per-block offsets) and its Q8_0 embedding / LM head."""
    reader = open_gguf(default_model_path())
    wanted = {"blk.0.ffn_down.weight", "token_embd.weight"}
    return {t.name: t for t in reader.tensors if t.name in wanted}


@pytest.mark.parametrize("name,kind", [("blk.0.ffn_down.weight", "Q4_1"), ("token_embd.weight", "Q8_0")])
def test_blocks_decode_exactly_like_the_gguf_package(bundled_tensors, name, kind):
    t = bundled_tensors[name]
    assert t.tensor_type.name == kind
    rows, cols = int(t.shape[1]), int(t.shape[0])
    want = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32).reshape(rows, cols)
    np.testing.assert_array_equal(from_gguf(t.data, kind, rows, cols).dequantize(), want)


@pytest.mark.parametrize("name", ["blk.0.ffn_down.weight", "token_embd.weight", "blk.0.ffn_down.weight, 8-bit"])
def test_int8_matmul_stays_within_int8_rounding_of_float32(bundled_tensors, name):
    t = bundled_tensors[name.split(",")[0]]
    blocks = from_gguf(t.data, t.tensor_type.name, int(t.shape[1]), int(t.shape[0]))
    if name.endswith("8-bit"):
        blocks = requantized(blocks, 128)
    x = np.random.default_rng(0).standard_normal((7, blocks.shape[1])).astype(np.float32)
    want = x @ blocks.dequantize().T
    got = Int8Matmul(blocks)(x)
    assert got.shape == want.shape and got.dtype == np.float32
    error = np.abs(got - want).max() / np.abs(want).max()
    assert 1e-5 < error < 2e-2  # int8 activations: close, and not secretly a float32 product


def test_requantized_blocks_fold_q4_1_offsets_into_8_bit_codes(bundled_tensors):
    t = bundled_tensors["blk.0.ffn_down.weight"]
    blocks = from_gguf(t.data, "Q4_1", int(t.shape[1]), int(t.shape[0]))
    wide = requantized(blocks, 128)
    assert (wide.bits, wide.block, wide.offset, wide.scale.shape) == (
        8,
        128,
        None,
        (blocks.shape[0], blocks.shape[1] // 128),
    )
    want = blocks.dequantize().reshape(blocks.shape[0], -1, 128)
    error = np.abs(wide.dequantize().reshape(want.shape) - want).max(axis=-1)
    assert np.all(error <= np.abs(want).max(axis=-1) / 254 * 1.0001)  # half an 8-bit step of each block of 128


def _int8_engine(cpu_backend):
    loaded = load_model(default_model_path(), cpu_backend, compute="int8")
    return LLMEngine(
        EngineConfig(device="cpu", compute="int8", kv_cache_bytes=64 << 20), loaded=loaded, backend=cpu_backend
    )


@pytest.fixture(scope="module")
def int8_engine(cpu_backend):
    """The int8 engine as this CPU gets it: most matrices as smoothed int8 rows where it has VNNI, else blocks."""
    return _int8_engine(cpu_backend)


@pytest.fixture(scope="module")
def int8_blocks_engine(cpu_backend):
    """The int8 engine with every matrix in its blocks, as a CPU without VNNI gets it, on any CPU."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(backend_engine.model, "row_kernel_available", lambda: False)
        return _int8_engine(cpu_backend)


def test_int8_weights_stay_quantized_in_memory(int8_engine, loaded):
    # the matrices as 4- and 8-bit blocks with their scales (or, where the CPU has VNNI, most of them as int8 rows)
    # against float32 (the float32 embedding rows for lookup are in both): twice over, once in the layer graphs and
    # the LM head of prompt steps, once in the decode step's (with VNNI, there twice: as int8 rows for batched steps
    # and as 8-bit blocks for steps of few rows, 0.53 of float32's matrices against 0.25 in ggml's blocks alone)
    int8, float32 = int8_engine.model, loaded.model
    matrices = float32.weight_bytes() - float32.w.embed.nbytes
    assert int8.w.int8_decode is not None and int8.w.int8_decode.nbytes < 0.55 * matrices
    assert int8.weight_bytes() - int8.w.embed.nbytes < 0.81 * matrices


def _decode_logits(model, prompt: np.ndarray, copies: int) -> np.ndarray:
    """The logits of one decode step after `prompt`, the same row `copies` times in the step."""
    bs, table = 16, np.arange(-(-(len(prompt) + 1) // 16))
    cache = model.allocate_kv_cache(len(table), bs)
    n = len(prompt)
    prefill = ForwardBatch(
        input_ids=prompt,
        positions=np.arange(n),
        slot_mapping=np.arange(n),
        num_decodes=0,
        decode_block_tables=np.zeros((0, 1), np.int64),
        decode_context_lens=np.zeros(0, np.int64),
        prefills=[PrefillSpan(0, n, n, table)],
        logits_indices=np.array([n - 1]),
    )
    token = int(np.asarray(model.forward(prefill, cache)).argmax())
    step = ForwardBatch(
        input_ids=np.full(copies, token),
        positions=np.full(copies, n),
        slot_mapping=np.full(copies, n),
        num_decodes=copies,
        decode_block_tables=np.stack([table] * copies),
        decode_context_lens=np.full(copies, n + 1),
        logits_indices=np.arange(copies),
    )
    return np.asarray(model.forward(step, cache))


@pytest.mark.parametrize("path", ["this CPU's", "blocks"])
def test_few_row_and_batched_decode_steps_read_their_own_weights(request, path):
    """Where the CPU has VNNI, a decode step of `BATCHED_ROWS` rows or more multiplies smoothed int8 rows and a
    smaller one 8-bit blocks (int8_decode_step.py): the same row's logits then differ by int8 rounding alone. A step
    within one set of weights gives a row the same logits whatever the step's size, and copies of a row alike."""
    engine = request.getfixturevalue("int8_engine" if path == "this CPU's" else "int8_blocks_engine")
    model = engine.model
    prompt = np.asarray(engine.tokenizer.encode("The three largest cities of Canada are"), np.int64)
    alone = _decode_logits(model, prompt, 1)[0]
    scale = np.abs(alone).max()
    for copies in (BATCHED_ROWS - 1, BATCHED_ROWS):
        step = _decode_logits(model, prompt, copies)
        np.testing.assert_allclose(step, np.broadcast_to(step[0], step.shape), rtol=0, atol=1e-5 * scale)
        assert step[0].argmax() == alone.argmax()
        error = float(np.abs(step[0] - alone).max() / scale)
        if copies >= BATCHED_ROWS and path == "this CPU's" and row_kernel_available():
            assert 1e-3 < error < 0.15, error  # two sets of weights (0.066)
        else:
            assert error < 1e-3, error  # the same weights (0 here)


@pytest.fixture(scope="module")
def float32_logprobs(engine):
    return int8_drift.next_token_logprobs(engine, int8_drift.reference_prompts())


@pytest.mark.parametrize("steps", ["prompt", "decode", "decode, one row"])
@pytest.mark.parametrize("path", ["this CPU's", "blocks"])
def test_int8_engine_tracks_float32_on_every_kernel_path(request, path, steps, float32_logprobs):
    """onnxruntime picks its int8 kernel by CPU, and a near-tie's greedy choice moves with it (llama.cpp, on the same
    weights, answers the system-prompt case "L'Étoile, …" where float32 says "The capital of France is Paris.").
    So int8 is held to float32 where both read the same text, within bounds chosen from the figures measured on
    onnxruntime's AVX2 and AVX-512 VNNI paths (docs/benchmarks.md, int8 drift): about twice the worse path's. The
    blocks are measured on every CPU, the smoothed rows (`int8_rows.py`) on those with VNNI; each as prompt steps
    read the text and as decode steps do (a step of decode rows alone is a graph of its own, whose weights depend on
    its rows: all the reference cases in one step, and one row a step)."""
    int8 = request.getfixturevalue("int8_engine" if path == "this CPU's" else "int8_blocks_engine")
    if steps.startswith("decode"):
        got = int8_drift.decoded_logprobs(int8, together=steps == "decode")
    else:
        got = int8_drift.next_token_logprobs(int8, int8_drift.reference_prompts())
    drift = int8_drift.compare(float32_logprobs, got)
    # measured by prompt steps in blocks on AVX-512 VNNI: 0.69; on AVX2: 0.99; as smoothed rows (w_down in 8-bit
    # blocks) on AVX-512 VNNI: 1.28; by decode steps in blocks there: 0.58; as rows, with the LM head as rows: 0.80;
    # one row a step, in 8-bit blocks: 0.77
    assert drift.max_logprob_error < 2.0, drift
    assert drift.p95_logprob_error < 0.8, drift  # 0.40; 0.37; 0.59; 0.41; 0.57; 0.53
    assert drift.top1_agreement >= 0.93, drift  # 0.970; 0.974; 0.974; 0.961; 0.974; 0.970
    # Where float32 is sure of its next token, int8 never picks another: its answers stay float32's.
    assert drift.largest_lead_overturned < 1.0, drift  # 0.22; 0.26; 0.12; 0.21; 0.18; 0.26
    # ...and it is no float32 engine in disguise: int8 rounding shows.
    assert drift.max_logprob_error > 1e-3, drift


def test_int8_needs_cpu_and_a_gguf(cpu_backend, tmp_path):
    with pytest.raises(ValueError, match="int8"):
        load_model(str(tmp_path), cpu_backend, compute="int8")  # a (HF) folder: no quantized blocks to keep
