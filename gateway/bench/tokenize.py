"""Tokenizers for the oracle prefix-hit rate: chat messages -> the token ids a server would prefill.

`bundled`: the bundled SmolLM2 GGUF's tokenizer and chat template (what `portcullis engine serve` uses by default).
A path: a Hugging Face tokenizer.json (or the folder holding it); the folder's tokenizer_config.json chat template
is used when it has one, else ChatML.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


class MessageTokenizer:
    def __init__(self, tokenizer: Any, template: Any, name: str) -> None:
        from backend_engine.model.prompt import PromptRenderer

        self.renderer = PromptRenderer(tokenizer, template)
        self.name = name

    def encode(self, messages: list[dict[str, str]]) -> list[int]:
        return self.renderer.chat_ids(messages)

    def encode_text(self, text: str) -> list[int]:
        """Output text as the tokens a server generated (approximately: re-tokenization may merge differently)."""
        return self.renderer.tokenizer.encode(text, add_bos=False) if text else []


def load_tokenizer(spec: str) -> MessageTokenizer:
    from backend_engine.model.chat_template import ChatTemplate
    from backend_engine.model.tokenizer import Tokenizer

    if spec == "bundled":
        from gguf import GGUFReader

        from backend_engine.config import default_model_path
        from backend_engine.model.gguf import read_metadata

        tok = Tokenizer.from_gguf_metadata(read_metadata(GGUFReader(default_model_path())))
    else:
        path = Path(spec)
        folder = path.parent if path.is_file() else path
        if not (folder / "tokenizer.json").exists():
            raise FileNotFoundError(f"--tokenizer {spec!r}: no tokenizer.json there (or pass 'bundled')")
        tok = Tokenizer.from_pretrained_dir(folder)
    return MessageTokenizer(tok, ChatTemplate(tok.chat_template, tok.bos_token, tok.eos_token), spec)
