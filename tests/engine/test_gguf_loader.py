"""GGUF loading on a tiny synthetic Llama: every supported tensor type, and the Q/K un-permutation."""

import gguf
import numpy as np
import pytest

from backend_engine.model.gguf import load_gguf, open_gguf, read_metadata, unpermute_qk
from backend_engine.model.quant_blocks import BlockQuantized

H, I, NH, NKV, HD, V = 64, 128, 4, 2, 16, 96  # noqa: E741 - the model's dimension names


def _permute(w, n_head):
    """llama.cpp convert_hf_to_gguf.py's permute: HF half-split rows -> interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_unpermute_inverts_llamacpp_permute():
    w = np.random.default_rng(0).standard_normal((NH * HD, H)).astype(np.float32)
    np.testing.assert_array_equal(unpermute_qk(_permute(w, NH), NH), w)


@pytest.mark.parametrize("qtype,tol", [("F32", 0), ("F16", 1e-3), ("Q8_0", 2e-2), ("Q4_0", 0.3), ("Q4_1", 0.3)])
def test_tiny_model_roundtrip(tmp_path, qtype, tol):
    rng = np.random.default_rng(1)
    hf = {
        "model.embed_tokens.weight": rng.standard_normal((V, H)),
        "model.norm.weight": rng.standard_normal(H),
        "lm_head.weight": rng.standard_normal((V, H)),
        "model.layers.0.input_layernorm.weight": rng.standard_normal(H),
        "model.layers.0.post_attention_layernorm.weight": rng.standard_normal(H),
        "model.layers.0.self_attn.q_proj.weight": rng.standard_normal((NH * HD, H)),
        "model.layers.0.self_attn.k_proj.weight": rng.standard_normal((NKV * HD, H)),
        "model.layers.0.self_attn.v_proj.weight": rng.standard_normal((NKV * HD, H)),
        "model.layers.0.self_attn.o_proj.weight": rng.standard_normal((H, NH * HD)),
        "model.layers.0.mlp.gate_proj.weight": rng.standard_normal((I, H)),
        "model.layers.0.mlp.up_proj.weight": rng.standard_normal((I, H)),
        "model.layers.0.mlp.down_proj.weight": rng.standard_normal((H, I)),
    }
    hf = {k: v.astype(np.float32) for k, v in hf.items()}
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    layer = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(H)
    w.add_feed_forward_length(I)
    w.add_head_count(NH)
    w.add_head_count_kv(NKV)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(V)
    for hf_name, arr in hf.items():
        if hf_name in names:
            name = names[hf_name]
        else:
            part = hf_name[len("model.layers.0.") : -len(".weight")]
            name = f"blk.0.{layer[part]}.weight"
        if name.endswith("attn_q.weight"):
            arr = _permute(arr, NH)
        elif name.endswith("attn_k.weight"):
            arr = _permute(arr, NKV)
        t = gguf.GGMLQuantizationType[qtype if arr.ndim == 2 else "F32"]
        data = gguf.quants.quantize(arr, t) if t not in (gguf.GGMLQuantizationType.F32,) else arr
        w.add_tensor(name, data, raw_shape=data.shape if t == gguf.GGMLQuantizationType.F32 else None, raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    cfg, tensors, meta = load_gguf(str(path))
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (1, H, NH, NKV, HD)
    assert not cfg.tie_embeddings
    for k, want in hf.items():
        got = tensors[k]
        assert got.shape == want.shape, k
        assert np.abs(got - want).max() <= tol * max(1.0, np.abs(want).max()), k

    # --compute int8 keeps the quantized matrices in blocks (Q/K rows un-permuted with them): same values
    _, blocks, _ = load_gguf(str(path), keep_blocks=True)
    for k, dense in tensors.items():
        kept = blocks[k]
        if qtype in ("Q8_0", "Q4_0", "Q4_1") and dense.ndim == 2:
            assert isinstance(kept, BlockQuantized), k
            np.testing.assert_array_equal(kept.dequantize(), dense, err_msg=k)
        else:
            np.testing.assert_array_equal(kept, dense, err_msg=k)


def test_the_fast_reader_reads_what_the_gguf_package_reads(tmp_path):
    """open_gguf only swaps the reader's memmap for a plain view of the same pages: every field and tensor the same."""
    path = tmp_path / "fields.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"tok{i}" for i in range(3000)])
    w.add_token_merges([f"t o{i}" for i in range(2000)])
    w.add_token_types([1] * 3000)
    w.add_chat_template("{{ messages }}")
    w.add_tensor("x.weight", np.arange(64, dtype=np.float32).reshape(8, 8))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    fast, stock = open_gguf(str(path)), gguf.GGUFReader(str(path))
    assert read_metadata(fast) == read_metadata(stock) and len(read_metadata(fast)["tokenizer.ggml.tokens"]) == 3000
    assert [(t.name, t.data.tobytes()) for t in fast.tensors] == [(t.name, t.data.tobytes()) for t in stock.tensors]
    assert type(fast.data) is np.ndarray
