"""One request's state as it moves waiting -> running -> finished (and back, if preempted)."""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

MAX_LOGIT_BIAS = 1024  # tokens one request may bias: each costs a step's sampling a little
# Every generated token is checked against each stop string and stop token id on the engine thread, which every
# running request waits on: a million stop strings made each step about ten times slower for all of them.
MAX_STOP_STRINGS = 64
MAX_STOP_TOKEN_IDS = 1024


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; k >= 0: chosen token + top-k alternatives
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit before sampling

    def validate(self, max_logprobs: int) -> None:
        """Raises ValueError with an OpenAI-style message for out-of-range values."""
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError("temperature must be a non-negative number")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < -1:
            raise ValueError("top_k must be -1 (off) or a positive integer")
        if self.seed is not None and self.seed < 0:  # numpy's generators refuse it, but only when the engine adds it
            raise ValueError("seed must be a non-negative integer")
        if self.logprobs is not None and not 0 <= self.logprobs <= max_logprobs:
            raise ValueError(f"logprobs must be between 0 and {max_logprobs}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop may hold at most {MAX_STOP_STRINGS} strings")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} token ids")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias may name at most {MAX_LOGIT_BIAS} tokens")
        if not all(math.isfinite(b) and -100 <= b <= 100 for b in self.logit_bias.values()):
            raise ValueError("logit_bias values must be numbers from -100 to 100")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), best first


@dataclass
class Sequence:
    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    token_ids: list[int] = field(default_factory=list)  # prompt + generated
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # hashes of full blocks, by index
    num_committed_blocks: int = 0  # leading blocks registered in the prefix cache
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_tokens: int = -1  # prefix-cache hit at first admission (-1: not admitted yet)
    num_preemptions: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    rng: np.random.Generator | None = None
    # timing, monotonic seconds
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    # text produced so far (stop strings are matched here); emitted_chars is what clients have seen
    output_text: str = ""
    emitted_chars: int = 0
    detokenizer: Any = None
    trace_context: Any = None  # OpenTelemetry context of the incoming request
    prefill_compute_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED
