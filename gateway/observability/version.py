"""The installed Portcullis release, as `portcullis --version`, the `portcullis_build_info` metric and every span's
resource (`service.version`) report it."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def _installed() -> str:
    try:
        return version("portcullis")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


VERSION = _installed()
