"""What every entry point in jobs/ shares: logging set-up, config arguments and user-error handling.

For jobs/ scripts only: the package's own modules import nothing from here."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable

from gpt2_platform.quiet import quiet_ray

logger = logging.getLogger(__name__)

# Errors that mean "the input was wrong": one clear line and exit status 2, no traceback.
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError, FileExistsError)


def add_config_arguments(parser: argparse.ArgumentParser, example: str) -> None:
    """The one way to configure a job: `--config recipe.yaml` and `--set a.b=c [d.e=f ...]`, repeatable."""
    parser.add_argument("--config", help="YAML recipe (jobs/configs/*.yaml)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="extend",  # several values after one --set, and --set repeated, make one flat list
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help=f"override config fields, e.g. --set {example} (several after one --set, or --set repeated)",
    )


def configure_logging(level: int = logging.INFO) -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def run_main(run: Callable[[], None]) -> int:
    """Run an entry point; user errors print `error: ...` and return 2."""
    quiet_ray()  # before Ray starts: its workers inherit the settings
    configure_logging()
    try:
        run()
    except USER_ERRORS as error:
        logger.debug("user error", exc_info=True)
        print(f"error: {error}", flush=True)
        return 2
    return 0
