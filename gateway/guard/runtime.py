"""The process's guard: the loaded classifier (one model or an ensemble), a micro-batcher per model, verdicts,
telemetry.

Loaded once (at startup when the base policy enables the guard, else on first use) and reloaded only when the
policy's `runtime` section changes. Verdicts are recorded on the current span (a `portcullis.guard` event with
`portcullis.guard.*` attributes: policy version, rule, result, score, category, provenance; under the project's
namespace, as the GenAI conventions have no guardrail attributes yet) and as Prometheus metrics.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
from opentelemetry import trace
from opentelemetry.util.types import AttributeValue
from prometheus_client import CollectorRegistry, Counter, Histogram

from gateway.config import usable_cores
from gateway.errors import GatewayError
from gateway.guard.batcher import MicroBatcher
from gateway.guard.scan import scan
from gateway.guard.score_cache import Key, ScoreCache, digest
from gateway.guard.spec import GuardRuntime as RuntimeSettings
from gateway.guard.spec import InjectionPolicy

if TYPE_CHECKING:  # the model module loads with the first policy that enables the guard
    from gateway.guard.ensemble import Cut, GuardEnsemble, Window

log = logging.getLogger(__name__)

HEADER = "x-portcullis-guard"
DEFAULT_THRESHOLD = 0.5
# Windows per call of a long scan on the CPU: int8 costs least per window in batches of 4-8 there, and more in
# larger ones (guard_models/README.md, "Long inputs"); a short request waits behind at most one round of such calls
LONG_BATCH_CPU = 8


class _NoReuse:
    """A scan whose scores are neither looked up nor kept (generated text, evaluation)."""


NO_REUSE = _NoReuse()
Tenant = str | None | _NoReuse


@dataclass(slots=True)
class Verdict:
    """One guard decision about one request or response."""

    target: str  # "input" | "output"
    category: str  # "prompt_injection" | "pii" | "secret"
    rule: str  # the policy rule id, e.g. "guard.injection", "guard.secret.aws_access_key"
    result: str  # "block" | "flag" | "monitor" | "redact" | "pass"
    score: float | None = None
    threshold: float | None = None
    types: list[str] = field(default_factory=list)
    where: str | None = None  # e.g. "messages[2]"
    provenance: str | None = None  # the input text's (gateway/apis/inventory.py); None: an answer's, or all scanned

    @property
    def source(self) -> str:
        """Where the judged text came from: an input provenance, `output` for the answer, `any` for a verdict on
        everything scanned (the classifier's `pass`)."""
        return self.provenance or ("output" if self.target == "output" else "any")

    def as_dict(self) -> dict:
        out: dict[str, object] = {
            "target": self.target,
            "category": self.category,
            "rule": self.rule,
            "result": self.result,
        }
        if self.score is not None:
            out["score"] = round(self.score, 4)
            out["threshold"] = self.threshold
        if self.types:
            out["types"] = self.types
        if self.where:
            out["where"] = self.where
        return out

    def header(self) -> str:
        parts = [f"category={self.category}", f"rule={self.rule}", f"result={self.result}"]
        if self.score is not None:
            parts.append(f"score={self.score:.4f}")
        return "; ".join(parts)


class GuardBlocked(GatewayError):
    """A refusal that carries the guard's verdict; OpenAI-shaped, with a `guard` object beside `error`'s fields."""

    def __init__(self, verdict: Verdict, policy_version: str, request_id: str) -> None:
        what = "prompt" if verdict.target == "input" else "response"
        score = f", score {verdict.score:.3f} >= {verdict.threshold}" if verdict.score is not None else ""
        types = f" ({', '.join(verdict.types)})" if verdict.types else ""
        super().__init__(
            400 if verdict.target == "input" else 502,
            f"{what} blocked by the guard: {verdict.category}{types}{score}; rule {verdict.rule} "
            f"(request id {request_id})",
            type="invalid_request_error" if verdict.target == "input" else "guard_error",
            code="prompt_blocked" if verdict.target == "input" else "response_blocked",
            param=verdict.rule,
        )
        self.verdict = verdict
        self.policy_version = policy_version

    def body(self) -> dict:
        body = super().body()
        body["error"]["guard"] = {**self.verdict.as_dict(), "policy": self.policy_version}
        return body


class ScanTooLong(GatewayError):
    """Input longer than the policy lets the classifier scan: refused whole, since scanning part of it would let an
    attack hide in the part left out."""

    def __init__(self, tokens: int, limit: int) -> None:
        super().__init__(
            413,
            f"the guard scans at most {limit} tokens of text per request, and this request's scanned text holds "
            f"{tokens}: send less text",
            code="prompt_too_long_to_scan",
            param="guard.injection.max_tokens",
        )


@dataclass(frozen=True)
class Classifier:
    """The loaded model with one micro-batcher per member, replaced as one on reload and carried by the windows made
    with it, so that a scan never pairs one model's tokens with another's batchers."""

    model: GuardEnsemble
    batchers: list[MicroBatcher]
    settings: RuntimeSettings
    known: ScoreCache  # scores of texts this model has read, for texts that come back (see score_cache.py)

    async def retire(self) -> None:
        for batcher in self.batchers:
            await batcher.retire()


@dataclass(frozen=True)
class Windows:
    """A scan's windows (gateway/guard/ensemble.py, `Cut`) and the classifier they are for.

    A scan that may reuse scores carries each text's cache key and known score: its windows then cover only the
    texts without one (`items` index those), and their scores are kept once read."""

    classifier: Classifier
    cut: Cut
    keys: list[Key] | None = None
    known: list[float | None] | None = None

    @property
    def items(self) -> list[Window]:
        return self.cut.items


class Guard:
    """The classifier (lazily loaded), its batchers and the guard's metrics."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        registry = registry or CollectorRegistry()
        self.verdicts = Counter(
            "portcullis_guard_verdicts",
            "Guard decisions by target, category, result and the provenance of the text judged",
            ["target", "category", "result", "provenance"],
            registry=registry,
        )
        self.scores = Histogram(
            "portcullis_guard_score",
            "Classifier score (the highest of the scanned texts') per scan",
            ["target"],
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0),
            registry=registry,
        )
        self.batch_size = Histogram(
            "portcullis_guard_batch_size",
            "Windows per classifier call",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128),
            registry=registry,
        )
        self.batch_seconds = Histogram(
            "portcullis_guard_batch_seconds",
            "Classifier call duration",
            buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0),
            registry=registry,
        )
        self.reused = Counter(
            "portcullis_guard_score_reuse",
            "Request texts whose classifier score was known from an earlier scan of the same tenant (hit) or not",
            ["result"],
            registry=registry,
        )
        self._classifier: Classifier | None = None
        self._retired: list[Classifier] = []  # replaced by a reload; closed once their queues are scored
        self._closing: set[asyncio.Task] = set()
        self._load_lock = threading.Lock()

    @property
    def model(self) -> GuardEnsemble | None:
        return self._classifier.model if self._classifier else None

    @property
    def largest_batch(self) -> int:
        """The most windows one classifier call has taken so far (benchmarks read it)."""
        batchers = self._classifier.batchers if self._classifier else []
        return max((batcher.stats.largest for batcher in batchers), default=0)

    def _loaded(self) -> Classifier:
        """The classifier that scanning needs `load` or `ensure` to have made."""
        if self._classifier is None:
            raise RuntimeError("the guard model is not loaded: call load() or ensure() first")
        return self._classifier

    def load(self, settings: RuntimeSettings) -> GuardEnsemble:
        """Load (or reload, when the settings changed) the model; blocking, so call it off the event loop."""
        with self._load_lock:
            if self._classifier is not None and self._classifier.settings == settings:
                return self._classifier.model
            from gateway.guard.ensemble import load_guard

            started = time.perf_counter()
            model = load_guard(
                settings.model, device=settings.device, precision=settings.precision, threads=settings.threads
            )
            for member in model.scanners:  # first run allocates; not a request's cost
                member.margins([member.encode_windows("warm up")[0]])
            long_batch = settings.long_batch or (settings.max_batch if model.device == "cuda" else LONG_BATCH_CPU)
            batchers = [
                MicroBatcher(
                    member.margins,
                    max_batch=settings.max_batch,
                    max_wait_us=settings.max_wait_us,
                    long_batch=long_batch,
                    threads=member.threads,
                    long_calls=1 if model.device == "cuda" else max(1, usable_cores() // member.threads),
                    on_batch=self._observe_batch,
                )
                for member in model.scanners
            ]
            if self._classifier is not None:
                self._retired.append(self._classifier)
            self._classifier = Classifier(model, batchers, settings, ScoreCache(settings.score_cache))
            log.info("guard model ready in %.2fs on %s", time.perf_counter() - started, model.providers[0])
            return model

    async def ensure(self, settings: RuntimeSettings) -> GuardEnsemble:
        if self._classifier is not None and self._classifier.settings == settings:
            return self._classifier.model
        model = await asyncio.to_thread(self.load, settings)
        while self._retired:
            task = asyncio.create_task(self._retired.pop().retire())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        return model

    def _observe_batch(self, size: int, width: int, seconds: float) -> None:
        self.batch_size.observe(size)
        self.batch_seconds.observe(seconds)

    def threshold(self, policy: InjectionPolicy, given: float | None = None) -> float:
        """`given` (a provenance's own), else the policy's, else the model card's."""
        if given is not None:
            return given
        if policy.threshold is not None:
            return policy.threshold
        model_threshold = self._classifier.model.threshold if self._classifier else None
        return float(model_threshold) if model_threshold is not None else DEFAULT_THRESHOLD

    def windows(
        self, texts: list[str], policy: InjectionPolicy, max_tokens: int | None = None, *, tenant: Tenant = NO_REUSE
    ) -> Windows:
        """Every window of every text, in each model's tokens; blocking (tokenizing), so big inputs belong on a worker
        thread. Texts holding more than `max_tokens` of a model's tokens raise ScanTooLong: a text is scanned whole
        or not served. Given a tenant (None included), texts whose score that tenant's scans already read get no
        windows."""
        from gateway.guard.ensemble import TooManyTokens

        classifier = self._loaded()
        keys = known = None
        if not isinstance(tenant, _NoReuse) and classifier.known.entries:
            reading = (policy.window, policy.overlap, policy.first_pass_above)
            keys = [(tenant, *reading, digest(text)) for text in texts]
            known = classifier.known.lookup(keys)
            hits = sum(score is not None for score in known)
            self.reused.labels(result="hit").inc(hits)
            self.reused.labels(result="miss").inc(len(texts) - hits)
            texts = [text for text, score in zip(texts, known) if score is None]
        try:
            cut = classifier.model.windows(texts, policy.window, policy.overlap, max_tokens, policy.first_pass_above)
        except TooManyTokens as exc:
            raise ScanTooLong(exc.needed, max_tokens or 0) from None
        return Windows(classifier, cut, keys, known)

    async def score(self, windows: Windows, target: str = "input") -> tuple[float, int]:
        """(highest text score, index of the text that has it); (0, -1) for no windows. See `text_scores`."""
        scores = await self.text_scores(windows, target)
        if not scores:
            return 0.0, -1
        best = int(np.argmax(scores))
        return scores[best], best

    async def text_scores(
        self,
        windows: Windows,
        target: str = "input",
        budget: float | None = None,
        blocks: Sequence[float | None] = (),
    ) -> list[float]:
        """Each text's score (its windows' blend), each model's windows through its own micro-batcher, the models
        at once (scores known from earlier scans reused); [] for no texts. The windows are scored by the classifier
        that made them, even when a reload replaced it since. `budget` and `blocks` bound the scan
        (gateway/guard/scan.py): a text known to block ends it before it begins, and the texts a scan stopped at a
        block did not read whole keep no score (theirs are lower bounds)."""
        if windows.known is None or windows.keys is None:
            scores, _ = await self._read_windows(windows, budget, blocks)
        elif any(at is not None and known is not None and known >= at for at, known in zip(blocks, windows.known)):
            scores = [0.0 if known is None else known for known in windows.known]  # refused already: nothing to read
        else:
            unread_blocks = [at for at, known in zip(blocks, windows.known) if known is None] if blocks else ()
            fresh, whole = await self._read_windows(windows, budget, unread_blocks)
            read = iter(fresh)
            scores = [next(read) if known is None else known for known in windows.known]
            unread = [key for key, known in zip(windows.keys, windows.known) if known is None]
            # a text a scan stopped before reading whole has a lower bound, not its score to keep
            kept = [(key, score) for key, score, read_whole in zip(unread, fresh, whole) if read_whole]
            windows.classifier.known.store([key for key, _ in kept], [score for _, score in kept])
        if scores:
            self.scores.labels(target=target).observe(max(scores))
        return scores

    async def _read_windows(
        self, windows: Windows, budget: float | None, blocks: Sequence[float | None]
    ) -> tuple[list[float], list[bool]]:
        """The classifier's score of each text the windows cover, and whether it read each whole (see `scan`)."""
        if not windows.items:
            return [], []
        classifier = windows.classifier
        return await scan(classifier.model, classifier.batchers, windows.cut, budget, blocks)

    async def classify(
        self, texts: list[str], policy: InjectionPolicy, settings: RuntimeSettings, target: str = "input"
    ) -> tuple[float, int]:
        """Every window of these texts scored (tokenized on a worker thread); see `score`."""
        await self.ensure(settings)
        if not any(texts):
            return 0.0, -1
        return await self.score(await asyncio.to_thread(self.windows, texts, policy), target)

    def record(self, verdict: Verdict, policy_version: str) -> None:
        """The guard event on the current span, and the verdict counter."""
        self.verdicts.labels(
            target=verdict.target, category=verdict.category, result=verdict.result, provenance=verdict.source
        ).inc()
        span = trace.get_current_span()
        if not span.is_recording():
            return
        attributes: dict[str, AttributeValue] = {
            "portcullis.guard.policy_version": policy_version,
            "portcullis.guard.rule": verdict.rule,
            "portcullis.guard.result": verdict.result,
            "portcullis.guard.category": verdict.category,
            "portcullis.guard.target": verdict.target,
            "portcullis.guard.provenance": verdict.source,
        }
        if verdict.score is not None:
            attributes["portcullis.guard.score"] = verdict.score
        if verdict.types:
            attributes["portcullis.guard.types"] = verdict.types
        span.add_event("portcullis.guard", attributes)
        for key, value in attributes.items():
            span.set_attribute(key, value)

    async def aclose(self) -> None:
        while self._retired:
            await self._retired.pop().retire()
        await asyncio.gather(*self._closing)
        for batcher in self._classifier.batchers if self._classifier else []:
            await batcher.aclose()
