"""Hot reload of the policy directory: on file changes (watchfiles) or SIGHUP the whole set is re-read and
re-validated off the event loop, then swapped in with one assignment. An invalid edit leaves the running policy in
place; the error (file, line, rule id) is logged and shown by /admin/policy. A WAF that would block every request is
such an error (gateway/waf/match_all.py); rules that merely match every request are logged as warnings."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Callable
from pathlib import Path

from gateway.file_identity import file_identity
from gateway.policy.loader import PolicyError, PolicySet, load_policy_dir

log = logging.getLogger(__name__)

MISSING_POLL = 0.5  # seconds between looks for a policy directory that was removed
WATCH_PASS_MS = 1000  # longest wait for changes before the watcher looks at the directory's identity again


class PolicyReloader:
    def __init__(
        self,
        directory: Path,
        install: Callable[[PolicySet], None],
        current: Callable[[], PolicySet],
        debounce_ms: int = 200,
    ) -> None:
        self.directory = directory
        self._install = install
        self._current = current
        self._debounce_ms = debounce_ms
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self.loaded_at = time.time()
        self.reloads = 0
        self.last_error: str | None = None
        self.last_error_at: float | None = None

    async def reload(self, reason: str) -> bool:
        async with self._lock:
            try:
                policies = await asyncio.to_thread(load_policy_dir, self.directory)
            except PolicyError as exc:
                self.last_error, self.last_error_at = str(exc), time.time()
                log.error("policy reload (%s) refused, still serving %s: %s", reason, self._current().version, exc)
                return False
            except Exception as exc:  # unreadable directory and the like: same rule, keep serving
                self.last_error, self.last_error_at = f"{type(exc).__name__}: {exc}", time.time()
                log.exception("policy reload (%s) failed, still serving %s", reason, self._current().version)
                return False
            previous = self._current().version
            self.last_error = None
            if policies.version != previous:
                self._install(policies)
                self.reloads += 1
                self.loaded_at = time.time()
                log.info("policy reloaded (%s): %s -> %s", reason, previous, policies.version)
                log_policy_warnings(policies)
            return True

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(signal.SIGHUP, lambda: loop.create_task(self.reload("SIGHUP")))
        if self.directory.is_dir():
            self._task = loop.create_task(self._watch())

    async def _watch(self) -> None:
        """Reload on each change. The first pass of each watch, once it is in place, reads the directory again: an
        edit made before the watch began (at start, or right after a replacement) is seen by nothing else. A watch
        follows the directory's inode, not its path: once the directory is replaced (a new one renamed over it, or
        it is removed and made again) that watch would see nothing more, so the new one is watched anew. The
        periodic empty passes also catch a replacement whose rename the old watch never reported."""
        from watchfiles import awatch

        try:
            while (watched := await self._present()) is not None:
                started = False
                async for changes in awatch(
                    self.directory,
                    stop_event=self._stop,
                    debounce=self._debounce_ms,
                    step=50,
                    recursive=True,
                    rust_timeout=WATCH_PASS_MS,
                    yield_on_timeout=True,
                ):
                    if changes or not started:
                        await self.reload("file change" if changes else "watch started")
                    started = True
                    if file_identity(self.directory) != watched:
                        break
                else:
                    return  # stopped
        except Exception:
            log.exception("policy watcher stopped; SIGHUP still reloads")

    async def _present(self) -> tuple[int, int] | None:
        """The directory's identity once it exists; None if the reloader stops first."""
        while (identity := file_identity(self.directory)) is None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), MISSING_POLL)
            if self._stop.is_set():
                return None
        return identity

    async def stop(self) -> None:
        self._stop.set()
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task

    def status(self) -> dict[str, object]:
        return {
            "loaded_at": self.loaded_at,
            "reloads": self.reloads,
            "last_error": self.last_error,
            "last_error_at": self.last_error_at,
            "directory": str(self.directory),
        }


def log_policy_warnings(policies: PolicySet) -> None:
    """What `portcullis policy check` would warn about (rules that match every request), in the log of the gateway
    that now runs the policy."""
    for warning in policies.warnings:
        log.warning("policy %s: %s", policies.version, warning)
