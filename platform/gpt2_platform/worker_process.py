"""Inside a Ray worker process of ours (a Ray Data actor, a Serve replica): its log lines and its age."""

from __future__ import annotations

import logging
import os


def configure_worker_logging(level: int = logging.INFO) -> None:
    """In a Ray worker process: show this package's log lines (Ray forwards the worker's stderr to the
    driver). Only the package's logger is set, so Ray's own loggers in the worker keep their levels."""
    package = logging.getLogger("gpt2_platform")
    package.setLevel(level)
    if not package.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        package.addHandler(handler)
        package.propagate = False


def process_age_s() -> float | None:
    """Seconds since this process started, from Linux's /proc (None where there is none): how long a Ray
    worker took to reach a line of ours, which a log line's timestamp alone cannot say."""
    try:
        with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
            started_ticks = int(stat.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
            return float(uptime.read().split()[0]) - started_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
