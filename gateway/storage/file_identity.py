"""Which file a path names now, as (device, inode): a watcher or an open handle holds on to one file, and a file
renamed over the path, or removed and made again, is another one that only this tells apart."""

from __future__ import annotations

import os
from pathlib import Path


def file_identity(path: Path) -> tuple[int, int] | None:
    """(st_dev, st_ino) of what `path` names, or None while nothing is there."""
    try:
        found = os.stat(path)
    except OSError:
        return None
    return found.st_dev, found.st_ino
