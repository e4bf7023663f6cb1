"""How far `--compute int8` strays from float32, read along the reference answers (teacher-forced).

onnxruntime picks its int8 kernel by CPU (AVX2, AVX-512, AVX-512 VNNI, AMX), and while each computes the same
integer products, float sums in another order move a near-tie's greedy choice, after which two answers share
nothing. So the int8 engine is compared with float32 where both read the same text: at every position of the
float32 reference's greedy answers, the next-token log-probabilities of both engines, int8's read by prompt steps
and by decode steps, all cases in one step and one row a step (a decode step of decode rows alone runs graphs of its
own, whose weights depend on its rows). The bounds the tests assert (test_int8_compute.py) were chosen from this
module's figures on two kernel paths, AVX-512 VNNI and AVX2 (docs/benchmarks.md, "int8 drift"), and this is the way
to measure another path without its CPU:

    .venv/bin/python -m tests.engine.int8_drift           # this CPU's kernel path
    NPY_DISABLE_CPU_FEATURES=X86_V3 qemu-x86_64 -cpu Haswell .venv/bin/python -m tests.engine.int8_drift

The second runs onnxruntime's AVX2 kernels on any x86 machine (Debian's qemu-user, about an hour): MLAS picks its
kernels from what cpuid reports, and qemu reports a Haswell. numpy's own AVX2 loops must stay off there: QEMU 7.2
emulates the ones behind np.argpartition wrongly (110 of 200 top-20 lists wrong on random vectors), which showed as
a true top-1 token missing from the listed log-probabilities.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from backend_engine.engine import LLMEngine
from backend_engine.model.llama import ForwardBatch, PrefillSpan
from backend_engine.sampling import token_logprob
from backend_engine.sequence import SamplingParams

from .conftest import reference

TOP = 5  # the float32 alternatives whose log-probabilities are compared
LISTED = 20  # alternatives each engine lists (the most it may): a compared token missing from int8's counts as drift


@dataclass
class Drift:
    positions: int
    top1_agreement: float  # share of positions where int8's most likely token is float32's
    largest_lead_overturned: float  # float32's lead (nats, first over second token) where int8 chose another
    max_logprob_error: float  # over float32's top tokens at every position
    p95_logprob_error: float


def next_token_logprobs(engine: LLMEngine, prompts: list[list[int]]) -> list[dict[int, float]]:
    """For each prompt, the top LISTED next tokens and their log-probabilities, all prompts in one batch."""
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=LISTED)
    seqs = {f"drift-{i}": engine.add_request(f"drift-{i}", p, params) for i, p in enumerate(prompts)}
    found: dict[str, dict[int, float]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id in seqs and out.logprobs:
                found[out.request_id] = dict(out.logprobs[0].top)
    return [found[f"drift-{i}"] for i in range(len(prompts))]


def reference_prompts() -> list[list[int]]:
    """Every position of the float32 reference's greedy answers, as the tokens before it (teacher-forced)."""
    return [c["prompt_ids"] + c["greedy_ids"][:k] for c in reference()["cases"] for k in range(len(c["greedy_ids"]))]


def decoded_logprobs(engine: LLMEngine, together: bool = True) -> list[dict[int, float]]:
    """`reference_prompts`' positions as decoding reaches them: each case's prompt in one prompt step, then its
    reference answer fed back a token a step, every case a row of the same decode step (or, not `together`, each
    case in steps of its own: one row a step). Prompt steps and decode steps run different graphs under int8 (a
    decode step of decode rows alone is `int8_decode_step.py`'s one graph, whose weights depend on its rows), and
    every generated token after an answer's first comes from the decode path."""
    if not together:
        return [listed for case in reference()["cases"] for listed in _decoded(engine, [case])]
    return _decoded(engine, reference()["cases"])


def _decoded(engine: LLMEngine, cases: list[dict]) -> list[dict[int, float]]:
    model, bs = engine.model, 16
    prompts = [np.asarray(c["prompt_ids"], np.int64) for c in cases]
    per_case = max(-(-(len(p) + len(c["greedy_ids"])) // bs) for p, c in zip(prompts, cases))
    tables = [np.arange(i * per_case, (i + 1) * per_case) for i in range(len(cases))]
    cache = model.allocate_kv_cache(per_case * len(cases), bs)

    def slots(table: np.ndarray, positions: Any) -> Any:
        return table[positions // bs] * bs + positions % bs

    starts = np.cumsum([0] + [len(p) for p in prompts])
    prompt_step = ForwardBatch(
        input_ids=np.concatenate(prompts),
        positions=np.concatenate([np.arange(len(p)) for p in prompts]),
        slot_mapping=np.concatenate([slots(t, np.arange(len(p))) for t, p in zip(tables, prompts)]),
        num_decodes=0,
        decode_block_tables=np.zeros((0, 1), np.int64),
        decode_context_lens=np.zeros(0, np.int64),
        prefills=[PrefillSpan(int(s), len(p), len(p), t) for s, p, t in zip(starts, prompts, tables)],
        logits_indices=starts[1:] - 1,
    )
    logits = {(i, 0): row for i, row in enumerate(np.asarray(model.forward(prompt_step, cache)))}
    for k in range(1, max(len(c["greedy_ids"]) for c in cases)):
        rows = [i for i, c in enumerate(cases) if k < len(c["greedy_ids"])]
        positions = np.array([len(prompts[i]) + k - 1 for i in rows])
        decode_step = ForwardBatch(
            input_ids=np.array([cases[i]["greedy_ids"][k - 1] for i in rows]),
            positions=positions,
            slot_mapping=np.array([slots(tables[i], n) for i, n in zip(rows, positions)]),
            num_decodes=len(rows),
            decode_block_tables=np.stack([tables[i] for i in rows]),
            decode_context_lens=positions + 1,
            logits_indices=np.arange(len(rows)),
        )
        logits.update({(i, k): row for i, row in zip(rows, np.asarray(model.forward(decode_step, cache)))})
    # what the engine itself lists for `logprobs=LISTED`, so both readings rank and round alike
    return [
        dict(token_logprob(logits[(i, k)], token, LISTED).top)
        for i, c in enumerate(cases)
        for k, token in enumerate(c["greedy_ids"])
    ]


def compare(want: list[dict[int, float]], got: list[dict[int, float]]) -> Drift:
    """How far `got` (int8's listed log-probabilities) strays from `want` (float32's), position by position."""
    errors, agree, overturned = [], 0, 0.0
    for f, q in zip(want, got):
        ranked = sorted(f, key=f.__getitem__, reverse=True)
        lowest_listed = min(q.values())
        errors.append(max(abs(f[t] - q.get(t, lowest_listed)) for t in ranked[:TOP]))
        same = max(q, key=q.__getitem__) == ranked[0]
        agree += same
        if not same:
            overturned = max(overturned, f[ranked[0]] - f[ranked[1]])
    errors.sort()
    return Drift(
        positions=len(want),
        top1_agreement=agree / len(want),
        largest_lead_overturned=overturned,
        max_logprob_error=errors[-1],
        p95_logprob_error=errors[int(0.95 * (len(errors) - 1))],
    )


def main() -> None:
    import onnxruntime

    from backend_engine.backend import select_backend, set_blas_threads
    from backend_engine.config import EngineConfig, default_model_path
    from backend_engine.model import load_model

    set_blas_threads(1)
    backend = select_backend("cpu")
    engines = {}
    for compute in ("float32", "int8"):
        loaded = load_model(default_model_path(), backend, compute=compute)
        config = EngineConfig(device="cpu", compute=compute, kv_cache_bytes=64 << 20)
        engines[compute] = LLMEngine(config, loaded=loaded, backend=backend)
    int8, prompts = engines["int8"], reference_prompts()
    want = next_token_logprobs(engines["float32"], prompts)
    drift = compare(want, next_token_logprobs(int8, prompts))
    decoded = compare(want, decoded_logprobs(int8))
    one_row = compare(want, decoded_logprobs(int8, together=False))
    seqs = int8.generate([c["prompt_ids"] for c in reference()["cases"]], SamplingParams(max_tokens=32, temperature=0))
    report = {"onnxruntime": onnxruntime.__version__, "cpu": _cpu_flags(), **asdict(drift)}
    report["decode_steps"] = asdict(decoded)
    report["decode_steps_one_row"] = asdict(one_row)
    report["int8_greedy_answers"] = [int8.tokenizer.decode(s.output_token_ids) for s in seqs]
    print(json.dumps(report, indent=1, ensure_ascii=False))


def _cpu_flags() -> list[str]:
    """The vector extensions this process's CPU reports through cpuid (under qemu, the emulated CPU's), as numpy's
    dispatcher found them; with NPY_DISABLE_CPU_FEATURES set, the disabled ones are left out."""
    import numpy as np

    found = np._core._multiarray_umath.__cpu_features__
    return sorted(name.lower() for name, on in found.items() if on and name.startswith(("AVX", "AMX")))


if __name__ == "__main__":
    main()
