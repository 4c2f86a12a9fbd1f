"""Fine-tune a GPT-2 on Ray Train.

    python jobs/train.py --config jobs/configs/tiny.yaml [--set train.max_steps=200 ...]
    ray job submit --working-dir . -- python jobs/train.py --config jobs/configs/gpt2.yaml

Runs on a running cluster when RAY_ADDRESS is set (as under `ray job submit`),
else on an embedded local Ray. Resubmitting the same run.name resumes it.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

# Run from a checkout without installing: the package lives in platform/.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "platform"))

from gpt2_platform.jobs_common import add_config_arguments, run_main  # noqa: E402
from gpt2_platform.train import config as config_lib  # noqa: E402

logger = logging.getLogger("train")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_arguments(parser, "train.max_steps=100")
    parser.add_argument("--profile", action="store_true", help="record a torch.profiler trace (train.profile_steps)")
    args = parser.parse_args(argv)

    def run() -> None:
        from gpt2_platform.train.trainer import fit

        overrides = [*args.overrides, *(["train.profile=true"] if args.profile else [])]
        config = config_lib.load(args.config, overrides)
        result = fit(config)
        summary = ", ".join(f"{k}={result.metrics[k]:.4g}" for k in ("step", "loss", "val_loss") if k in result.metrics)
        print(f"final metrics: {summary}")
        print(f"checkpoint: {result.checkpoint_dir}")
        print(f"model (Hugging Face format): {result.model_dir}")

    return run_main(run)


if __name__ == "__main__":
    sys.exit(main())
