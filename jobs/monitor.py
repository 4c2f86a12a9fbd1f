"""GPU monitoring for the cluster: per-GPU metrics in the Ray dashboard, and a status table.

    python jobs/monitor.py start [--interval-s 5] [--node-check-period-s 10]
                                                    # one exporter actor per node, and a keeper that gives
                                                    # each node joining later one (idempotent)
    python jobs/monitor.py status [--json]          # a fresh per-node, per-GPU table
    python jobs/monitor.py stop                     # stop the keeper, then every exporter

Connects to RAY_ADDRESS when set, else starts an embedded local Ray. RAY_ADDRESS
may be the GCS's host:port or the dashboard's http://host:8265 that `ray job submit`
takes: then the same command runs on the cluster as a job (this checkout uploaded,
as `ray job submit --working-dir .` would), and its output is printed here. A node
without NVIDIA GPUs is reported plainly ("no NVIDIA GPU on node X (reason)"),
which is not an error.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Run from a checkout without installing: the package lives in platform/.
sys.path.insert(0, str(ROOT / "platform"))

from gpt2_platform.jobs_common import run_main  # noqa: E402
from gpt2_platform.ray_address import is_dashboard_url  # noqa: E402

logger = logging.getLogger("monitor")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    start = commands.add_parser("start", help="start a GPU exporter actor on every node, now and joining later")
    start.add_argument("--interval-s", type=float, default=5.0, help="seconds between samples (default 5)")
    start.add_argument(
        "--node-check-period-s",
        type=float,
        default=10.0,
        help="seconds between the keeper's checks for nodes without an exporter (default 10)",
    )
    status = commands.add_parser("status", help="print a fresh per-node, per-GPU table")
    status.add_argument("--json", action="store_true", help="print the samples as JSON instead")
    commands.add_parser("stop", help="stop the keeper, then the exporters on every node")
    arguments = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(arguments)
    succeeded = True

    def run() -> None:
        nonlocal succeeded
        from gpt2_platform.runtime import init_ray, run_as_job

        address = os.environ.get("RAY_ADDRESS")
        if is_dashboard_url(address):
            # A driver must reach the GCS, which the dashboard's URL does not name (and an SSH tunnel to the
            # dashboard does not forward): run the command where it can.
            script = Path(__file__).resolve().relative_to(ROOT)
            succeeded = run_as_job(address, [str(script), *arguments], working_dir=ROOT)
            return

        from gpt2_platform.monitoring import exporter
        from gpt2_platform.monitoring.nvml import format_status

        init_ray()
        if args.command == "start":
            if not os.environ.get("RAY_ADDRESS"):
                logger.warning("RAY_ADDRESS is not set: the exporters live only as long as this embedded Ray")
            handles = exporter.start_exporters(interval_s=args.interval_s)
            exporter.start_keeper(interval_s=args.interval_s, period_s=args.node_check_period_s)
            print(
                f"GPU exporters running on {len(handles)} node(s) (namespace {exporter.NAMESPACE}), every {args.interval_s:g} s; "
                f"a node that joins gets one at the keeper's next check, within {args.node_check_period_s:g} s"
            )
            return
        if args.command == "stop":
            # The keeper first, or it would start exporters again on the nodes just cleared.
            keeper = "stopped the exporter keeper" if exporter.stop_keeper() else "no exporter keeper was running"
            print(f"{keeper}; stopped {exporter.stop_exporters()} GPU exporter(s)")
            return
        samples = exporter.collect_samples()
        if args.json:
            print(json.dumps([dataclasses.asdict(sample) for sample in samples], indent=2))
        else:
            print(format_status(samples))
            with_exporter = sum(sample.from_exporter for sample in samples)
            print(f"{with_exporter} of {len(samples)} node(s) have a GPU exporter")

    code = run_main(run)
    return code if code or succeeded else 1


if __name__ == "__main__":
    sys.exit(main())
