"""Check deployment files before they reach a cluster: `ray up` configs, Serve configs, KubeRay manifests.

    python jobs/check_deploy.py cluster.yaml deployments/cluster-local.yaml deployments/gpt2.yaml \
        deployments/gpt2-cluster.yaml deployments/kuberay/*.yaml

Prints `OK <file> (<kind>)` or `error: <file>: <field>: <what to fix>` per file; exit status 2 if any
failed. Cluster configs are checked against Ray's own schema with its provider defaults merged in (no
cloud access), then for token auth on every `ray start` and a loopback-only dashboard. A RayService's
serveConfigV2 must carry the same applications as --serve-reference (args.model aside).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
# Run from a checkout without installing: the package lives in platform/.
sys.path.insert(0, str(REPO_ROOT / "platform"))

from gpt2_platform.jobs_common import configure_logging  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", type=Path, help="cluster, Serve or KubeRay YAML files")
    parser.add_argument(
        "--serve-reference",
        type=Path,
        default=REPO_ROOT / "deployments" / "gpt2-cluster.yaml",
        help="the Serve config a RayService must match (default deployments/gpt2-cluster.yaml)",
    )
    args = parser.parse_args(argv)
    configure_logging()
    # The cluster launcher logs each default it fills in; only its warnings matter here.
    logging.getLogger("ray.autoscaler").setLevel(logging.WARNING)

    from gpt2_platform.ops.deploy_check import DeployConfigError, validate_file

    num_failed = 0
    for path in args.paths:
        try:
            kind = validate_file(path, serve_reference=args.serve_reference)
        except (DeployConfigError, FileNotFoundError) as error:
            num_failed += 1
            print(f"error: {error}", flush=True)
        else:
            print(f"OK {path} ({kind})", flush=True)
    return 2 if num_failed else 0


if __name__ == "__main__":
    sys.exit(main())
