"""Reloading portcullis.yaml while the gateway runs (gateway/reload/watcher.py watches the file and answers SIGHUP).

What reloads: `pools` (added, removed, any setting of one, its upstream keys included), `models`, `fallbacks` and
`auth.keys`. The file is validated as a start validates it (gateway/config.py: each error names the file and key
path), the new fleet is built (gateway/fleet.py), then it and the static keys are swapped in at once.

Every other setting (listeners, workers, the admin plane, Redis, the stores, limits, telemetry...) is read once, at
start. A file that changes one of them is refused whole, each such key named, and the running config serves on: had
the rest been applied, the gateway would run a config no file holds, and a setting the operator tightened (a limit,
`trusted_proxies`) would seem applied while it is not. A restart applies the file.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import Counter

from gateway.config import ConfigError, GatewayConfig, format_key_path, load_config
from gateway.reload.watcher import Reloader

log = logging.getLogger(__name__)

# the key paths a reload applies; every other one needs a restart
RELOADABLE: frozenset[tuple[str, ...]] = frozenset({("pools",), ("models",), ("fallbacks",), ("auth", "keys")})


def config_version(config: GatewayConfig) -> str:
    """A short hash of the config as validated: the same for a file that changed only in comments or layout."""
    return hashlib.sha256(config.model_dump_json().encode()).hexdigest()[:12]


def needing_restart(running: GatewayConfig, loaded: GatewayConfig) -> list[str]:
    """The key paths `loaded` changes that only a restart applies."""
    return [format_key_path(path) for path in _changed(running.model_dump(), loaded.model_dump(), ())]


def _changed(running: Any, loaded: Any, path: tuple[str, ...]) -> Iterator[tuple[str, ...]]:
    if path in RELOADABLE or running == loaded:
        return
    if isinstance(running, dict) and isinstance(loaded, dict):
        for key in running.keys() | loaded.keys():
            yield from _changed(running.get(key), loaded.get(key), (*path, key))
    else:
        yield path


@dataclass(frozen=True)
class ConfigSource:
    """The file a running config came from, and what the start made of it (command-line overrides, a worker's
    share), which a reload makes of the file again."""

    path: Path
    prepare: Callable[[GatewayConfig], GatewayConfig]


class ConfigReloader(Reloader):
    what = "config"
    refused = (ConfigError,)

    def __init__(
        self,
        path: Path,
        prepare: Callable[[GatewayConfig], GatewayConfig],
        current: Callable[[], GatewayConfig],
        install: Callable[[GatewayConfig], Awaitable[None]],
        results: Counter,
        debounce_ms: int = 200,
    ) -> None:
        """`prepare` makes of the file what the start made of it (command-line overrides, a worker's share);
        `install` builds and swaps in what reloads, raising ConfigError where it cannot be built."""
        super().__init__(path.parent, only=path.name, results=results, debounce_ms=debounce_ms)
        self.path = path
        self._prepare = prepare
        self._current = current
        self._install = install

    async def _load_and_install(self) -> str | None:
        loaded = self._prepare(await asyncio.to_thread(load_config, self.path))
        running = self._current()
        if loaded == running:
            return None
        if restart := needing_restart(running, loaded):
            raise ConfigError(
                "settings that only a restart applies changed; nothing in the file was applied:\n"
                + "\n".join(f"  {self.path}: {key}: changed, restart the gateway to apply" for key in restart)
            )
        await self._install(loaded)
        return f"{config_version(running)} -> {config_version(loaded)}"

    def serving(self) -> str:
        return config_version(self._current())

    def status(self) -> dict[str, object]:
        return {**super().status(), "file": str(self.path), "version": self.serving()}
