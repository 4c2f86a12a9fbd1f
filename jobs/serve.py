"""`serve run` in the Ray it means: a local Ray of its own, unless RAY_ADDRESS names a cluster to join.

    python jobs/serve.py [deployments/gpt2.yaml] [serve run's options]     # `make serve`; Ctrl-C to stop
    RAY_ADDRESS=<host>:6379 python jobs/serve.py deployments/gpt2.yaml     # in a running cluster, as a driver

Ray's own `serve run` without RAY_ADDRESS joins whichever Ray the last `ray start` on this machine recorded in
/tmp/ray: another user's, or one since killed, on whose dead address it then waits until interrupted. This
starts or joins Ray as the jobs do (runtime.init_ray: the token kept private, the dashboard on a free port,
this checkout's package on the workers' path), logs which cluster it started or joined, and then runs
`serve run` with these arguments in that cluster. For a cluster reached through its dashboard, use
`serve deploy -a <dashboard URL>` instead.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Run from a checkout without installing: the package lives in platform/.
sys.path.insert(0, str(ROOT / "platform"))

from gpt2_platform.jobs_common import run_main  # noqa: E402
from gpt2_platform.ray_address import is_dashboard_url  # noqa: E402

DEFAULT_CONFIG = "deployments/gpt2.yaml"


def main(argv: list[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments and arguments[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    if not arguments or arguments[0].startswith("-"):
        arguments.insert(0, DEFAULT_CONFIG)

    def run() -> None:
        address = os.environ.get("RAY_ADDRESS")
        if is_dashboard_url(address):
            raise ValueError(
                f"RAY_ADDRESS={address} is a dashboard's URL, which `serve run` cannot join: deploy to that "
                f"cluster with `serve deploy {arguments[0]} -a {address}`, or unset RAY_ADDRESS to serve locally"
            )
        target = arguments[0]
        if target.endswith((".yaml", ".yml")) and not Path(target).is_file():
            raise FileNotFoundError(f"no Serve config {target}: run this from the repository root, or name the file")

        import click
        from ray.serve.scripts import run as serve_run

        from gpt2_platform.runtime import init_ray

        init_ray()
        # `serve run` joins no cluster of its own once this process is connected; it returns on Ctrl-C,
        # having shut its applications down.
        try:
            serve_run.main(arguments, prog_name="serve run", standalone_mode=False)
        except click.ClickException as error:  # a bad option: click's own one line
            raise ValueError(error.format_message()) from error

    return run_main(run)


if __name__ == "__main__":
    sys.exit(main())
