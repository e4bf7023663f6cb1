"""The ordered stage runner: each stage is one module, one span, one latency histogram.

A stage passes by returning, rejects by raising `GatewayError`, and annotates through the context. New stages
(WAF, rate limits, admission, guard) slot in by being added to the list the app builds; no stage knows another.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

from opentelemetry.trace import Status, StatusCode, Tracer

from gateway.context import RequestContext
from gateway.errors import GatewayError
from gateway.telemetry import Metrics


class Stage(Protocol):
    name: str

    async def __call__(self, ctx: RequestContext) -> None: ...


class Pipeline:
    def __init__(self, stages: Sequence[Stage], tracer: Tracer, metrics: Metrics) -> None:
        self.stages = tuple(stages)
        self._tracer = tracer
        self._histograms = {s.name: metrics.stage_duration.labels(stage=s.name) for s in self.stages}

    async def run(self, ctx: RequestContext) -> None:
        traced = ctx.span.is_recording()  # an unsampled request records nothing: skip the span bookkeeping
        for stage in self.stages:
            started = time.perf_counter()
            try:
                if traced:
                    await self._run_traced(stage, ctx)
                else:
                    await stage(ctx)
            finally:
                self._histograms[stage.name].observe(time.perf_counter() - started)

    async def _run_traced(self, stage: Stage, ctx: RequestContext) -> None:
        with self._tracer.start_as_current_span(
            f"stage.{stage.name}", record_exception=False, set_status_on_exception=False
        ) as span:
            try:
                await stage(ctx)
            except GatewayError as err:
                span.set_status(Status(StatusCode.ERROR, err.message))
                span.set_attribute("portcullis.verdict", "reject")
                span.set_attribute("portcullis.reject.code", err.code or err.type)
                raise
