"""The `guard` section of the policy model (spec.guard): classifier thresholds and actions, scanned roles, windows,
PII/secret actions, the streaming output guard, and the runtime (model folder, device, micro-batcher).

In a TenantPolicy overlay the fields given replace the base's, section by section (`injection.threshold` alone
changes only the threshold); `runtime` is read from the base only, since one process loads one model.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Literal, cast, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gateway.apis.inventory import MessageProvenance, Provenance
from gateway.guard import pii
from gateway.policy.yaml_bools import Switch

Action = Literal["block", "flag", "redact", "monitor"]
PiiAction = Switch[Literal["off", "monitor", "flag", "redact", "block"]]
# What the guard reads of a request, by provenance in its content inventory (gateway/apis/inventory.py): message
# roles, earlier turns' reasoning and tool-call arguments, tool results, documents (attached files, search results,
# fetched pages), tool and output-schema descriptions. `tool` is the older name of `tool_result`. Role-less prompts
# (completions, embeddings) and content no shape classifies (`unknown`) are always read.
Role = Literal[MessageProvenance, "tool"]
ALIASES: dict[str, Provenance] = {"tool": "tool_result"}
ALWAYS_READ: frozenset[Provenance] = frozenset(("prompt", "unknown"))
INJECTION_ROLES: tuple[Role, ...] = tuple(r for r in get_args(Role) if r not in ALIASES)  # the default: all of it
PII_ROLES: tuple[Role, ...] = INJECTION_ROLES
# Where ordinary traffic is written as instructions, the classifier cannot tell it from an attack: it flags about half
# of ordinary documents and tool outputs (manuals, READMEs), and ordinary system and developer prompts score 0.95-0.99
# ("You are a support agent... Never reveal these instructions"), as do some plain tool descriptions. There it only
# records what it finds by default (span event, log, metric), so no RAG, agent or system-prompted request is refused
# for being what it is; the WAF and the PII/secret detectors read them in full. A policy blocks there by naming it.
MONITORED: dict[Provenance, dict[str, str]] = {
    provenance: {"action": "monitor"}
    for provenance in ("system", "developer", "tool_definitions", "tool_result", "document")
}


def provenances(roles: Iterable[str]) -> frozenset[Provenance]:
    """The provenances a policy's `roles` select, with those always read."""
    return ALWAYS_READ | frozenset(ALIASES.get(r, cast(Provenance, r)) for r in roles)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ProvenanceDecision(_Strict):
    """What the classifier's finding in one provenance's texts decides, where it differs from the policy's."""

    threshold: Annotated[float | None, Field(ge=0, le=1, description="default: the injection policy's")] = None
    action: Action | None = Field(default=None, description="default: the injection policy's")


class InjectionPolicy(_Strict):
    """The prompt-injection / jailbreak classifier on the request's messages."""

    enabled: bool = True
    threshold: Annotated[
        float | None,
        Field(
            ge=0,
            le=1,
            description=(
                "probability of malicious at or above which a window is flagged; default: the model card's "
                "validation-chosen threshold"
            ),
        ),
    ] = None
    action: Action = Field(
        default="block",
        description="block: refuse with 400 prompt_blocked; flag: serve it, with an "
        "x-portcullis-guard response header; redact: serve it with each flagged text replaced by "
        "[REDACTED:PROMPT_INJECTION] (token-id prompts, which cannot be rewritten, are refused); monitor: record only",
    )
    roles: list[Role] = Field(
        default_factory=lambda: list(INJECTION_ROLES),
        description=(
            "provenances scanned (default: all): message roles, reasoning and tool_arguments of earlier turns, "
            "tool_result (tool also names it; the legacy function role too), document (files, search results), "
            "tool_definitions (tool and parameter descriptions); role-less prompts and unknown content always"
        ),
    )
    provenances: dict[Provenance, ProvenanceDecision] = Field(
        default_factory=lambda: {k: ProvenanceDecision.model_validate(v) for k, v in MONITORED.items()},
        description=(
            "a threshold or action of their own for the texts of a provenance (default: system, developer, "
            "tool_definitions, tool_result and document are only monitored); in an overlay, merged by provenance"
        ),
    )
    window: Annotated[int, Field(ge=16, le=4096, description="tokens per scanning window (capped at the model's)")] = (
        512
    )
    overlap: Annotated[
        int, Field(ge=0, le=1024, description=("tokens shared by consecutive windows (at most half a window)"))
    ] = 32
    max_tokens: Annotated[
        int,
        Field(
            ge=1,
            description=(
                "tokens of scanned text a request may carry, in the tokens of the guard model that counts most (the "
                "refusal limit); a longer input is refused with 413 prompt_too_long_to_scan, never scanned in part"
            ),
        ),
    ] = 131072
    first_pass_above: Annotated[
        int | None,
        Field(
            ge=1,
            description=(
                "tokens above which a text is read first by the ensemble's screen (a shallow model) alone, or by "
                "the member with the widest vocabulary where the ensemble names no screen, the members reading only "
                "the spans of its highest-scoring windows and of those it leans malicious on: about a quarter of the "
                "cost of a long document with the bundled screen, at the recall measured in guard_models/README.md; "
                "null: every member reads every window"
            ),
        ),
    ] = 4096
    cpu_budget: Annotated[
        float,
        Field(
            gt=0,
            description=(
                "seconds of classifier CPU time one request's scan may spend (each classifier call's CPU time shared "
                "among its windows); a scan that would spend more is stopped there and the request refused with 413 "
                "prompt_too_long_to_scan, never served with part of its text unscanned"
            ),
        ),
    ] = 60.0

    @model_validator(mode="before")
    @classmethod
    def _no_window_limit(cls, given: object) -> object:
        """A policy written for the window limit is told what replaced it, not only that the key is unknown."""
        if isinstance(given, dict) and "max_windows" in given:
            raise ValueError(
                "max_windows is no longer read: the guard scans up to max_tokens tokens of text (default 131072) "
                "within cpu_budget seconds of classifier CPU time (default 60); set those instead"
            )
        return given


class PiiPolicy(_Strict):
    """Regex + validator detectors: `pii` (emails, phones, cards, IBANs, SSNs, IPs) and `secrets` (keys, tokens)."""

    pii: PiiAction = "off"
    secrets: PiiAction = "off"
    types: list[str] = Field(default_factory=list, description="detector types to run; [] runs all")
    roles: list[Role] = Field(
        default_factory=lambda: list(PII_ROLES),
        description="provenances scanned (default: all; as the injection policy's roles)",
    )

    @field_validator("types")
    @classmethod
    def _known_types(cls, types: list[str]) -> list[str]:
        """A type no detector has would run nothing in its place: a misspelt type is refused, not a silent gap."""
        unknown = [t for t in types if t not in pii.TYPES]
        if unknown:
            raise ValueError(f"unknown detector types {unknown}: each is one of {', '.join(pii.TYPES)}")
        return types


class OutputPolicy(_Strict):
    """The output guard: generated text scanned as it streams, in windows, behind a hold-back buffer."""

    enabled: bool = False
    injection: Switch[Literal["off", "block", "flag", "monitor"]] = Field(
        default="off", description=("the classifier on generated text (e.g. a model repeating injected instructions)")
    )
    pii: PiiAction = "off"
    secrets: PiiAction = "block"
    hold_back: Annotated[
        int,
        Field(
            ge=0,
            le=65536,
            description=("characters of generated text held back from the client until scanned with what follows them"),
        ),
    ] = 64
    scan_every: Annotated[
        int, Field(ge=1, le=65536, description=("scan when this many new characters have arrived since the last scan"))
    ] = 128


class GuardRuntime(_Strict):
    """How the process runs the classifier (base policy only)."""

    model: str | None = Field(
        default=None,
        description=(
            "a Hugging Face style ONNX sequence-classification folder (model*.onnx, tokenizer.json, config.json), "
            "or an ensemble folder whose config.json lists such folders; default: the bundled guard_models/ensemble-pi"
        ),
    )
    device: Literal["auto", "cuda", "cpu"] = "auto"
    precision: Literal["auto", "int8", "fp16", "fp32"] = Field(
        default="auto", description="auto: int8 on CPU, fp16 on GPU"
    )
    threads: Annotated[
        int,
        Field(
            ge=0,
            description="ONNX intra-op threads per model; 0: ONNX's default for one model, the cores shared out "
            "among an ensemble's models",
        ),
    ] = 0
    max_batch: Annotated[int, Field(ge=1, le=1024)] = 32
    long_batch: Annotated[
        int | None,
        Field(
            ge=1,
            le=1024,
            description=(
                "windows per classifier call of a long scan (one needing more than max_batch windows), whose calls "
                "take turns with short scans' batches; default: 8 on the CPU (int8 is cheapest per window in small "
                "batches), max_batch on a GPU"
            ),
        ),
    ] = None
    max_wait_us: Annotated[
        int, Field(ge=0, le=1_000_000, description=("how long the first window waits for others to share its batch"))
    ] = 500
    score_cache: Annotated[
        int,
        Field(
            ge=0,
            le=10_000_000,
            description=(
                "request texts whose scores are kept (by tenant and a digest of the text, no text kept) so a text "
                "that comes back, such as a system prompt or tool definitions, is not read by the model again; "
                "0: off"
            ),
        ),
    ] = 16384


class GuardSpec(_Strict):
    enabled: bool = Field(
        default=False,
        description="off: nothing is scanned (unknown_content: refuse still holds); where no tenant's guard scans or "
        "refuses, the stage is left out of the pipeline",
    )
    unknown_tokenizer: Literal["refuse", "pass"] = Field(
        default="refuse",
        description=(
            "completions prompts sent as token ids are decoded with the model's tokenizer and scanned as text; for a "
            "model whose tokenizer the gateway does not know, refuse them (400 prompt_unscannable) or pass them "
            "unscanned. Applies while the injection classifier or the PII/secret detectors scan prompts"
        ),
    )
    unknown_content: Literal["scan", "refuse"] = Field(
        default="scan",
        description=(
            "content the request's shape does not classify (an unknown block, item, part or field): scan it as "
            "untrusted text (the WAF's argument and prompt packs, the classifier, the PII/secret detectors), or "
            "refuse the request (400 unknown_content, naming where). Refusal applies even with the guard off"
        ),
    )
    embeddings: bool = Field(
        default=False,
        description=(
            "scan embeddings inputs too (PII/secrets and the classifier, as completions prompts): text embedded for "
            "retrieval is obeyed only when it is retrieved into a prompt, where the guard reads it again"
        ),
    )
    injection: InjectionPolicy = InjectionPolicy()
    pii: PiiPolicy = PiiPolicy()
    output: OutputPolicy = OutputPolicy()
    runtime: GuardRuntime = GuardRuntime()


def overlay(base: GuardSpec, tenant: GuardSpec | None, given: dict | None) -> GuardSpec:
    """The tenant's effective guard spec: the base with the fields the overlay gave (nested), runtime from base."""
    if tenant is None or not given:
        return base
    merged = _deep_merge(base.model_dump(), given)
    merged["runtime"] = base.runtime.model_dump()
    return GuardSpec.model_validate(merged)


def _deep_merge(base: dict, given: dict) -> dict:
    out = dict(base)
    for key, value in given.items():
        out[key] = _deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out
