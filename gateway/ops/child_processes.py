"""Child processes the way an operator expects them: waited for until their HTTP endpoint answers (or they exit),
and stopped with a signal to each, one shared deadline, then SIGKILL."""

from __future__ import annotations

import contextlib
import logging
import signal
import subprocess
import time
from collections.abc import Sequence

import httpx

log = logging.getLogger(__name__)


class NotReady(RuntimeError):
    """A child process exited, or its endpoint did not answer in time; the message says which, naming the child."""


def wait_ready(url: str, process: subprocess.Popen, what: str, timeout: float, interval: float = 0.25) -> None:
    """Return once `url` answers 200; NotReady as soon as `process` exits, or once `timeout` seconds have passed."""
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise NotReady(f"{what} exited with status {process.returncode}")
            with contextlib.suppress(httpx.HTTPError):
                if client.get(url).status_code == 200:
                    return
            time.sleep(interval)
    raise NotReady(f"{what} not ready on {url} after {timeout:.0f}s")


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
