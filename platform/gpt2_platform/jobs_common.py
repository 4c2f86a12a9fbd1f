"""What every entry point in jobs/ shares: logging set-up and user-error handling."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable

logger = logging.getLogger(__name__)

# Errors that mean "the input was wrong": one clear line and exit status 2, no traceback.
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError, FileExistsError)


def add_config_arguments(parser: argparse.ArgumentParser, example: str) -> None:
    """The one way to configure a job: `--config recipe.yaml` and repeatable `--set a.b=c`."""
    parser.add_argument("--config", help="YAML recipe (jobs/configs/*.yaml)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"override a config field, e.g. --set {example} (repeatable)",
    )


def configure_logging(level: int = logging.INFO) -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


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


def is_dashboard_url(address: str | None) -> bool:
    """Whether `address` is the dashboard's http(s):// URL: the form `ray job submit` and docs/operating.md
    use for RAY_ADDRESS, which `ray.init()` cannot join (a driver needs the GCS's host:port)."""
    return bool(address) and address.split("://", 1)[0] in ("http", "https")


def run_main(run: Callable[[], None]) -> int:
    """Run an entry point; user errors print `error: ...` and return 2."""
    configure_logging()
    try:
        run()
    except USER_ERRORS as error:
        logger.debug("user error", exc_info=True)
        print(f"error: {error}", flush=True)
        return 2
    return 0
