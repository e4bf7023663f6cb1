"""Llama forward pass over a flat token batch that mixes prefill chunks and decode tokens.

Token-wise work (norms, projections, RoPE, MLP) runs once over the whole flat batch as one
matmul per weight, so prefill is a parallel pass and decodes are batched across sequences.
Attention reads the paged KV cache: decode tokens are attended in one batched gather over
their block tables; each prefill chunk is attended with its own causal mask.

Weights are stored pre-transposed ([in, out], contiguous) so every projection is `x @ W`,
and Q|K|V and gate|up are fused so a layer costs four matmuls. Under `--compute int8` a step of
decode rows alone is one onnxruntime graph instead (`int8_decode_step.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from backend_engine.backend import ArrayBackend
from backend_engine.model.decode_attention import DecodeAttention
from backend_engine.model.int8_decode_step import Int8DecodeStep, StepWeights
from backend_engine.model.int8_layers import Int8LayerStack
from backend_engine.model.int8_matmul import Int8Matmul
from backend_engine.model.prefill_attention import PrefillAttention
from backend_engine.model.quant_blocks import BlockQuantized


@dataclass
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    max_position: int = 4096
    tie_embeddings: bool = False
    rope_scaling: dict | None = None


@dataclass
class LayerWeights:
    attn_norm: Any  # [H]
    wqkv: Any  # [H, (nh + 2*nkv) * hd]
    wo: Any  # [nh*hd, H]
    ffn_norm: Any  # [H]
    w_gate_up: Any  # [H, 2*I]
    w_down: Any  # [I, H]


@dataclass
class LlamaWeights:
    embed: Any  # [V, H] (float32: rows are looked up, not multiplied)
    layers: list[LayerWeights]
    final_norm: Any  # [H]
    lm_head: Any  # [H, V], or an `Int8Matmul`
    int8_layers: Int8LayerStack | None = None  # `--compute int8`: every layer's matrices and norms (then layers=[])
    int8_decode: Int8DecodeStep | None = None  # `--compute int8`: a step of decode rows alone, as one graph


@dataclass
class PrefillSpan:
    """One sequence's chunk of >1 new tokens inside the flat batch."""

    start: int  # first row in the flat batch
    num_tokens: int  # rows in this chunk
    context_len: int  # tokens in the KV cache after this chunk (cached + computed + new)
    block_table: np.ndarray


@dataclass
class PrefillGroup:
    """Prompt chunks whose causal attention one batched product computes, each padded to the group's longest.

    Why: a chunk's attention costs a dozen calls a layer whatever its length, and a step of many new short prompts
    paid them per prompt; int8's onnxruntime graph (`prefill_attention.py`) takes a whole group in one. The masks
    are built once a step, shared by every layer (they were built per chunk and layer)."""

    queries: Any  # [S * n] int64: each padded query's row in the flat batch (a padding row repeats a real one)
    block_tables: Any  # [S, blocks] int64, a shorter chunk's padded with block 0 (masked)
    bias: Any  # [S, 1, 1, n, blocks * block_size] float32: 0 where a query may look, -1e30 past it or the chunk
    kept: Any  # [rows] int64: the padded outputs that are real rows, in `rows`' order
    rows: Any  # [rows] int64: their rows in the flat batch
    length: int  # L: the group's longest context

    @classmethod
    def of(cls, spans: list[PrefillSpan], bs: int, asarray: Callable[[np.ndarray], Any]) -> PrefillGroup:
        """The group of `spans` (a `group_spans` group) over a cache of `bs`-token blocks, its arrays on the
        backend's device."""
        n = max(sp.num_tokens for sp in spans)
        length = max(sp.context_len for sp in spans)
        blocks = -(-length // bs)
        queries = np.empty((len(spans), n), np.int64)
        tables = np.zeros((len(spans), blocks), np.int64)
        bias = np.full((len(spans), n, blocks * bs), np.float32(-1e30))
        kept, rows = [], []
        for i, sp in enumerate(spans):
            real = np.arange(sp.num_tokens)
            own = np.minimum(np.arange(n), sp.num_tokens - 1)  # a padding query repeats the chunk's last
            queries[i] = sp.start + own
            used = -(-sp.context_len // bs)
            tables[i, :used] = sp.block_table[:used]
            first = sp.context_len - sp.num_tokens  # the chunk's first position
            bias[i][np.arange(blocks * bs)[None, :] <= first + own[:, None]] = 0
            kept.append(i * n + real)
            rows.append(sp.start + real)
        return cls(
            asarray(queries.reshape(-1)),
            asarray(tables),
            asarray(bias[:, None, None]),
            asarray(np.concatenate(kept)),
            asarray(np.concatenate(rows)),
            length,
        )


@dataclass
class DecodePlan:
    """What every layer's decode attention shares in one step."""

    block_tables: Any  # [D, max_blocks] int64
    bias: Any  # [D, max_blocks * block_size]: 0 within a sequence, -1e30 past its end
    padded: bool  # some sequence ends before its last block does (else numpy's path skips the bias)


@dataclass
class ForwardBatch:
    input_ids: np.ndarray  # [T] token ids
    positions: np.ndarray  # [T]
    slot_mapping: np.ndarray  # [T] flat KV slot = block * block_size + offset
    num_decodes: int  # rows [0, num_decodes) are single-token sequences
    decode_block_tables: np.ndarray  # [D, max_blocks] (padded)
    decode_context_lens: np.ndarray  # [D]
    prefills: list[PrefillSpan] = field(default_factory=list)
    logits_indices: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))


def _dense(t: Any) -> np.ndarray:
    return t.dequantize() if isinstance(t, BlockQuantized) else t


def _matrix(parts: list[Any], be: ArrayBackend) -> Any:
    """One stored weight from HF-layout parts ([out, in] each, fused along out): `BlockQuantized` when every part
    kept its quantized blocks (`--compute int8`), else pre-transposed [in, out] in the backend's dtype."""
    if all(isinstance(p, BlockQuantized) for p in parts):
        stacked = BlockQuantized.stack_rows(parts)
        if stacked is not None:
            return stacked
    return be.asarray(np.concatenate([_dense(p) for p in parts], axis=0).T, be.weight_dtype)


# (layers, LM head, embed, final_norm) -> (the layer graphs' layers, the decode step's weights for steps of few rows,
# and for batched steps)
LayerRewrite = Callable[[list[LayerWeights], Any, Any, Any], tuple[list[LayerWeights], StepWeights, StepWeights]]


def hf_tensors_to_weights(
    cfg: LlamaConfig, t: dict[str, Any], be: ArrayBackend, rewrite_int8_layers: LayerRewrite | None = None
) -> LlamaWeights:
    """Build fused, pre-transposed weights from Hugging Face-named tensors ([out, in]): float32 arrays, or, when
    the tensors kept their quantized blocks (`--compute int8`), onnxruntime graphs that multiply them as blocks,
    after `rewrite_int8_layers` (most of them as smoothed int8 rows for the layer graphs and batched decode steps, and
    as 8-bit blocks for decode steps of few rows: `calibration.py`) if given."""
    int8 = any(isinstance(v, BlockQuantized) for v in t.values())
    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        layers.append(
            LayerWeights(
                attn_norm=be.asarray(t.pop(p + "input_layernorm.weight"), np.float32),
                wqkv=_matrix([t.pop(p + f"self_attn.{n}_proj.weight") for n in "qkv"], be),
                wo=_matrix([t.pop(p + "self_attn.o_proj.weight")], be),
                ffn_norm=be.asarray(t.pop(p + "post_attention_layernorm.weight"), np.float32),
                w_gate_up=_matrix([t.pop(p + "mlp.gate_proj.weight"), t.pop(p + "mlp.up_proj.weight")], be),
                w_down=_matrix([t.pop(p + "mlp.down_proj.weight")], be),
            )
        )
    embed = t.pop("model.embed_tokens.weight")
    head = _matrix([t.pop("lm_head.weight", embed)], be)
    embed = be.asarray(_dense(embed), np.float32)
    final_norm = be.asarray(t.pop("model.norm.weight"), np.float32)
    few, batched = StepWeights(layers, head), None
    if int8 and rewrite_int8_layers is not None:
        layers, few, batched = rewrite_int8_layers(layers, head, embed, final_norm)
    stack = Int8LayerStack(layers, cfg.rms_eps, cfg.num_heads, cfg.num_kv_heads) if int8 else None
    return LlamaWeights(
        embed=embed,
        layers=[] if stack else layers,  # the graphs hold the blocks: keeping them too would double the memory
        final_norm=final_norm,
        lm_head=Int8Matmul(head) if isinstance(head, BlockQuantized) else head,
        int8_layers=stack,
        int8_decode=Int8DecodeStep(cfg, final_norm, few, batched) if int8 else None,
    )


def _rope_inv_freq(cfg: LlamaConfig) -> np.ndarray:
    """Inverse frequencies, with Llama-3 style scaling when the config asks for it."""
    hd = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    rs = cfg.rope_scaling or {}
    if rs.get("rope_type", rs.get("type")) == "llama3":
        factor, lo, hi = rs["factor"], rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
        old = rs.get("original_max_position_embeddings", 8192)
        wavelen = 2 * np.pi / inv
        smooth = (old / wavelen - lo) / (hi - lo)
        scaled = np.where(wavelen > old / lo, inv / factor, inv)
        mid = (wavelen <= old / lo) & (wavelen >= old / hi)
        inv = np.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    elif rs.get("rope_type", rs.get("type")) == "linear":
        inv = inv / rs["factor"]
    return inv


QUERY_RUN = 128  # the most queries of one chunk that attend as one: a longer chunk is cut into runs of this many


def query_runs(span: PrefillSpan, run: int = QUERY_RUN) -> list[PrefillSpan]:
    """`span` as runs of at most `run` queries, each over the keys up to its own last query: causal attention over a
    long chunk computes about half its scores this way instead of every query against every key (a 960-token prompt:
    0.35-0.38 against 0.52-0.54 s of attention, two threads)."""
    first = span.context_len - span.num_tokens
    return [
        PrefillSpan(
            span.start + a, min(run, span.num_tokens - a), first + min(a + run, span.num_tokens), span.block_table
        )
        for a in range(0, span.num_tokens, run)
    ]


def group_spans(spans: list[PrefillSpan], waste: float = 1.2) -> list[list[PrefillSpan]]:
    """The step's prompt chunks, cut into `query_runs`, in groups for `PrefillGroup`, longest context first: a run
    joins the group being built while the group's padded scores stay within `waste` times its runs' own (a 400-token
    run does not pad eight 14-token ones to its length)."""
    groups: list[list[PrefillSpan]] = []
    for sp in sorted((r for span in spans for r in query_runs(span)), key=lambda sp: -sp.context_len):
        if groups:
            group = [*groups[-1], sp]
            padded = len(group) * max(x.num_tokens for x in group) * group[0].context_len
            if padded <= waste * sum(x.num_tokens * x.context_len for x in group):
                groups[-1] = group
                continue
        groups.append([sp])
    return groups


class LlamaModel:
    """Weights + RoPE tables; `forward` fills the KV cache and returns logits for chosen rows."""

    def __init__(self, cfg: LlamaConfig, weights: LlamaWeights, backend: ArrayBackend):
        self.cfg = cfg
        self.w = weights
        self.be = backend
        xp = backend.xp
        inv = _rope_inv_freq(cfg)
        ang = np.outer(np.arange(cfg.max_position, dtype=np.float64), inv)
        self.cos = backend.asarray(np.cos(ang).astype(np.float32))
        self.sin = backend.asarray(np.sin(ang).astype(np.float32))
        self.scale = np.float32(1.0 / np.sqrt(cfg.head_dim))
        self.xp = xp
        # `--compute int8`: decode attention as an onnxruntime graph (decode_attention.py)
        self._attention_graph = (
            DecodeAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) if weights.int8_layers is not None else None
        )
        self._prefill_graph = (
            PrefillAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) if weights.int8_layers is not None else None
        )

    def weight_bytes(self) -> int:
        n = sum(g.nbytes for g in (self.w.int8_layers, self.w.int8_decode) if g is not None)
        for lw in self.w.layers:
            n += sum(int(a.nbytes) for a in vars(lw).values())
        return n + int(self.w.embed.nbytes + self.w.final_norm.nbytes + self.w.lm_head.nbytes)

    def kv_bytes_per_token(self) -> int:
        itemsize = np.dtype(self.be.weight_dtype).itemsize if self.be.device == "cpu" else 2
        return 2 * self.cfg.num_layers * self.cfg.num_kv_heads * self.cfg.head_dim * itemsize

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> list[Any]:
        """One array per layer: [2 (K,V), n_kv_heads, num_blocks, block_size, head_dim].

        Heads lead so a gather over block ids yields [.., blocks, block_size, hd] that reshapes to
        a contiguous [.., tokens, hd] matrix per head without a second copy.

        Every page is written now, not when a block is first used: the operating system maps a zeroed array's
        memory lazily, and on a VM each first touch can cost ~20 us a page (a 512 MiB cache ~3 s, spread over the
        first requests to reach fresh blocks: 32 new 32-token prompts were prefilled in 1.0-1.2 s, now 0.68-0.70 s).
        The budget was sized for this memory anyway; a machine that cannot hold it now fails at start, not later.
        """
        c = self.cfg
        shape = (2, c.num_kv_heads, num_blocks, block_size, c.head_dim)
        caches = [self.xp.empty(shape, dtype=self.be.weight_dtype) for _ in range(c.num_layers)]
        for cache in caches:
            cache.fill(0)
        return caches

    # --- building blocks -------------------------------------------------------------------------

    def _rms(self, x: Any, w: Any) -> Any:
        xp = self.xp
        var = xp.mean(x * x, axis=-1, keepdims=True)
        return x * (1.0 / xp.sqrt(var + self.cfg.rms_eps)) * w

    def _mm(self, x: Any, w: Any) -> Any:
        if isinstance(w, Int8Matmul):
            return w(x)
        if x.dtype != w.dtype:
            return (x.astype(w.dtype) @ w).astype(self.xp.float32)
        return x @ w

    def _rope(self, x: Any, cos: Any, sin: Any) -> Any:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return self.xp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    # --- forward -------------------------------------------------------------------------------

    def forward(self, batch: ForwardBatch, kv_cache: list[Any]) -> Any:
        """Run all layers over the flat batch; returns float32 logits [len(logits_indices), V]."""
        if self.w.int8_decode is not None and not batch.prefills:
            return self._int8_decode_step(batch, kv_cache)
        h = self._layers(batch, kv_cache)
        rows = h[self.be.asarray(batch.logits_indices.astype(np.int64))]
        return self._mm(self._rms(rows, self.w.final_norm), self.w.lm_head).astype(self.xp.float32, copy=False)

    def final_hidden_states(self, batch: ForwardBatch, kv_cache: list[Any]) -> Any:
        """Run all layers over the flat batch; returns every row's final hidden state [T, H] (after the final
        norm, before the LM head): what embeddings pool."""
        return self._rms(self._layers(batch, kv_cache), self.w.final_norm)

    def _layers(self, batch: ForwardBatch, kv_cache: list[Any]) -> Any:
        """The residual stream [T, H] after the last layer; fills the batch's KV slots on the way."""
        xp, c, be = self.xp, self.cfg, self.be
        nh, hd = c.num_heads, c.head_dim
        T = len(batch.input_ids)
        ids = be.asarray(batch.input_ids.astype(np.int64))
        pos = batch.positions.astype(np.int64)
        slots = be.asarray(batch.slot_mapping.astype(np.int64))
        D = batch.num_decodes
        self._block_size = kv_cache[0].shape[3]
        dec = self._decode_plan(batch) if D else None
        groups = [PrefillGroup.of(spans, self._block_size, be.asarray) for spans in group_spans(batch.prefills)]

        h = self.w.embed[ids]  # [T, H] float32
        stack = self.w.int8_layers
        if stack is None:
            pos_d = be.asarray(pos)
            cos, sin = self.cos[pos_d][:, None, :], self.sin[pos_d][:, None, :]
        else:
            rope = {"positions": pos.reshape(T, 1), "cos": self.cos, "sin": self.sin}
            qkv = stack.first(h, rope)
        for li in range(c.num_layers):
            if stack is None:
                lw = self.w.layers[li]
                qkv = self._rope_qk(self._mm(self._rms(h, lw.attn_norm), lw.wqkv), cos, sin)
            cache = kv_cache[li]
            self._store_kv(qkv[:, nh * hd :], cache, slots)
            q = qkv[:, : nh * hd]
            attn = xp.empty((T, nh * hd), dtype=xp.float32)
            if dec is not None:
                attn[:D] = self._decode_attention(q[:D], cache, dec)
            for group in groups:
                attn[group.rows] = self._prefill_attention(q, cache, group)
            if stack is None:
                self._mlp(h, attn, lw)
            else:
                h, qkv = stack.after_attention(li, h, attn, rope)
        return h

    def _int8_decode_step(self, batch: ForwardBatch, kv_cache: list[Any]) -> Any:
        """A step of decode rows alone through `Int8DecodeStep`, then their new K and V into the cache."""
        assert self.w.int8_decode is not None
        D = batch.num_decodes
        tables = batch.decode_block_tables.astype(np.int64)
        cached = np.arange(tables.shape[1] * kv_cache[0].shape[3])[None, :] < batch.decode_context_lens[:, None] - 1
        bias = np.where(cached, np.float32(0), np.float32(-1e30))  # the new token's slot is not written yet
        rope = {"positions": batch.positions.astype(np.int64).reshape(D, 1), "cos": self.cos, "sin": self.sin}
        logits, kv = self.w.int8_decode.run(self.w.embed[batch.input_ids], rope, tables, bias, kv_cache)
        slots = batch.slot_mapping.astype(np.int64)
        for li, cache in enumerate(kv_cache):
            self._store_kv(kv[:, li], cache, slots)
        rows = batch.logits_indices
        return logits if np.array_equal(rows, np.arange(D)) else logits[rows]

    def _rope_qk(self, qkv: Any, cos: Any, sin: Any) -> Any:
        """Q|K|V rows [T, (nh + 2 nkv) hd] with Q and K turned by their positions, in place (the int8 graphs do
        this themselves)."""
        c = self.cfg
        T, qk = qkv.shape[0], (c.num_heads + c.num_kv_heads) * c.head_dim
        qkv[:, :qk] = self._rope(qkv[:, :qk].reshape(T, -1, c.head_dim), cos, sin).reshape(T, qk)
        return qkv

    def _store_kv(self, rows: Any, cache: Any, slots: Any) -> None:
        """Copy the rows' K and V ([T, 2 * nkv * hd], each row's K then V) into their slots of one layer's cache,
        both halves in one indexed write."""
        c = self.cfg
        nkv, hd = c.num_kv_heads, c.head_dim
        kv = rows.reshape(-1, 2, nkv, hd).transpose(1, 2, 0, 3)  # [2, nkv, T, hd]
        cache.reshape(2, nkv, -1, hd)[:, :, slots] = kv.astype(cache.dtype, copy=False)

    def _mlp(self, h: Any, attn: Any, lw: LayerWeights) -> None:
        """The layer after attention, in place on the residual stream h: output projection, then the MLP."""
        xp = self.xp
        h += self._mm(attn, lw.wo)
        gu = self._mm(self._rms(h, lw.ffn_norm), lw.w_gate_up)
        inter = self.cfg.intermediate_size
        g, u = gu[:, :inter], gu[:, inter:]
        act = xp.exp(-g)  # SiLU(g) * u in one buffer: at decode sizes allocation costs as much as the math
        act += 1.0
        xp.divide(g, act, out=act)
        act *= u
        h += self._mm(act, lw.w_down)

    def _decode_plan(self, batch: ForwardBatch) -> DecodePlan:
        """Block tables and the additive length mask, built once and shared by every layer."""
        bt = batch.decode_block_tables
        L = bt.shape[1] * self._block_size
        mask = np.arange(L)[None, :] >= np.asarray(batch.decode_context_lens)[:, None]  # [D, L]
        bias = self.be.asarray(np.where(mask, np.float32(-1e30), np.float32(0)))
        return DecodePlan(self.be.asarray(bt.astype(np.int64)), bias, bool(mask.any()))

    def _decode_attention(self, q: Any, cache: Any, plan: DecodePlan) -> Any:
        """Batched single-token attention: one gather of all decode sequences' blocks."""
        xp, c = self.xp, self.cfg
        D = q.shape[0]
        if self._attention_graph is not None:
            return self._attention_graph.attend(q.reshape(D, -1), cache, plan.block_tables, plan.bias)
        nkv, g, hd = c.num_kv_heads, c.num_heads // c.num_kv_heads, c.head_dim
        kv = xp.take(cache, plan.block_tables, axis=2)  # [2, nkv, D, nb, bs, hd]
        L = kv.shape[3] * kv.shape[4]
        kv = kv.reshape(2, nkv, D, L, hd)
        qh = q.reshape(D, nkv, g, hd).transpose(1, 0, 2, 3)  # [nkv, D, g, hd]
        if qh.dtype != kv.dtype:
            qh = qh.astype(kv.dtype)
        s = (qh @ kv[0].transpose(0, 1, 3, 2)).astype(xp.float32, copy=False)  # [nkv, D, g, L]
        s *= self.scale
        if plan.padded:
            s += plan.bias[None, :, None, :]
        s -= s.max(axis=-1, keepdims=True)
        p = xp.exp(s, out=s)
        p /= p.sum(axis=-1, keepdims=True)
        o = (p.astype(kv.dtype, copy=False) @ kv[1]).astype(xp.float32, copy=False)  # [nkv, D, g, hd]
        return o.transpose(1, 0, 2, 3).reshape(D, nkv * g * hd)

    def _prefill_attention(self, q: Any, cache: Any, group: PrefillGroup) -> Any:
        """Causal attention of a group's chunks over their cached + new keys: the rows of `group.rows`."""
        if self._prefill_graph is not None:
            return self._prefill_graph.attend(q, cache, group)
        xp, c = self.xp, self.cfg
        nkv, g, hd = c.num_kv_heads, c.num_heads // c.num_kv_heads, c.head_dim
        S, blocks = group.block_tables.shape
        L = group.length
        kv = xp.take(cache, group.block_tables, axis=2)  # [2, nkv, S, blocks, bs, hd]
        kv = kv.reshape(2, nkv, S, -1, hd)[:, :, :, :L].transpose(0, 2, 1, 3, 4)[:, :, :, None]  # [2, S, nkv, 1, L, hd]
        qh = q[group.queries].reshape(S, -1, nkv, g, hd).transpose(0, 2, 3, 1, 4)  # [S, nkv, g, n, hd]
        if qh.dtype != kv.dtype:
            qh = qh.astype(kv.dtype)
        # in place from here on: at 512 x 1,000 the scores are 18 MB a layer, and copies cost more than math
        s = (qh @ kv[0].swapaxes(-1, -2)).astype(xp.float32, copy=False)  # [S, nkv, g, n, L]
        s *= self.scale
        s += group.bias[..., :L]
        s -= s.max(axis=-1, keepdims=True)
        p = xp.exp(s, out=s)
        p /= p.sum(axis=-1, keepdims=True)
        o = (p.astype(kv.dtype, copy=False) @ kv[1]).astype(xp.float32, copy=False)  # [S, nkv, g, n, hd]
        return o.transpose(0, 3, 1, 2, 4).reshape(-1, nkv * g * hd)[group.kept]
