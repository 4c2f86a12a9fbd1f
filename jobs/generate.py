"""Generate completions for a Parquet file of prompts with Ray Data (one engine actor per GPU), or score them.

    python jobs/generate.py --input prompts.parquet --output out/ --model runs/demo-tiny/model
    python jobs/generate.py --config jobs/configs/generate-tiny.yaml [--set generation.max_tokens=64 ...]
    python jobs/generate.py --config jobs/configs/score-tiny.yaml --input texts.parquet --output scored/
    ray job submit --working-dir . -- python jobs/generate.py --input /shared/prompts/ --output /shared/out/ ...

Runs on a running cluster when RAY_ADDRESS is set (as under `ray job submit`), else on an embedded local
Ray. Running it again with the same --output finishes what an interrupted run left and changes nothing
else. Output: Parquet files and _summary.json in the output directory; a relative --output inside a
submitted job goes under ~/gpt2-platform/ (the job's working directory is a temporary copy).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

# Run from a checkout without installing: the package lives in platform/.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "platform"))

from gpt2_platform.jobs_common import add_config_arguments, run_main  # noqa: E402

logger = logging.getLogger("generate")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_arguments(parser, "generation.max_tokens=64")
    parser.add_argument("--input", action="append", default=[], help="Parquet file, directory or glob (repeatable)")
    parser.add_argument("--output", help="output directory (same as --set output.path=...)")
    parser.add_argument("--model", help="model directory or hub name (same as --set model.path=...)")
    args = parser.parse_args(argv)

    def run() -> None:
        from gpt2_platform.batch import load, run_generation

        shortcuts = []
        if args.input:
            shortcuts.append(f"input.paths={json.dumps(args.input)}")
        if args.output:
            shortcuts.append(f"output.path={json.dumps(args.output)}")
        if args.model:
            shortcuts.append(f"model.path={json.dumps(args.model)}")
        config = load(args.config, [*shortcuts, *args.overrides])
        summary = run_generation(config)
        print(f"summary: {json.dumps(summary, sort_keys=True)}")
        rows = f"{summary['rows']} rows ({summary['rows_this_run']} this run, {summary['errors']} errors)"
        if summary["task"] == "score":
            perplexity = "n/a" if summary["perplexity"] is None else f"{summary['perplexity']:.4f}"
            print(
                f"{rows}, {summary['scored_tokens_this_run']} tokens scored in {summary['wall_s']:.1f} s; perplexity "
                f"over all scored rows {perplexity}; output: {summary['output']}"
            )
            return
        print(
            f"{rows}, {summary['completion_tokens_this_run']} tokens generated in {summary['wall_s']:.1f} s "
            f"({summary['completion_tokens_per_s']:.0f} tokens/s); output: {summary['output']}"
        )

    return run_main(run)


if __name__ == "__main__":
    sys.exit(main())
