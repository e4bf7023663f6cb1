"""A BERT encoder's forward pass in numpy: what a sentence-transformers model such as all-MiniLM-L6-v2 computes
before pooling.

Token, position and token-type embeddings are summed and layer-normalised; each layer is post-norm self-attention
over the real tokens (padding is masked out of every softmax) and a GELU feed-forward block. Weights stay float32
as the model ships them; the linear layers keep Hugging Face's [out, in] matrices, transposed once at load.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

Array = np.ndarray[Any, np.dtype[np.float32]]


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    max_position: int
    layer_norm_eps: float

    @classmethod
    def from_json(cls, text: bytes | str) -> BertConfig:
        """A Hugging Face config.json of a BERT model (absolute positions, GELU), or ValueError naming what differs."""
        cfg = json.loads(text)
        if cfg.get("model_type") != "bert":
            raise ValueError(f"not a BERT model: model_type {cfg.get('model_type')!r}")
        if cfg.get("hidden_act", "gelu") != "gelu" or cfg.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError("only BERT with GELU and absolute position embeddings is supported")
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=int(cfg["num_attention_heads"]),
            max_position=int(cfg["max_position_embeddings"]),
            layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-12)),
        )


@dataclass(frozen=True)
class Linear:
    weight: Array  # [in, out]
    bias: Array  # [out]

    def __call__(self, x: Array) -> Array:
        return x @ self.weight + self.bias


@dataclass(frozen=True)
class LayerNorm:
    weight: Array
    bias: Array
    eps: float

    def __call__(self, x: Array) -> Array:
        mean = x.mean(axis=-1, keepdims=True)
        var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
        return (x - mean) / np.sqrt(var + self.eps) * self.weight + self.bias


@dataclass(frozen=True)
class BertLayer:
    query: Linear
    key: Linear
    value: Linear
    attention_out: Linear
    attention_norm: LayerNorm
    intermediate: Linear
    output: Linear
    output_norm: LayerNorm


@dataclass(frozen=True)
class BertModel:
    config: BertConfig
    word_embeddings: Array  # [V, H]
    position_embeddings: Array  # [P, H]
    token_type_embedding: Array  # [H]: type 0, the only segment a single text has
    embedding_norm: LayerNorm
    layers: list[BertLayer]

    @classmethod
    def from_tensors(cls, config: BertConfig, tensors: dict[str, np.ndarray]) -> BertModel:
        """The model from a safetensors state dict (with or without the `bert.` prefix some exports carry)."""
        t = {name.removeprefix("bert."): np.asarray(a, dtype=np.float32) for name, a in tensors.items()}
        eps = config.layer_norm_eps

        def linear(name: str) -> Linear:
            return Linear(np.ascontiguousarray(t[f"{name}.weight"].T), t[f"{name}.bias"])

        def norm(name: str) -> LayerNorm:
            return LayerNorm(t[f"{name}.weight"], t[f"{name}.bias"], eps)

        layers = []
        for i in range(config.num_layers):
            p = f"encoder.layer.{i}"
            layers.append(
                BertLayer(
                    query=linear(f"{p}.attention.self.query"),
                    key=linear(f"{p}.attention.self.key"),
                    value=linear(f"{p}.attention.self.value"),
                    attention_out=linear(f"{p}.attention.output.dense"),
                    attention_norm=norm(f"{p}.attention.output.LayerNorm"),
                    intermediate=linear(f"{p}.intermediate.dense"),
                    output=linear(f"{p}.output.dense"),
                    output_norm=norm(f"{p}.output.LayerNorm"),
                )
            )
        return cls(
            config=config,
            word_embeddings=t["embeddings.word_embeddings.weight"],
            position_embeddings=t["embeddings.position_embeddings.weight"],
            token_type_embedding=t["embeddings.token_type_embeddings.weight"][0],
            embedding_norm=norm("embeddings.LayerNorm"),
            layers=layers,
        )

    def forward(self, ids: np.ndarray, mask: np.ndarray) -> Array:
        """Final hidden states [B, T, H] of token ids [B, T], where `mask` [B, T] is 1 for a real token and 0 for
        padding (whose states are computed but attended by nothing)."""
        batch, length = ids.shape
        heads = self.config.num_heads
        head_dim = self.config.hidden_size // heads
        x = self.word_embeddings[ids] + self.position_embeddings[:length] + self.token_type_embedding
        x = self.embedding_norm(x)
        # added to every score of a padded key: exp() of it is 0, so padding changes no real token's state
        key_bias = np.where(mask[:, None, None, :] > 0, 0.0, np.finfo(np.float32).min).astype(np.float32)
        scale = np.float32(1.0 / np.sqrt(head_dim))

        def split(h: Array) -> Array:  # [B, T, H] -> [B, heads, T, head_dim]
            return h.reshape(batch, length, heads, head_dim).transpose(0, 2, 1, 3)

        for layer in self.layers:
            q, k, v = split(layer.query(x)), split(layer.key(x)), split(layer.value(x))
            scores = (q @ k.transpose(0, 1, 3, 2)) * scale + key_bias
            scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
            probs = scores / scores.sum(axis=-1, keepdims=True)
            context = (probs @ v).transpose(0, 2, 1, 3).reshape(batch, length, -1)
            x = layer.attention_norm(x + layer.attention_out(context))
            x = layer.output_norm(x + layer.output(gelu(layer.intermediate(x))))
        return x


def gelu(x: Array) -> Array:
    """BERT's exact GELU, x * Phi(x), with erf from Abramowitz and Stegun 7.1.26 (error under 1.5e-7): numpy has no
    erf, and the tanh approximation differs from it by up to 1e-3."""
    z = np.abs(x) * np.float32(1 / np.sqrt(2))
    t = 1 / (1 + np.float32(0.3275911) * z)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    erf_abs = 1 - poly * np.exp(-z * z)
    return (0.5 * x * (1 + np.sign(x) * erf_abs)).astype(np.float32)
