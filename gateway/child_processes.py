"""Stopping child processes the way an operator expects: a signal to each, one shared deadline, then SIGKILL."""

from __future__ import annotations

import logging
import signal
import subprocess
import time
from collections.abc import Sequence

log = logging.getLogger(__name__)


def stop(processes: Sequence[subprocess.Popen], what: str, timeout: float, signum: int = signal.SIGTERM) -> None:
    """Send `signum` to each running process, wait for all of them within `timeout` seconds in all, and kill those
    still running then (`what` names them in the warning)."""
    running = [process for process in processes if process.poll() is None]
    for process in running:
        process.send_signal(signum)
    deadline = time.monotonic() + timeout
    for process in running:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s pid %d still running %.0fs after the stop signal: killing it", what, process.pid, timeout)
            process.kill()
            process.wait()
