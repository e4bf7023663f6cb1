"""Headless Chromium (Debian's `chromium` package): a page as it shows once its scripts have rendered it."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from html.parser import HTMLParser
from pathlib import Path

WINDOW = (1600, 1000)


class BrowserError(RuntimeError):
    """Chromium is missing or could not render the page."""


def render(url: str, screenshot: Path | None = None, budget_ms: int = 10_000, timeout: float = 180.0) -> str:
    """The DOM of `url` once its scripts have had `budget_ms` of (virtual) time, and a PNG of the window at
    `screenshot` when given. Virtual time runs ahead while the page waits on nothing, so a page that polls
    forever still ends."""
    chromium = shutil.which("chromium")
    if chromium is None:
        raise BrowserError("chromium is missing: `make chromium` installs Debian's (or: sudo apt-get install chromium)")
    with tempfile.TemporaryDirectory(prefix="portcullis-chromium-") as profile:
        command = [
            chromium,
            "--headless",
            # Chromium's sandbox needs user namespaces, which containers and root lack; the page is our own Phoenix.
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--no-first-run",
            f"--user-data-dir={profile}",
            f"--window-size={WINDOW[0]},{WINDOW[1]}",
            f"--virtual-time-budget={budget_ms}",
            "--dump-dom",
            *([f"--screenshot={screenshot}"] if screenshot else []),
            url,
        ]
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise BrowserError(f"chromium did not render {url} within {timeout:.0f}s") from None
    if result.returncode != 0 or not result.stdout:
        raise BrowserError(f"chromium exited with status {result.returncode} on {url}:\n{result.stderr[-2000:]}")
    return result.stdout


def visible_text(dom: str) -> str:
    """The text a DOM shows, one line per text node: no tags, attributes, scripts or styles."""
    parser = _TextParser()
    parser.feed(dom)
    return "\n".join(parser.lines)


class _TextParser(HTMLParser):
    _HIDDEN = {"script", "style", "template", "noscript"}

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []
        self._hidden = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in self._HIDDEN:
            self._hidden += 1

    def handle_endtag(self, tag: str) -> None:
        if tag in self._HIDDEN and self._hidden:
            self._hidden -= 1

    def handle_data(self, data: str) -> None:
        if not self._hidden and data.strip():
            self.lines.append(data.strip())
