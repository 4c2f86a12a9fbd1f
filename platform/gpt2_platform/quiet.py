"""Ray's own output cut down to what a user of this project acts on, for runs that start their own Ray.

Ray, Ray Data and Serve log at INFO to the console by default: each dataset's execution plan and a progress
block every few seconds, the Serve controller's and proxy's every step, an access-log line per request. What
stays: the project's lines (its loggers, and the progress lines the training loop and the engine actors
log), Ray's warnings and errors, and the lines docs/operating.md ("What Ray still prints") lists with their
causes. Ray Data's INFO lines still go to the session's `logs/ray-data/ray-data.log`, Serve's to
`logs/serve/`.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

RAY_DATA_LOGGING = Path(__file__).with_name("ray_data_logging.yaml")
"""Ray Data's default logging config with its console handler at WARNING (RAY_DATA_LOGGING_CONFIG)."""

RAY_FALSE_ALARMS = (b"has constructor arguments in the object store and max_restarts > 0",)
"""Error lines Ray's C++ core prints in a driver where nothing is wrong, and no setting short of hiding all
of its errors removes: once a process, when Ray Data starts its first actor pool (it hands every pool's
actors their function and DataContext by reference; ray-project/ray#53727)."""

RELAYED_VAR = "GPT2_PLATFORM_STDERR_RELAYED"
"""Set in the child that `run_relaying_stderr` starts, so that an entry point that calls it runs its work."""

SERVE_LOGGING = {"log_level": "WARNING", "enable_access_log": False}
"""Serve's `logging_config` for its controller and proxy (`serve.start`) and an app's replicas (`serve.run`):
Serve's own INFO lines and access log off. Our code in a replica logs through the package's logger, which
`worker_process.configure_worker_logging` sets up apart from Serve's."""

# A Ray Train actor builds ExecutionOptions with a deprecated argument on every run: Ray's warning about
# its own call, which nobody outside Ray can act on. Any -W option also stops Ray adding its filter that
# shows every RayDeprecationWarning once per module, so Python's default (hidden outside __main__) applies.
_RAY_INTERNAL_WARNINGS = ("ignore:`ExecutionOptions.exclude_resources` is deprecated",)


def quiet_ray() -> None:
    """Set Ray's log levels for this process and the Ray it starts; call it before Ray (and `ray.data`) is
    imported. A local Ray's workers inherit this process's environment; a running cluster's workers keep
    their own settings, and only this process's lines change.

    The user's own settings win: a RAY_DATA_LOGGING_CONFIG already set is kept, PYTHONWARNINGS is added to.
    """
    os.environ.setdefault("RAY_DATA_LOGGING_CONFIG", str(RAY_DATA_LOGGING))
    options = [option for option in os.environ.get("PYTHONWARNINGS", "").split(",") if option]
    os.environ["PYTHONWARNINGS"] = ",".join([*options, *(o for o in _RAY_INTERNAL_WARNINGS if o not in options)])


def quiet_serve_driver() -> None:
    """This process's own Serve lines ("Started Serve", "Application ... is ready") off: serve.run returning
    says as much. `import ray.serve` sets its logger's level, so this runs after it."""
    import ray.serve  # noqa: F401

    logging.getLogger("ray.serve").setLevel(logging.WARNING)


def run_relaying_stderr(command: Sequence[str], drop: Sequence[bytes] = RAY_FALSE_ALARMS) -> int:
    """Run `command` with its stderr copied to ours line by line, less the lines that contain one of `drop`;
    returns its exit status. Its stdout is ours, untouched. For an entry point whose output is read by a
    person (the demo): Ray's C++ core writes to the file descriptor, where no Python filter sees it."""
    with subprocess.Popen(command, stderr=subprocess.PIPE, env={**os.environ, RELAYED_VAR: "1"}) as child:
        assert child.stderr is not None
        while True:
            try:
                line = child.stderr.readline()
            except KeyboardInterrupt:
                continue  # Ctrl-C reached the child as well: relay what it prints while it stops
            if not line:
                break
            if not any(text in line for text in drop):
                sys.stderr.buffer.write(line)
                sys.stderr.buffer.flush()
        while True:
            try:
                return child.wait()
            except KeyboardInterrupt:
                continue
