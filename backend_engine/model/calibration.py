"""The activation ranges `int8_rows.smoothed` needs: the largest |x| each input channel of a layer's Q|K|V, O and
gate|up matrices, and of the LM head, sees while the model reads a fixed calibration text, measured by the float32
forward pass.

Why a text of the engine's own: the ranges are a property of the model (a few channels carry outliers whatever the
input), so a short, varied text finds them; SmoothQuant calibrates on a few hundred samples for the same reason.
The pass runs at load, one layer's weights dequantized at a time (a layer of the bundled model is 14 MB in float32,
all thirty would be 420 MB), and takes well under a second for the bundled model. `smooth_layers`, `smoothed_head`
and `few_row_layers` then turn the GGUF's blocks into the layouts the VNNI path multiplies.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields, replace
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from backend_engine.model.int8_rows import RowQuantized, fold_into_norm, smoothed
from backend_engine.model.quant_blocks import BLOCK, BlockQuantized, requantized

if TYPE_CHECKING:
    from backend_engine.backend import ArrayBackend
    from backend_engine.model.llama import LayerWeights, LlamaConfig

SMOOTHED = ("wqkv", "wo", "w_gate_up")  # LayerWeights' matrices the row kernel takes; w_down keeps blocks
# w_down's blocks, requantized to 8 bits: its input, SiLU(gate) * up, needs int8 steps finer than a row's (as smoothed
# rows the decode step's p95 log-probability error was 0.88; in blocks of 64 / 128 it is 0.52 / 0.57, and ggml's 4-bit
# blocks of 32, 0.48), and MLAS multiplies 8-bit blocks of 128 at 32 rows in 0.7x the time of the Q4_1 blocks and
# their offset product
DOWN_BLOCK = 128
# Decode steps of few rows (`int8_decode_step.py`) read every matrix as 8-bit blocks: w_down's of ggml's 32 values,
# the others' of 64 (the widest that divides the bundled model's 576). At one row the step takes 0.92x the time of
# the smoothed rows, with a decode-step p95 log-probability error of 0.53 one row a step (w_down's blocks of 128 too:
# 0.88x, p95 0.67; every block of 32: 0.94x, p95 0.52)
FEW_ROWS_BLOCK = 64
HEAD = (-1, "lm_head")  # `activation_ranges`' key for the LM head's input, the final norm's output
# The LM head's widest input channels, multiplied in float32: as int8 rows without them the decode step's p95
# log-probability error was 0.55-0.98 over smoothing strengths 0.35-0.9, with 16 of them 0.48 (blocks: 0.41).
HEAD_FLOAT_CHANNELS = 16

# Chat turns of several kinds (prose, code, data, other scripts), rendered with the model's own template.
CALIBRATION_CHAT = [
    {"role": "system", "content": "You are a concise assistant for a platform team. Answer in plain words."},
    {
        "role": "user",
        "content": "Our nightly job failed at 03:12 UTC with exit code 137 after 41 minutes. The container had a "
        "512 MiB limit and the log ends with `Killed`. What happened, and what should we change first?",
    },
    {
        "role": "assistant",
        "content": "Exit code 137 means the process received SIGKILL, here almost certainly from the kernel's "
        "out-of-memory killer when the container reached its 512 MiB limit. Raise the limit to 1 GiB, or stream "
        "the input instead of loading it whole:\n\n```python\nwith open(path) as f:\n    for line in f:\n"
        "        handle(json.loads(line))\n```",
    },
    {
        "role": "user",
        "content": "Résume en français, puis en allemand: « La réunion est déplacée à jeudi 14 h, salle B. » "
        "Und danach: wie viele Tage hat der Februar 2028? | id | qty | price |\n| 7 | 3 | 19.90 |",
    },
]


class _NamedWeight(np.ndarray):
    """A dequantized matrix that knows which layer and matrix it is, so the recording pass can file what it saw."""

    key: tuple[int, str]


class _DequantizedLayers(Sequence["LayerWeights"]):
    """The layers as the float32 path wants them, each dequantized when the forward pass reaches it."""

    def __init__(self, layers: list[LayerWeights]) -> None:
        self._layers = layers

    def __len__(self) -> int:
        return len(self._layers)

    def __getitem__(self, i: Any) -> Any:
        from backend_engine.model.llama import LayerWeights

        lw = self._layers[i]
        dense: dict[str, Any] = {}
        for f in fields(LayerWeights):
            value = getattr(lw, f.name)
            if isinstance(value, BlockQuantized):
                value = np.ascontiguousarray(value.dequantize().T)
                if f.name in SMOOTHED:  # the matrices whose inputs the pass records
                    value = cast(_NamedWeight, value.view(_NamedWeight))
                    value.key = (i, f.name)
            dense[f.name] = value
        return LayerWeights(**dense)


def activation_ranges(
    cfg: LlamaConfig,
    layers: list[LayerWeights],
    embed: np.ndarray,
    final_norm: np.ndarray,
    ids: list[int],
    be: ArrayBackend,
) -> dict[tuple[int, str], np.ndarray]:
    """{(layer, matrix name): the largest |x| per input channel} over the forward pass of `ids`, and under `HEAD`
    the LM head's."""
    from backend_engine.model.llama import ForwardBatch, LlamaModel, LlamaWeights, PrefillSpan

    seen: dict[tuple[int, str], np.ndarray] = {}

    class Recording(LlamaModel):
        def _mm(self, x: Any, w: Any) -> Any:
            if isinstance(w, _NamedWeight):
                largest = np.abs(x).max(axis=0)
                seen[w.key] = np.maximum(seen[w.key], largest) if w.key in seen else largest
            return super()._mm(x, np.asarray(w))

    weights = LlamaWeights(embed=embed, layers=_DequantizedLayers(layers), final_norm=final_norm, lm_head=None)  # type: ignore[arg-type]
    model = Recording(cfg, weights, be)
    n, block = len(ids), 16
    blocks = -(-n // block)
    batch = ForwardBatch(
        input_ids=np.asarray(ids, np.int64),
        positions=np.arange(n),
        slot_mapping=np.arange(n),
        num_decodes=0,
        decode_block_tables=np.zeros((0, 1), np.int64),
        decode_context_lens=np.zeros(0, np.int64),
        prefills=[PrefillSpan(0, n, n, np.arange(blocks))],
    )
    final = model.final_hidden_states(batch, model.allocate_kv_cache(blocks, block))
    seen[HEAD] = np.abs(final).max(axis=0)
    return seen


def smoothed_head(head: Any, ranges: dict[tuple[int, str], np.ndarray]) -> Any:
    """The LM head as smoothed int8 rows for batched decode steps (`int8_decode_step.py`) if it is in blocks, else
    as it is."""
    if not isinstance(head, BlockQuantized):
        return head
    return smoothed(head, ranges[HEAD], float_channels=HEAD_FLOAT_CHANNELS)


def few_row_layers(layers: list[LayerWeights]) -> list[LayerWeights]:
    """The layers for decode steps of few rows: every matrix in 8-bit blocks (w_down's of ggml's size, the others' of
    `FEW_ROWS_BLOCK`), norms as they are; a matrix whose width no such block divides keeps ggml's blocks."""
    return [
        replace(
            lw,
            wqkv=_wide(lw.wqkv, FEW_ROWS_BLOCK),
            wo=_wide(lw.wo, FEW_ROWS_BLOCK),
            w_gate_up=_wide(lw.w_gate_up, FEW_ROWS_BLOCK),
            w_down=_wide(lw.w_down, BLOCK),
        )
        for lw in layers
    ]


def _wide(w: Any, block: int) -> Any:
    """`w` in 8-bit blocks of `block` if it is in blocks that `block` can replace, else `w`."""
    return requantized(w, block) if isinstance(w, BlockQuantized) and w.shape[1] % block == 0 else w


def smooth_layers(layers: list[LayerWeights], ranges: dict[tuple[int, str], np.ndarray]) -> list[LayerWeights]:
    """The layers with their `SMOOTHED` matrices as `int8_rows.RowQuantized`, smoothed by `activation_ranges`, and
    w_down in 8-bit blocks of `DOWN_BLOCK` (where its width is a multiple of it; else in ggml's blocks)."""
    from backend_engine.model.llama import LayerWeights

    out = []
    for i, lw in enumerate(layers):
        parts: dict[str, Any] = {f.name: getattr(lw, f.name) for f in fields(LayerWeights)}
        for name in SMOOTHED:
            if isinstance(parts[name], BlockQuantized):
                parts[name] = smoothed(parts[name], ranges[(i, name)])
        parts["w_down"] = _wide(parts["w_down"], DOWN_BLOCK)
        # Q|K|V and gate|up read their RMSNorm's output alone: their 1/s goes into its weight
        for norm, name in (("attn_norm", "wqkv"), ("ffn_norm", "w_gate_up")):
            if isinstance(parts[name], RowQuantized):
                parts[norm], parts[name] = fold_into_norm(parts[norm], parts[name])
        out.append(LayerWeights(**parts))
    return out
