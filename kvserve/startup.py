"""Start-up phases and their times, logged as `start-up: <phase> <seconds> s` (docs/SERVING.md)."""

from __future__ import annotations

import contextlib
import logging
import os
import time

log = logging.getLogger("kvserve")


def seconds_since_launch() -> float:
    """Seconds since this process started (Linux: /proc/self/stat), else since this module loaded."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])   # field 22: start time, clock ticks after boot
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - _LOADED


_LOADED = time.perf_counter()


@contextlib.contextmanager
def phase(name: str):
    """Log how long the block took as start-up phase `name`."""
    t0 = time.perf_counter()
    yield
    log.info("start-up: %s %.2f s", name, time.perf_counter() - t0)
