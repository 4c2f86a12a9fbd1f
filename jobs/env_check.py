"""Check this machine's environment before a job: versions, GPUs, NVML, torch.compile, Ray.

    python jobs/env_check.py                          # report; exit 0 unless torch/Ray are missing or too old
    python jobs/env_check.py --for train --gpu        # exit 1, one `error:` line each, if GPU training cannot run
    python jobs/env_check.py --json --compile-check   # a JSON object with "ok" and "problems"
    python jobs/env_check.py --address auto           # also the cluster's resources and alive nodes

Connects to Ray only when RAY_ADDRESS is set or --address is given; --ray-local starts an embedded one.
The dashboard's http:// URL that `ray job submit` takes is no address a driver can join: the check then
says how to run it on the cluster instead, and checks this machine only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

# Run from a checkout without installing: the package lives in platform/.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "platform"))

from gpt2_platform.jobs_common import configure_logging  # noqa: E402
from gpt2_platform.ops import envcheck  # noqa: E402
from gpt2_platform.ray_address import is_dashboard_url  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--for", dest="job", choices=envcheck.JOB_KINDS, help="check the requirements of this job")
    parser.add_argument("--gpu", action="store_true", help="the job needs a GPU")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    parser.add_argument("--compile-check", action="store_true", help="also compile on CPU (10-30 s)")
    ray_group = parser.add_mutually_exclusive_group()
    ray_group.add_argument("--address", help="Ray cluster to query (default: $RAY_ADDRESS)")
    ray_group.add_argument("--ray-local", action="store_true", help="start an embedded Ray to query")
    args = parser.parse_args(argv)
    configure_logging()

    address = "local" if args.ray_local else args.address or os.environ.get("RAY_ADDRESS") or None
    note = None
    if is_dashboard_url(address):
        note = (
            f"{address} is the dashboard's URL, which a driver cannot join: this checks this machine only; "
            "for the cluster's nodes run `ray job submit --working-dir . -- python jobs/env_check.py --address auto`"
        )
        address = None
    report = envcheck.collect(probe_compile=args.compile_check, ray_address=address)
    found = envcheck.problems(report, args.job, args.gpu)
    advice = envcheck.warnings_for(report, args.job, args.gpu)
    if args.json:
        advice = advice + ([note] if note else [])
        print(json.dumps({**report, "ok": not found, "problems": found, "warnings": advice}, indent=2, default=str))
    else:
        print(envcheck.format_human(report))
        if note:
            print(f"note: {note}")
        for line in advice:
            print(f"warning: {line}")
        for line in found:
            print(f"error: {line}")
        if not found:
            print(f"ok: ready for {args.job or 'any job'}{' on a GPU' if args.gpu else ''}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
