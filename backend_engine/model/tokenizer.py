"""Tokenizer from GGUF metadata (byte-level BPE vocab + merges) or from tokenizer.json.

Both paths end in a `tokenizers.Tokenizer` so encoding is the Rust implementation. Decoding for
streaming does not go through it: each id maps to its raw bytes, and an incremental UTF-8 decoder
holds back partial characters, so a multi-byte character split across tokens is never emitted
broken.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


_UNICODE_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}


def _token_to_bytes(tok: str, byte_level: bool) -> bytes:
    if byte_level:
        try:
            return bytes(_UNICODE_TO_BYTE[ch] for ch in tok)
        except KeyError:
            return tok.encode("utf-8")
    m = _BYTE_TOKEN.match(tok)
    if m:
        return bytes([int(m.group(1), 16)])
    return tok.replace("\u2581", " ").encode("utf-8")


def _pre_tokenizer_for(pre: str) -> Any:
    """The GGUF `tokenizer.ggml.pre` name -> the matching split rules."""
    bl = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm", "starcoder", "refact", "codeshell", "command-r"):
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), bl])
    if pre in ("llama-bpe", "llama3", "smaug-bpe"):
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_LLAMA3_PATTERN), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    return bl


class Tokenizer:
    """Encode/decode plus the facts the engine needs: BOS/EOS, specials, chat template."""

    def __init__(
        self,
        hf: HFTokenizer,
        token_bytes: list[bytes],
        special_ids: set[int],
        bos_id: int | None,
        eos_ids: set[int],
        add_bos: bool,
        chat_template: str | None,
        bos_token: str = "",
        eos_token: str = "",
    ):
        self.hf = hf
        self.token_bytes = token_bytes
        self.special_ids = special_ids
        self.bos_id = bos_id
        self.eos_ids = eos_ids
        self.add_bos = add_bos
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.vocab_size = len(token_bytes)
        # the most bytes of text one token stands for: a text longer than n times this is surely more than n tokens
        self.max_token_bytes = max((len(b) for b in token_bytes), default=1)

    # --- construction ----------------------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any]) -> Tokenizer:
        model = meta.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise ValueError(f"GGUF tokenizer model {model!r} is not supported (byte-level BPE 'gpt2' is)")
        tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
        types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
        bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False)
        hf = HFTokenizer(bpe)
        hf.pre_tokenizer = _pre_tokenizer_for(meta.get("tokenizer.ggml.pre", "default"))
        hf.decoder = decoders.ByteLevel()
        # CONTROL (3) and USER_DEFINED (4) tokens are matched whole in the input text.
        special = [i for i, ty in enumerate(types) if ty in (3, 4)]
        hf.add_special_tokens([AddedToken(tokens[i], special=types[i] == 3, normalized=False) for i in special])
        token_bytes = [
            tok.encode("utf-8") if types[i] in (3, 4) else _token_to_bytes(tok, True) for i, tok in enumerate(tokens)
        ]
        bos = meta.get("tokenizer.ggml.bos_token_id")
        eos = meta.get("tokenizer.ggml.eos_token_id")
        eos_ids = {int(eos)} if eos is not None else set()
        eot = meta.get("tokenizer.ggml.eot_token_id")
        if eot is not None:
            eos_ids.add(int(eot))
        return cls(
            hf,
            token_bytes,
            {i for i, ty in enumerate(types) if ty == 3},
            int(bos) if bos is not None else None,
            eos_ids,
            bool(meta.get("tokenizer.ggml.add_bos_token", False)),
            meta.get("tokenizer.chat_template"),
            tokens[int(bos)] if bos is not None else "",
            tokens[int(eos)] if eos is not None else "",
        )

    @classmethod
    def from_pretrained_dir(cls, folder: str | Path) -> Tokenizer:
        folder = Path(folder)
        hf = HFTokenizer.from_file(str(folder / "tokenizer.json"))
        spec = json.loads((folder / "tokenizer.json").read_text())
        cfg_path = folder / "tokenizer_config.json"
        tcfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        byte_level = "ByteLevel" in json.dumps(spec.get("decoder") or {})
        vocab = hf.get_vocab(with_added_tokens=True)
        size = max(vocab.values()) + 1
        id_to_tok = [""] * size
        for t, i in vocab.items():
            id_to_tok[i] = t
        added = {a["id"]: a for a in spec.get("added_tokens", [])}
        token_bytes = [
            id_to_tok[i].encode("utf-8") if i in added else _token_to_bytes(id_to_tok[i], byte_level)
            for i in range(size)
        ]
        special_ids = {i for i, a in added.items() if a.get("special")}

        def tok_text(v: Any) -> str:
            return v.get("content", "") if isinstance(v, dict) else (v or "")

        bos_t, eos_t = tok_text(tcfg.get("bos_token")), tok_text(tcfg.get("eos_token"))
        bos_id = vocab.get(bos_t) if bos_t else None
        eos_ids = {vocab[eos_t]} if eos_t in vocab else set()
        gen_path = folder / "generation_config.json"
        if gen_path.exists():
            ge = json.loads(gen_path.read_text()).get("eos_token_id")
            eos_ids |= set(ge if isinstance(ge, list) else [ge] if ge is not None else [])
        template = tcfg.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        return cls(
            hf,
            token_bytes,
            special_ids,
            bos_id,
            eos_ids,
            bool(tcfg.get("add_bos_token", False)),
            template,
            bos_t,
            eos_t,
        )

    # --- use ---------------------------------------------------------------------------------------

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Special tokens written in the text are parsed as tokens; BOS per model unless told."""
        # encode_batch releases the GIL while it runs (encode holds it: a second per MB of text, when no other
        # thread, the gateway's event loop included, may run); same ids, same speed.
        ids = self.hf.encode_batch([text], add_special_tokens=False)[0].ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            if not ids or ids[0] != self.bos_id:
                ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return b"".join(self.token_bytes[i] for i in ids if not (skip_special_tokens and i in self.special_ids)).decode(
            "utf-8", errors="replace"
        )

    def token_text(self, token_id: int) -> str:
        """One token as text for logprobs (a partial UTF-8 byte shows as U+FFFD)."""
        return self.token_bytes[token_id].decode("utf-8", errors="replace")

    def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, skip_special_tokens)


class IncrementalDetokenizer:
    """Token ids in, complete UTF-8 text out: partial multi-byte characters wait for their tail."""

    def __init__(self, tok: Tokenizer, skip_special_tokens: bool = True):
        self.tok = tok
        self.skip = skip_special_tokens
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        if self.skip and token_id in self.tok.special_ids:
            return ""
        return self._dec.decode(self.tok.token_bytes[token_id])

    def push_many(self, ids: Sequence[int]) -> str:
        return "".join(self.push(i) for i in ids)

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)
