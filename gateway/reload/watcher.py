"""Hot reload of what an operator edits while the gateway runs (the policy directory, portcullis.yaml): on a file
change (watchfiles) or SIGHUP the source is re-read and re-validated off the event loop, then swapped in at once. An
invalid edit leaves what runs in place; the error is logged and kept for the admin plane to show.

A watch follows a directory's inode, not its path, so one that is replaced (a new one renamed over it, or removed and
made again) is watched anew; a Kubernetes ConfigMap volume swaps its `..data` symlink, which the watch of the
directory holding it reports. A source that is one file watches the directory it is in, for changes to that name and
to the ConfigMap's `..`-names only: a change to any other file there (a SQLite store, a log the gateway writes)
is dropped before it is logged or reloads anything.

The watch looks for changes, and for a stop, every `WATCH_STEP_MS`: each look takes the GIL in watchfiles' thread,
so the step sets what an idle gateway spends on its watches, and a change is served within two steps and a reload.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path

from prometheus_client import Counter

from gateway.storage.file_identity import file_identity

log = logging.getLogger(__name__)

MISSING_POLL = 0.5  # seconds between looks for a watched directory that was removed
WATCH_STEP_MS = 250  # how often a watch looks for changes and for a stop
WATCH_PASS_MS = 1000  # longest wait for changes before the watcher looks at the directory's identity again


class Reloader(ABC):
    """Reloads one source; the subclass says how it is read and put in place."""

    what = "source"  # as the log names it
    refused: tuple[type[Exception], ...] = ()  # the errors that say the source is invalid, as a start would

    def __init__(
        self, directory: Path, *, only: str | None = None, results: Counter | None = None, debounce_ms: int = 200
    ) -> None:
        """`directory` is watched (recursively unless `only` names the one file in it that is the source);
        `results` counts reloads by result ('applied', 'unchanged', 'refused')."""
        self.directory = directory
        self._results = results
        self._only = only
        self._debounce_ms = debounce_ms
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self.loaded_at = time.time()
        self.reloads = 0
        self.last_error: str | None = None
        self.last_error_at: float | None = None

    @abstractmethod
    async def _load_and_install(self) -> str | None:
        """Read and validate the source, then put it in place; what changed (for the log), or None where nothing
        did. Raises one of `refused` (or any error) to leave what runs in place."""

    @abstractmethod
    def serving(self) -> str:
        """The version that runs now, as the log names it."""

    def _counted(self, result: str) -> None:
        if self._results is not None:
            self._results.labels(result=result).inc()

    async def reload(self, reason: str) -> bool:
        async with self._lock:
            try:
                changed = await self._load_and_install()
            except self.refused as exc:
                self._failed(str(exc))
                log.error("%s reload (%s) refused, still serving %s: %s", self.what, reason, self.serving(), exc)
                return False
            except Exception as exc:  # unreadable files and the like: same rule, keep serving
                self._failed(f"{type(exc).__name__}: {exc}")
                log.exception("%s reload (%s) failed, still serving %s", self.what, reason, self.serving())
                return False
            self.last_error = None
            if changed is None:
                self._counted("unchanged")
                return True
            self.reloads += 1
            self.loaded_at = time.time()
            self._counted("applied")
            log.info("%s reloaded (%s): %s", self.what, reason, changed)
            return True

    def _failed(self, error: str) -> None:
        self.last_error, self.last_error_at = error, time.time()
        self._counted("refused")

    def start(self) -> None:
        """Watch the source (SIGHUP is `reload_on_hangup`'s, for every reloader at once)."""
        if self.directory.is_dir():
            self._task = asyncio.get_running_loop().create_task(self._watch())

    def _is_source(self, _change: object, path: str) -> bool:
        """watchfiles' filter where the source is one file: that name and the ConfigMap's `..`-names."""
        name = Path(path).name
        return name == self._only or name.startswith("..")

    async def _watch(self) -> None:
        """Reload on each change. The first pass of each watch, once it is in place, reads the source again: an
        edit made before the watch began (at start, or right after a replacement) is seen by nothing else. Once the
        directory is replaced that watch would see nothing more, so the new one is watched anew; the periodic empty
        passes also catch a replacement whose rename the old watch never reported."""
        from watchfiles import DefaultFilter, awatch

        keeps = DefaultFilter() if self._only is None else self._is_source
        try:
            while (watched := await self._present()) is not None:
                started = False
                async for changes in awatch(
                    self.directory,
                    stop_event=self._stop,
                    watch_filter=keeps,
                    debounce=self._debounce_ms,
                    step=WATCH_STEP_MS,
                    recursive=self._only is None,
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
            log.exception("%s watcher stopped; SIGHUP still reloads", self.what)

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
        }


def reload_on_hangup(reloaders: Sequence[Reloader]) -> None:
    """SIGHUP reloads every source: a loop has one handler per signal."""
    loop = asyncio.get_running_loop()

    def hang_up() -> None:
        for reloader in reloaders:
            loop.create_task(reloader.reload("SIGHUP"))

    with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
        loop.add_signal_handler(signal.SIGHUP, hang_up)


def stop_reloading_on_hangup() -> None:
    with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
        asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
