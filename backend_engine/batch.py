"""From a scheduled step to the model's flat input: token ids, positions, KV slots, attention metadata."""

from __future__ import annotations

import numpy as np

from backend_engine.model.llama import ForwardBatch, PrefillSpan
from backend_engine.sequence import Sequence


def decodes_first(items: list[tuple[Sequence, int]]) -> list[tuple[Sequence, int]]:
    """The model expects single-token rows (decodes) before prefill chunks."""
    return [it for it in items if it[1] == 1] + [it for it in items if it[1] > 1]


def build_forward_batch(items: list[tuple[Sequence, int]], block_size: int) -> tuple[ForwardBatch, list[int | None]]:
    """The batch for (sequence, new tokens) items, which must come decodes first (see `decodes_first`), and
    for each item its row in the logits, or None when its chunk does not reach the end of the sequence
    (a prefill that continues next step)."""
    bs = block_size
    ids: list[int] = []
    pos: list[np.ndarray] = []
    slots: list[np.ndarray] = []
    decodes: list[Sequence] = []
    prefills: list[PrefillSpan] = []
    rows: list[int] = []
    sample_rows: list[int | None] = []
    for seq, n in items:
        start = len(ids)
        nc = seq.num_computed_tokens
        p = np.arange(nc, nc + n)
        bt = np.asarray(seq.block_table, dtype=np.int64)
        ids.extend(seq.token_ids[nc : nc + n])
        pos.append(p)
        slots.append(bt[p // bs] * bs + p % bs)
        if n == 1:
            decodes.append(seq)
        else:
            prefills.append(PrefillSpan(start, n, nc + n, bt))
        if nc + n == seq.num_tokens:
            sample_rows.append(len(rows))
            rows.append(start + n - 1)
        else:
            sample_rows.append(None)
    D = len(decodes)
    width = max((len(s.block_table) for s in decodes), default=1)
    tables = np.zeros((D, width), dtype=np.int64)
    for i, s in enumerate(decodes):
        tables[i, : len(s.block_table)] = s.block_table
    fb = ForwardBatch(
        input_ids=np.asarray(ids, dtype=np.int64),
        positions=np.concatenate(pos),
        slot_mapping=np.concatenate(slots),
        num_decodes=D,
        decode_block_tables=tables,
        decode_context_lens=np.array([s.num_computed_tokens + 1 for s in decodes], dtype=np.int64),
        prefills=prefills,
        logits_indices=np.asarray(rows, dtype=np.int64),
    )
    return fb, sample_rows
