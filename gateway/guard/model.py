"""The guard classifier: any Hugging Face style ONNX sequence-classification folder, run by ONNX Runtime.

A model folder holds `model.onnx` (or `model_int8.onnx` / `model_fp16.onnx`), `tokenizer.json` and `config.json`
with `id2label`. Llama Prompt Guard 2 and ProtectAI's ONNX exports load the same way as our own model: the score
is the probability mass of the labels that are not benign (`BENIGN`, `SAFE`, `LABEL_0`, ...), unless the folder's
`config.json` names its malicious labels in `portcullis.malicious_labels`.

Execution providers are chosen once, at load: CUDA when a GPU and CUDA's runtime are really there, else CPU. No
per-request warnings: a missing CUDA is a fact logged once, not an error.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from gateway.config import usable_cores

if TYPE_CHECKING:  # both load with the model, not with the gateway
    import onnxruntime as ort
    from tokenizers import Tokenizer

log = logging.getLogger(__name__)

BENIGN_NAMES = {"benign", "safe", "label_0", "legit", "legitimate", "negative", "clean", "0"}
# The repository's guard_models/ (editable installs), or wherever PORTCULLIS_GUARD_MODELS points (the image).
MODELS_DIR = Path(os.environ.get("PORTCULLIS_GUARD_MODELS", Path(__file__).resolve().parents[2] / "guard_models"))
# The bundled guard: an ensemble folder (gateway/guard/ensemble.py) over the English and the multilingual model
DEFAULT_MODEL_DIR = MODELS_DIR / "ensemble-pi"


class GuardModelError(Exception):
    """A model folder that cannot be loaded; the message says what is missing."""


def cuda_device_count() -> int:
    """GPUs the CUDA driver sees (0 without a driver); cheap and silent, unlike a failed CUDA session."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


INT8_FILES = ["model_int8.onnx", "model_quantized.onnx"]  # dynamically quantized: what token_quant.py rewrites


def choose_file(folder: Path, device: str, precision: str = "auto") -> Path:
    """Pick the ONNX file: int8 on CPU, fp16 on GPU when present, else model.onnx; an explicit precision wins."""
    names = {"int8": INT8_FILES, "fp16": ["model_fp16.onnx"], "fp32": ["model.onnx"]}
    if precision != "auto":
        order = names[precision]
    elif device == "cuda":
        order = names["fp16"] + names["fp32"] + names["int8"]
    else:
        order = names["int8"] + names["fp32"] + names["fp16"]
    for name in order:
        for candidate in (folder / name, folder / "onnx" / name):
            if candidate.is_file():
                return candidate
    raise GuardModelError(f"{folder}: no ONNX model ({', '.join(order)})")


@dataclass
class GuardModel:
    """One loaded classifier. `margins(batch)` and the encoders are thread-safe (ONNX Runtime sessions and tokenizers
    allow concurrent calls)."""

    folder: Path
    path: Path
    session: ort.InferenceSession
    tokenizer: Tokenizer  # no padding, no truncation
    specials: tuple[list[int], list[int]]  # what the tokenizer puts before and after a text
    labels: dict[int, str]
    malicious: list[int]
    max_length: int
    pad_id: int
    input_names: list[str]
    providers: list[str]
    threshold: float | None = None  # the model card's threshold, if the folder has one
    calibration: tuple[float, float] = (1.0, 0.0)  # Platt scale and bias on the logit margin; (1, 0): softmax as is
    name: str = ""

    @property
    def threads(self) -> int:
        """The session's intra-op threads (ONNX's default, 0, is one per core)."""
        return self.session.get_session_options().intra_op_num_threads or usable_cores()

    @property
    def device(self) -> str:
        return "cuda" if self.providers and self.providers[0] == "CUDAExecutionProvider" else "cpu"

    def encode_windows(self, text: str, window: int | None = None, stride: int = 32) -> list[list[int]]:
        return self.encode_windows_batch([text], window, stride)[0]

    def encode_windows_batch(
        self, texts: list[str], window: int | None = None, stride: int = 32
    ) -> list[list[list[int]]]:
        """Token ids of each text in overlapping windows of at most `window` tokens (special tokens included).

        Consecutive windows share `stride` tokens, so an attack split across a boundary is whole in one of them, and
        the end of a long prompt is always scanned. They are the windows of the tokenizer's own truncation with a
        stride (what the model was trained and cross-validated on), cut from one encoding of each text: a tokenizer
        copy per window setting would cost ~250 MB for a 250k-piece vocabulary.
        """
        encodings = self.tokenizer.encode_batch(texts, add_special_tokens=False)
        return [self.cut_windows(e.ids, window, stride) for e in encodings]

    def cut_windows(self, ids: list[int], window: int | None = None, stride: int = 32) -> list[list[int]]:
        """One text's token ids (without special tokens) in the windows `encode_windows_batch` describes."""
        before, after = self.specials
        return [before + ids[start:end] + after for start, end in self.window_ranges(len(ids), window, stride)]

    def window_ranges(self, tokens: int, window: int | None = None, stride: int = 32) -> list[tuple[int, int]]:
        """The [start, end) token ranges of a text of `tokens` tokens' windows (special tokens not counted)."""
        window = min(window or self.max_length, self.max_length)
        before, after = self.specials
        stride = max(0, min(stride, window // 2))
        return cut(tokens, window - len(before) - len(after), stride)

    def margins(self, batch: list[list[int]]) -> np.ndarray:
        """The uncalibrated logit margin of each window (what an ensemble blends before its own calibration)."""
        if not batch:
            return np.zeros(0, dtype=np.float32)
        width = max(len(ids) for ids in batch)
        input_ids = np.full((len(batch), width), self.pad_id, dtype=np.int64)
        mask = np.zeros((len(batch), width), dtype=np.int64)
        for row, ids in enumerate(batch):
            input_ids[row, : len(ids)] = ids
            mask[row, : len(ids)] = 1
        feeds = {"input_ids": input_ids, "attention_mask": mask}
        if "token_type_ids" in self.input_names:
            feeds["token_type_ids"] = np.zeros_like(input_ids)
        feeds = {k: v for k, v in feeds.items() if k in self.input_names}
        logits = self.session.run(None, feeds)[0].astype(np.float32)
        return malicious_margin(logits, self.malicious)


def cut(tokens: int, body: int, stride: int) -> list[tuple[int, int]]:
    """[start, end) ranges over `tokens` tokens of at most `body` each, each sharing `stride` with the one before,
    the last ending at the end: how the tokenizer's truncation with a stride cuts its overflow."""
    step = max(1, body - stride)
    ranges, start = [], 0
    while True:
        ranges.append((start, min(start + body, tokens)))
        if start + body >= tokens:
            return ranges
        start += step


def read_tokenizer(path: Path) -> Tokenizer:
    """A tokenizer.json as the guard encodes texts with it: whole, without padding or truncation (windows are cut
    from the one encoding)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


def special_tokens(tokenizer: Tokenizer) -> tuple[list[int], list[int]]:
    """The ids the tokenizer's template puts before and after one text ([CLS] ... [SEP], <s> ... </s>)."""
    core = tokenizer.encode("a", add_special_tokens=False).ids
    full = tokenizer.encode("a").ids
    at = next((i for i in range(len(full) - len(core) + 1) if full[i : i + len(core)] == core), 0)
    return full[:at], full[at + len(core) :]


def open_session(path: Path, options: ort.SessionOptions, providers: list[str]) -> ort.InferenceSession:
    """An ONNX Runtime session over `path`; a dynamically quantized int8 model gets its activations quantized per
    token first (token_quant.py: scores independent of batch-mates). The rewritten model goes through a temporary
    file rather than bytes: ONNX Runtime keeps a second copy of a model handed over as bytes (+64 MB resident for
    e5-pi, measured), not of one read from a file."""
    import onnx
    import onnxruntime as ort

    from gateway.guard.token_quant import per_token_activations

    if path.name not in INT8_FILES:  # fp16 / fp32 files: nothing to rewrite, so not parsed here at all
        return ort.InferenceSession(str(path), sess_options=options, providers=providers)
    model = onnx.load(str(path))
    try:
        replaced = per_token_activations(model)
    except ValueError as exc:
        raise GuardModelError(f"{path}: {exc}") from exc
    if replaced == 0:
        del model
        return ort.InferenceSession(str(path), sess_options=options, providers=providers)
    try:
        with tempfile.TemporaryDirectory(prefix="portcullis-guard-") as folder:
            rewritten = Path(folder) / path.name
            onnx.save(model, str(rewritten))
            return ort.InferenceSession(str(rewritten), sess_options=options, providers=providers)
    except OSError as exc:  # no writable temporary folder: serve anyway, with the second copy in memory
        log.warning("guard: %s (%s); loading the rewritten model from memory", exc, path.name)
        return ort.InferenceSession(model.SerializeToString(), sess_options=options, providers=providers)


def malicious_margin(logits: np.ndarray, malicious: list[int]) -> np.ndarray:
    """log P(malicious) - log P(benign) per row: the logit the calibration scales. With no calibration its sigmoid
    is the softmax mass of the malicious labels, so uncalibrated third-party models score exactly as before."""
    benign = [i for i in range(logits.shape[1]) if i not in malicious]
    return np.logaddexp.reduce(logits[:, malicious], axis=1) - np.logaddexp.reduce(logits[:, benign], axis=1)


def load_model(
    folder: str | Path,
    *,
    device: str = "auto",
    precision: str = "auto",
    threads: int = 0,
    tokenizers: dict[Path, Tokenizer] | None = None,
) -> GuardModel:
    """Load one model folder (`load_guard` loads ensembles too). device: auto | cuda | cpu; threads: ONNX intra-op
    threads (0: ONNX's default). `tokenizers`: the ones loaded already, by their file's real path, to share (a
    250k-piece vocabulary takes ~280 MB) between models of one ensemble whose tokenizer.json is the same file."""
    import onnxruntime as ort

    folder = Path(folder)
    for name in ("tokenizer.json", "config.json"):
        if not (folder / name).is_file():
            raise GuardModelError(
                f"{folder}: {name} is missing (a guard model folder needs model*.onnx, "
                "tokenizer.json and config.json with id2label)"
            )
    config = json.loads((folder / "config.json").read_text())
    labels = {int(k): str(v) for k, v in (config.get("id2label") or {}).items()}
    if len(labels) < 2:
        raise GuardModelError(f"{folder}/config.json: id2label must name at least two labels")
    extra = config.get("portcullis") or {}
    wanted = {str(x).lower() for x in extra.get("malicious_labels", [])}
    malicious = sorted(
        i for i, name in labels.items() if (name.lower() in wanted if wanted else name.lower() not in BENIGN_NAMES)
    )
    if not malicious or len(malicious) == len(labels):
        raise GuardModelError(
            f"{folder}/config.json: cannot tell malicious from benign labels in {labels}; "
            "set portcullis.malicious_labels"
        )

    gpus = cuda_device_count() if device in ("auto", "cuda") else 0
    use_cuda = gpus > 0 and "CUDAExecutionProvider" in ort.get_available_providers()
    if device == "cuda" and not use_cuda:
        raise GuardModelError("device cuda asked for, but no GPU or no CUDA provider is available")
    path = choose_file(folder, "cuda" if use_cuda else "cpu", precision)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # no busy-waiting between runs: the gateway's event loop shares these cores, and spinning threads starve it
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.add_session_config_entry("session.inter_op.allow_spinning", "0")
    if threads:
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
    providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if use_cuda else ["CPUExecutionProvider"]
    try:
        session = open_session(path, options, providers)
    except Exception as exc:
        if not use_cuda:
            raise GuardModelError(f"{path}: ONNX Runtime cannot load it: {exc}") from exc
        log.warning("guard: CUDA session failed (%s); using the CPU", exc)
        path = choose_file(folder, "cpu", precision)
        session = open_session(path, options, ["CPUExecutionProvider"])
    active = session.get_providers()
    if use_cuda and active[0] != "CUDAExecutionProvider":
        log.warning("guard: CUDA provider did not start; running on %s", active[0])

    tokenizer_file = (folder / "tokenizer.json").resolve()
    tokenizer = (tokenizers or {}).get(tokenizer_file)
    if tokenizer is None:
        tokenizer = read_tokenizer(tokenizer_file)
        if tokenizers is not None:
            tokenizers[tokenizer_file] = tokenizer
    max_length = int(extra.get("max_length") or config.get("max_position_embeddings") or 512)
    tok_config = folder / "tokenizer_config.json"
    if tok_config.is_file():
        limit = json.loads(tok_config.read_text()).get("model_max_length")
        if isinstance(limit, int) and 0 < limit < max_length:
            max_length = limit
    pad_id = config.get("pad_token_id")
    if pad_id is None:
        pad_id = tokenizer.token_to_id("[PAD]") or tokenizer.token_to_id("<pad>") or 0
    model = GuardModel(
        folder=folder,
        path=path,
        session=session,
        tokenizer=tokenizer,
        specials=special_tokens(tokenizer),
        labels=labels,
        malicious=malicious,
        max_length=max_length,
        pad_id=int(pad_id),
        input_names=[i.name for i in session.get_inputs()],
        providers=active,
        threshold=extra.get("threshold"),
        calibration=calibration_of(extra, folder),
        name=str(extra.get("name") or folder.name),
    )
    log.info(
        "guard model %s (%s) on %s, max length %d, threads %s",
        model.name,
        path.name,
        active[0],
        max_length,
        threads or os.cpu_count(),
    )
    return model


def calibration_of(extra: dict, folder: Path) -> tuple[float, float]:
    """`portcullis.calibration` {"scale", "bias"} of config.json: Platt scaling fitted on held-out folds, so a
    threshold means the same probability across retrains."""
    calibration = extra.get("calibration") or {}
    try:
        scale, bias = float(calibration.get("scale", 1.0)), float(calibration.get("bias", 0.0))
    except (TypeError, ValueError, AttributeError):
        raise GuardModelError(f"{folder}/config.json: portcullis.calibration needs numbers scale and bias") from None
    if not scale > 0:
        raise GuardModelError(f"{folder}/config.json: portcullis.calibration.scale must be positive")
    return scale, bias
