"""Start, inspect and stop a local Ray head with token authentication and a loopback-only dashboard.

    python jobs/cluster.py start [--num-cpus 8] [--num-gpus 1] [--free-ports] [--multi-node]
    python jobs/cluster.py status [--json]
    python jobs/cluster.py stop

`start` makes ~/.ray/auth_token (mode 600) if there is none, or makes an existing one private, starts
`ray start --head` with RAY_AUTH_MODE=token and --dashboard-host=127.0.0.1 from this environment (so jobs
run with its Python), waits until a job can be submitted (the job agent answers), and prints how to submit
one. Every other port, the metrics port included (which no token guards), listens on 127.0.0.1 too, unless
--multi-node lets other machines join. Beside another Ray: the ports other than the GCS's and the dashboard's
(--free-ports: those too) are ones nothing holds, and Ray's temp dir is the head's own, so a job's driver
joins this head, not the last Ray started on the machine. `stop` stops only this head (never `ray stop`,
which stops every Ray on the machine). --state-dir keeps several heads apart.
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

ROOT = Path(__file__).resolve().parent.parent
# Run from a checkout without installing: the package lives in platform/.
sys.path.insert(0, str(ROOT / "platform"))

from gpt2_platform.jobs_common import run_main  # noqa: E402

if TYPE_CHECKING:
    from gpt2_platform.ops.local_cluster import ClusterState

logger = logging.getLogger("cluster")


def print_started(state: ClusterState) -> None:
    from gpt2_platform.ops import local_cluster

    print(f"Ray head running (pid {state.pid}), token auth on, job agent answering, log {state.log_path}")
    print(f"GCS {state.gcs_address}, dashboard {state.dashboard_url} (127.0.0.1 only; token: `ray get-auth-token`)")
    print(f"Ray's temp dir {state.temp_dir}: its own, so its jobs join this head whatever else runs here")
    if state.loopback_only:
        print("every port listens on 127.0.0.1 only: no other machine can join (--multi-node to allow it)")
        print(
            f"a driver outside `ray job submit` needs Ray's single-machine mode: "
            f"{local_cluster.LOOPBACK_ONLY_VAR}=0 RAY_AUTH_MODE=token RAY_ADDRESS={state.gcs_address}"
        )
    else:
        gcs_port = state.gcs_address.rsplit(":", 1)[1]
        print(f"other machines join with `RAY_AUTH_MODE=token ray start --address=<this host>:{gcs_port}`")
        print("and the same token; the metrics port answers anyone who reaches it: firewall it")
    corpus = ROOT / "data" / "demo" / "corpus.txt"  # what `make demo` writes
    print("submit jobs with:")
    print("  export RAY_AUTH_MODE=token")
    print(f"  {shlex.join(local_cluster.train_submit_command(state, ROOT, corpus, ROOT / 'runs'))}")
    print("(the upload leaves out what git ignores, data/ too: the job reads the corpus and writes runs/ here)")
    if not corpus.exists():
        print(f"{corpus} is missing: `make demo` writes it, or alone: {shlex.join(make_corpus_command(corpus))}")
    print(f"stop it with: python jobs/cluster.py --state-dir {state.state_dir} stop")


def make_corpus_command(corpus: Path) -> list[str]:
    code = f"from gpt2_platform import demo_data; demo_data.write_text({str(corpus)!r}, num_stories=20000)"
    return [str(Path(sys.executable)), "-c", code]


def main(argv: list[str] | None = None) -> int:
    from gpt2_platform.ops import local_cluster

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=local_cluster.DEFAULT_STATE_DIR,
        help="where the head's pid, ports and log live",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    start = commands.add_parser("start", help="start the head and wait until its jobs API answers")
    start.add_argument("--port", type=int, default=6379, help="GCS port (default 6379)")
    start.add_argument("--dashboard-port", type=int, default=8265, help="dashboard port (default 8265)")
    start.add_argument(
        "--free-ports",
        action="store_true",
        help="free ports for the GCS and the dashboard too (the others always are): beside another Ray",
    )
    start.add_argument("--num-cpus", type=int, help="CPUs to offer (default: all)")
    start.add_argument("--num-gpus", type=int, help="GPUs to offer (default: all)")
    start.add_argument(
        "--temp-dir", type=Path, help="Ray's temp dir (default: one of its own under /tmp; keep it short)"
    )
    start.add_argument("--timeout-s", type=float, default=120, help="how long to wait for the dashboard")
    start.add_argument(
        "--multi-node",
        action="store_true",
        help="let other machines join: Ray's ports, the unauthenticated metrics port too, on every interface",
    )
    status = commands.add_parser("status", help="whether the head runs, and where")
    status.add_argument("--json", action="store_true", help="print the status as JSON")
    commands.add_parser("stop", help="stop the head and everything it started")
    args = parser.parse_args(argv)

    def run() -> None:
        if args.command == "start":
            ports = local_cluster.ClusterPorts.free() if args.free_ports else local_cluster.ClusterPorts(
                gcs=args.port, dashboard=args.dashboard_port
            )  # fmt: skip
            try:
                state = local_cluster.start(
                    args.state_dir,
                    ports,
                    args.num_cpus,
                    args.num_gpus,
                    args.temp_dir,
                    timeout_s=args.timeout_s,
                    loopback_only=not args.multi_node,
                )
            except (RuntimeError, TimeoutError) as error:  # it was stopped again: what went wrong, in one line
                raise ValueError(f"the Ray head did not start: {error}") from error
            print_started(state)
        elif args.command == "status":
            report = local_cluster.status(args.state_dir)
            if args.json:
                print(json.dumps(report, indent=2))
            elif report["running"]:
                print(
                    f"running: pid {report['pid']}, GCS {report['gcs_address']}, dashboard {report['dashboard_url']}, "
                    f"Ray {report['ray_version']}, job agent {report['job_agent']}"
                )
            else:
                print(f"not running ({report['state_dir']})")
        else:
            killed = local_cluster.stop(args.state_dir)
            print("stopped" + (f"; killed {len(killed)} processes that outlived the head" if killed else ""))

    return run_main(run)


if __name__ == "__main__":
    sys.exit(main())
