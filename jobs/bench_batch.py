"""Benchmark batch generation: our Ray Data job against a naive map_batches over transformers' generate.

    python jobs/bench_batch.py --num-prompts 10000 --new-tokens 128                    # on a GPU machine
    python jobs/bench_batch.py --num-prompts 100000 --engine-batch 512 1024 --skip-naive --variable

Writes the prompts (32-128 tokens), a gpt2-preset model, runs the jobs in this process (ours first, at each
--engine-batch; then the naive one), and prints each job's wall time, the time to its first finished block
of rows, and generated tokens/s over the whole wall time (start-up included). `--repeat 2` runs our first
job again: the first run pays the cold caches (Triton's, inductor's), the second finds them. `--variable`
adds a run where each row has its own max_tokens (uniform in --variable-range), so rows finish at
different steps and continuous batching refills their slots one by one.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "platform"))

from gpt2_platform.batch.worker import ACTOR_IMPORTS  # noqa: E402
from gpt2_platform.bench import batch, models  # noqa: E402
from gpt2_platform.jobs_common import configure_logging  # noqa: E402
from gpt2_platform.runtime import init_ray  # noqa: E402


def main() -> int:
    args = _parse_args()
    configure_logging()
    init_ray(preload=ACTOR_IMPORTS)  # as the batch job starts its own (batch.generate.connect_and_plan_actors)
    work = Path(tempfile.mkdtemp(prefix="bench-batch-"))
    prompts = batch.write_prompts(
        work / "prompts.parquet", args.num_prompts, args.min_prompt_tokens, args.max_prompt_tokens
    )
    model_dir = models.write_model(work / "model", args.preset)
    settings = "".join(f", {setting}" for setting in args.set)  # in each row's name
    rows = _our_runs(args, prompts, model_dir, work, settings)
    if args.variable:
        rows.append(_our_variable_run(args, model_dir, work, settings))
    if not args.skip_naive:
        rows.append(batch.naive_job(prompts, model_dir, work / "naive", args.new_tokens, args.naive_batch))
    _print_table(args, rows)
    if args.json_out:
        args.json_out.write_text(json.dumps(rows, indent=2))
    return 0


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="gpt2")
    parser.add_argument("--num-prompts", type=int, default=10000)
    parser.add_argument("--min-prompt-tokens", type=int, default=32)
    parser.add_argument("--max-prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--engine-batch", type=int, nargs="+", default=[256], help="one run of ours per size")
    parser.add_argument("--repeat", type=int, default=1, help="runs of ours at the first engine batch")
    parser.add_argument("--variable", action="store_true", help="add a run with per-row max_tokens")
    parser.add_argument("--variable-range", type=int, nargs=2, default=[1, 512], metavar=("LOW", "HIGH"))
    parser.add_argument("--naive-batch", type=int, default=64)
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="engine.compile for our runs (default: the engine's own, engine.default_compile)",
    )
    parser.add_argument("--skip-naive", action="store_true")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a batch-job setting for every run of ours (e.g. scaling.concurrent_batches_per_actor=4); repeatable",
    )
    parser.add_argument("--json-out", type=Path)
    return parser.parse_args()


def _our_runs(args: argparse.Namespace, prompts: Path, model_dir: Path, work: Path, settings: str) -> list[dict]:
    """Our job at each --engine-batch, the first one --repeat times; each row printed as it finishes."""
    max_seq_len = args.max_prompt_tokens + args.new_tokens
    runs = [(args.engine_batch[0], f" run {i + 1}" if args.repeat > 1 else "") for i in range(args.repeat)]
    runs += [(size, "") for size in args.engine_batch[1:]]
    rows = []
    for i, (size, label) in enumerate(runs):
        rows.append(
            batch.our_job(
                prompts,
                model_dir,
                work / f"ours-{i}",
                args.new_tokens,
                size,
                max_seq_len,
                args.compile,
                label=label + settings,
                overrides=args.set,
            )
        )
        print(f"ours: {rows[-1]}", flush=True)
    return rows


def _our_variable_run(args: argparse.Namespace, model_dir: Path, work: Path, settings: str) -> dict:
    """Our job at the last --engine-batch over prompts that each ask for their own max_tokens (--variable-range)."""
    low, high = args.variable_range
    varied = batch.write_prompts(
        work / "prompts-variable.parquet",
        args.num_prompts,
        args.min_prompt_tokens,
        args.max_prompt_tokens,
        new_tokens_range=(low, high),
    )
    row = batch.our_job(
        varied,
        model_dir,
        work / "ours-variable",
        high,
        args.engine_batch[-1],
        args.max_prompt_tokens + high,
        args.compile,
        per_row_max_tokens=True,
        label=f", max_tokens {low}-{high} per row{settings}",
        overrides=args.set,
    )
    print(f"ours: {row}", flush=True)
    return row


def _print_table(args: argparse.Namespace, rows: list[dict]) -> None:
    """The jobs as a Markdown table, then each run of ours against the naive job's wall time."""
    print(
        f"{args.num_prompts} prompts of {args.min_prompt_tokens}-{args.max_prompt_tokens} tokens, "
        f"{args.new_tokens} new tokens, {args.preset}"
    )
    print("| job | rows | generated tokens | wall s | first rows s | generated tokens/s |\n|---|---|---|---|---|---|")
    for r in rows:
        first = "-" if r["first_row_s"] is None else f"{r['first_row_s']:.1f}"
        print(
            f"| {r['job']} | {r['rows']} | {r['completion_tokens']:,} | {r['wall_s']:.1f} | {first} | "
            f"{r['generated_tokens_per_s']:,.0f} |"
        )
    if not args.skip_naive:
        naive = rows[-1]
        for ours in rows[:-1]:  # each run of ours: the first pays cold caches, a --repeat finds them
            print(f"{ours['job']}: {naive['wall_s'] / ours['wall_s']:.1f}x the naive job's wall time")


if __name__ == "__main__":
    sys.exit(main())
