"""Hot reload of the policy directory (gateway/reload/watcher.py watches it and answers SIGHUP): the whole set is
re-read and re-validated, then swapped in with one assignment. An invalid edit leaves the running policy in place; the
error (file, line, rule id) is logged and shown by /admin/policy. A WAF that would block every request is such an error
(gateway/waf/match_all.py); rules that merely match every request are logged as warnings."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

from prometheus_client import Counter

from gateway.policy.loader import PolicyError, PolicySet, load_policy_dir
from gateway.reload.watcher import Reloader

log = logging.getLogger(__name__)


class PolicyReloader(Reloader):
    what = "policy"
    refused = (PolicyError,)

    def __init__(
        self,
        directory: Path,
        install: Callable[[PolicySet], None],
        current: Callable[[], PolicySet],
        results: Counter | None = None,
        debounce_ms: int = 200,
    ) -> None:
        super().__init__(directory, results=results, debounce_ms=debounce_ms)
        self._install = install
        self._current = current

    async def _load_and_install(self) -> str | None:
        policies = await asyncio.to_thread(load_policy_dir, self.directory)
        previous = self._current().version
        if policies.version == previous:
            return None
        self._install(policies)
        log_policy_warnings(policies)
        return f"{previous} -> {policies.version}"

    def serving(self) -> str:
        return self._current().version

    def status(self) -> dict[str, object]:
        return {**super().status(), "directory": str(self.directory)}


def log_policy_warnings(policies: PolicySet) -> None:
    """What `portcullis policy check` would warn about (rules that match every request), in the log of the gateway
    that now runs the policy."""
    for warning in policies.warnings:
        log.warning("policy %s: %s", policies.version, warning)
