"""Tokenizers for the oracle prefix-hit rate: chat messages -> the token ids a server would prefill.

`bundled`: the bundled SmolLM2 GGUF's tokenizer and chat template (what `portcullis engine serve` uses by default).
A path: a Hugging Face tokenizer.json (or the folder holding it); the folder's tokenizer_config.json chat template
is used when it has one, else ChatML.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


class MessageTokenizer:
    def __init__(self, renderer: Any, name: str) -> None:
        self.renderer = renderer  # backend_engine.model.prompt.PromptRenderer
        self.name = name

    def encode(self, messages: list[dict[str, str]]) -> list[int]:
        return self.renderer.chat_ids(messages)

    def encode_text(self, text: str) -> list[int]:
        """Output text as the tokens a server generated (approximately: re-tokenization may merge differently)."""
        return self.renderer.tokenizer.encode(text, add_bos=False) if text else []


def load_tokenizer(spec: str) -> MessageTokenizer:
    from backend_engine.model import load_prompt_renderer

    if spec == "bundled":
        from backend_engine.config import default_model_path

        return MessageTokenizer(load_prompt_renderer(default_model_path()), spec)
    path = Path(spec)
    folder = path.parent if path.is_file() else path
    if not (folder / "tokenizer.json").exists():
        raise FileNotFoundError(f"--tokenizer {spec!r}: no tokenizer.json there (or pass 'bundled')")
    return MessageTokenizer(load_prompt_renderer(str(folder)), spec)
