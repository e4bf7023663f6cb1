"""A Hugging Face folder (config.json, model.safetensors, tokenizer.json) loads to the same model."""

import json
import struct

import numpy as np

from backend_engine.model import load_model
from backend_engine.model.safetensors import read_safetensors, write_safetensors
from backend_engine.sequence import SamplingParams

from .conftest import reference


def _export_hf(loaded, folder):
    """Write the loaded GGUF model back out in Hugging Face layout (un-fused, [out, in])."""
    c, w = loaded.config, loaded.model.w
    nh, nkv, hd, inter = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.head_dim, c.intermediate_size
    del hd
    t = {"model.embed_tokens.weight": w.embed, "model.norm.weight": w.final_norm}
    for i, lw in enumerate(w.layers):
        p = f"model.layers.{i}."
        q, k, v = np.split(lw.wqkv, [nh, nh + nkv], axis=1)
        g, u = np.split(lw.w_gate_up, [inter], axis=1)
        t.update(
            {
                p + "self_attn.q_proj.weight": q.T,
                p + "self_attn.k_proj.weight": k.T,
                p + "self_attn.v_proj.weight": v.T,
                p + "self_attn.o_proj.weight": lw.wo.T,
                p + "mlp.gate_proj.weight": g.T,
                p + "mlp.up_proj.weight": u.T,
                p + "mlp.down_proj.weight": lw.w_down.T,
                p + "input_layernorm.weight": lw.attn_norm,
                p + "post_attention_layernorm.weight": lw.ffn_norm,
            }
        )
    write_safetensors(folder / "model.safetensors", t)
    (folder / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "vocab_size": c.vocab_size,
                "hidden_size": c.hidden_size,
                "intermediate_size": inter,
                "num_hidden_layers": c.num_layers,
                "num_attention_heads": c.num_heads,
                "num_key_value_heads": c.num_kv_heads,
                "rope_theta": c.rope_theta,
                "rms_norm_eps": c.rms_eps,
                "max_position_embeddings": c.max_position,
                "tie_word_embeddings": True,
            }
        )
    )
    tok = loaded.tokenizer
    tok.hf.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": tok.chat_template,
                "bos_token": "<|im_start|>",
                "eos_token": "<|im_end|>",
                "add_bos_token": False,
            }
        )
    )


def test_hf_folder_matches_gguf(loaded, cpu_backend, make_engine, tmp_path):
    from backend_engine.config import EngineConfig
    from backend_engine.engine import LLMEngine

    _export_hf(loaded, tmp_path)
    hf = load_model(str(tmp_path), cpu_backend)
    case = reference()["cases"][4]
    assert hf.tokenizer.encode(case["prompt"]) == case["prompt_ids"]
    assert hf.tokenizer.token_bytes == loaded.tokenizer.token_bytes
    assert 2 in hf.tokenizer.eos_ids
    assert hf.chat_template.render([{"role": "user", "content": "hi"}]) == loaded.chat_template.render(
        [{"role": "user", "content": "hi"}]
    )
    eng = LLMEngine(EngineConfig(device="cpu", kv_cache_bytes=32 << 20), loaded=hf, backend=cpu_backend)
    out = eng.generate([case["prompt_ids"]], SamplingParams(max_tokens=32, temperature=0))[0]
    assert out.output_token_ids == case["greedy_ids"]


def test_bf16_tensors_widen_to_float32(tmp_path):
    vals = np.array([1.0, -2.5, 3.140625], dtype=np.float32)
    bf16 = (vals.view(np.uint32) >> 16).astype(np.uint16).tobytes()
    header = json.dumps({"x": {"dtype": "BF16", "shape": [3], "data_offsets": [0, len(bf16)]}}).encode()
    (tmp_path / "m.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bf16)
    np.testing.assert_array_equal(read_safetensors(tmp_path / "m.safetensors")["x"], vals)
