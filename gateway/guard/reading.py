"""How much of a text a classifier's vocabulary reads as words, so that a blend weighs its margin by it.

An encoder with an English WordPiece vocabulary cuts Cyrillic, Greek, Arabic, Hebrew, Devanagari, Tamil, Korean or
Japanese into single letters and `[UNK]`s. Its margin on such a text is a guess, and in an equal blend it cancelled
the multilingual member's reading of the same attack: that was most of the misses in languages never trained on
(guard_models/README.md). The share read is the share of a text's letter-bearing pieces that are known pieces of at
least two letters: ~0.95 for English and most Latin-script languages, under 0.2 for the scripts above.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from collections.abc import Sequence

    from tokenizers import Tokenizer


class VocabularyReading:
    """The share of a text's pieces, in one tokenizer's ids, that its vocabulary reads as words or parts of words."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        added = {token.content for token in tokenizer.get_added_tokens_decoder().values()}
        self.letters = np.zeros(max(vocab.values()) + 1, dtype=np.int32)
        for piece, i in vocab.items():
            if piece not in added:  # [CLS], [PAD], [UNK], <s>...: no letters of the text
                self.letters[i] = sum(ch.isalpha() for ch in piece.removeprefix("##").removeprefix("\u2581"))
        unknown = tokenizer.model.unk_token if hasattr(tokenizer.model, "unk_token") else None
        self.unknown = vocab.get(unknown, -1) if unknown else -1

    def share(self, ids: Sequence[int]) -> float:
        """Of the pieces that hold letters (an unknown piece stands for some), the share of known ones of two letters
        or more; 1.0 for a text without letters, which no vocabulary reads worse than another."""
        tokens = np.asarray(ids, dtype=np.int64)
        letters = self.letters[tokens]
        unknown = tokens == self.unknown
        counted = int(((letters > 0) | unknown).sum())
        return float(((letters >= 2) & ~unknown).sum() / counted) if counted else 1.0


def blend_weights(weights: Sequence[float], shares: np.ndarray) -> np.ndarray:
    """Each text's member weights (texts × members): each configured weight times the share of the text its member's
    vocabulary reads (`shares`; 1 for a member not weighed by it), scaled back to the configured total, so that a text
    every member reads keeps the configured weights and one a member cannot read leaves that member out. A text none
    of them reads keeps the configured weights."""
    configured = np.asarray(weights, dtype=np.float64)
    scaled = configured * shares
    total = scaled.sum(axis=-1, keepdims=True)
    read = total > 0
    return np.where(read, scaled * (configured.sum() / np.where(read, total, 1.0)), configured)
