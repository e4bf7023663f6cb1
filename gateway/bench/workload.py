"""Deterministic request sequences for `portcullis bench serve`.

Everything a run sends is fixed by the seed before the first request goes out: prompt text, tenants, the order of
requests and (with a request rate) their arrival times. Text comes from per-entity RNGs (one per tenant system
prompt, one per conversation turn), so growing --num-requests appends requests without changing earlier ones.
The one thing a plan cannot fix is a multi-turn conversation's assistant replies: the runner fills those in with
the text the target actually returned.

Prompt lengths are targeted in tokens: every word of WORDS is a single token, with its leading space, for
GPT-2-style byte-level BPE vocabularies (SmolLM2, Llama 3, GPT-2), so N words is about N tokens.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

WORDS = tuple(
    """
time year people way day man thing woman life child world school state family student group country problem hand
part place case week company system program question work government number night point home water room mother area
money story fact month lot right study book eye job word business issue side kind head house service friend father
power hour game line end member law car city community name president team minute idea kid body information back
parent face others level office door health person art war history party result change morning reason research girl
guy moment air teacher force education foot boy age policy process music market sense nation plan college interest
death experience effect use class control care field development role effort rate heart drug show leader light voice
wife police mind price report decision son view relationship town road arm difference value building action model
season society tax director position player record paper space ground form event official matter center couple site
project activity star table need court oil situation cost industry figure street image phase stock river garden
bridge window forest stone cloud signal engine
""".split()
)

WORKLOADS = ("random", "shared-prefix")


@dataclass(frozen=True)
class WorkloadSpec:
    """What to generate; the CLI's workload options."""

    workload: str = "random"
    num_requests: int | None = None  # default: 100 (random) or conversations x turns (shared-prefix)
    seed: int = 0
    # random
    input_len: int = 256  # prompt tokens (approximately)
    range_ratio: float = 0.0  # input length drawn uniformly from input_len * [1 - r, 1 + r]
    # shared-prefix
    tenants: int = 8
    system_prompt_len: int = 1000  # tokens per tenant system prompt
    conversations: int = 32  # conversations in flight; a finished one is replaced by a new one
    turns: int = 4  # user turns per conversation
    user_len: int = 64  # tokens per user message
    hot_tenant_share: float | None = None  # fraction of conversations that go to tenant 0 (None: round robin)
    # timing
    request_rate: float | None = None  # Poisson arrivals, requests/s; None: all at t=0 (concurrency-bound)

    def __post_init__(self) -> None:
        if self.workload not in WORKLOADS:
            raise ValueError(f"unknown workload {self.workload!r}; choose from {', '.join(WORKLOADS)}")
        positive = {
            "tenants": self.tenants,
            "conversations": self.conversations,
            "turns": self.turns,
            "input_len": self.input_len,
            "user_len": self.user_len,
        }
        for name, value in positive.items():
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.system_prompt_len < 0:
            raise ValueError("system_prompt_len must be >= 0")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError("num_requests must be >= 1")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError("range_ratio must be in [0, 1)")
        if self.hot_tenant_share is not None and not 0.0 <= self.hot_tenant_share <= 1.0:
            raise ValueError("hot_tenant_share must be in [0, 1]")
        if self.request_rate is not None and self.request_rate <= 0:
            raise ValueError("request_rate must be > 0")

    @property
    def total_requests(self) -> int:
        if self.num_requests is not None:
            return self.num_requests
        return 100 if self.workload == "random" else self.conversations * self.turns


@dataclass(frozen=True)
class PlannedRequest:
    """One request of the plan. Its messages are system (if any) + earlier turns with their replies + `user`."""

    index: int  # position in the plan (dispatch order)
    arrival_s: float  # earliest send time, seconds after the run starts
    tenant: int
    conversation: int
    turn: int  # 0-based; turn > 0 waits for turn - 1 of the same conversation to finish
    system: str | None
    user: str


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def system_prompt(seed: int, tenant: int, length: int) -> str:
    rng = random.Random(f"portcullis-bench:{seed}:system:{tenant}")
    return words(rng, length)


def _user_message(seed: int, conversation: int, turn: int, length: int) -> str:
    rng = random.Random(f"portcullis-bench:{seed}:user:{conversation}:{turn}")
    return words(rng, length)


def arrival_times(seed: int, n: int, rate: float | None) -> list[float]:
    """Poisson process at `rate` requests/s (first request at 0); all zeros without a rate."""
    if rate is None:
        return [0.0] * n
    rng = random.Random(f"portcullis-bench:{seed}:arrivals")
    times, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        times.append(t)
    return times


def build_plan(spec: WorkloadSpec) -> list[PlannedRequest]:
    n = spec.total_requests
    arrivals = arrival_times(spec.seed, n, spec.request_rate)
    if spec.workload == "random":
        return _random_plan(spec, n, arrivals)
    return _shared_prefix_plan(spec, n, arrivals)


def _random_plan(spec: WorkloadSpec, n: int, arrivals: list[float]) -> list[PlannedRequest]:
    plan = []
    for i in range(n):
        rng = random.Random(f"portcullis-bench:{spec.seed}:random:{i}")
        low = max(1, round(spec.input_len * (1 - spec.range_ratio)))
        high = max(low, round(spec.input_len * (1 + spec.range_ratio)))
        length = rng.randint(low, high)
        # a per-request number first, so two random prompts never share a leading block by chance
        plan.append(PlannedRequest(i, arrivals[i], i % spec.tenants, i, 0, None, f"{i}: " + words(rng, length - 1)))
    return plan


def _shared_prefix_plan(spec: WorkloadSpec, n: int, arrivals: list[float]) -> list[PlannedRequest]:
    """`conversations` slots visited round robin in a seeded order; a conversation that has had all its turns is
    replaced in its slot by a new one, so consecutive turns of one conversation are `conversations` requests apart.
    """
    systems = [
        system_prompt(spec.seed, t, spec.system_prompt_len) if spec.system_prompt_len else None
        for t in range(spec.tenants)
    ]
    tenant_rng = random.Random(f"portcullis-bench:{spec.seed}:tenants")
    next_id = 0

    def new_conversation() -> list[int]:  # [conversation id, tenant, next turn]
        nonlocal next_id
        cid, next_id = next_id, next_id + 1
        if spec.hot_tenant_share is None or spec.tenants == 1:
            tenant = cid % spec.tenants
        elif tenant_rng.random() < spec.hot_tenant_share:
            tenant = 0
        else:
            tenant = tenant_rng.randrange(1, spec.tenants)
        return [cid, tenant, 0]

    slots = [new_conversation() for _ in range(min(spec.conversations, n))]
    order = list(range(len(slots)))
    random.Random(f"portcullis-bench:{spec.seed}:order").shuffle(order)
    plan: list[PlannedRequest] = []
    while len(plan) < n:
        for s in order:
            if len(plan) == n:
                break
            cid, tenant, turn = slots[s]
            user = f"Question {turn + 1}: " + _user_message(spec.seed, cid, turn, spec.user_len)
            plan.append(PlannedRequest(len(plan), arrivals[len(plan)], tenant, cid, turn, systems[tenant], user))
            slots[s] = new_conversation() if turn + 1 == spec.turns else [cid, tenant, turn + 1]
    return plan
