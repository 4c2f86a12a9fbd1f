"""Benchmark batch generation: our Ray Data job against a naive map_batches over transformers' generate.

    python jobs/bench_batch.py --num-prompts 10000 --new-tokens 128     # on a GPU machine

Writes the prompts (32-128 tokens), a gpt2-preset model, runs both jobs in this
process (ours first), and prints generated tokens/s for each.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "platform"))

from gpt2_platform.bench import batch  # noqa: E402
from gpt2_platform.jobs_common import configure_logging  # noqa: E402
from gpt2_platform.runtime import init_ray  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="gpt2")
    parser.add_argument("--num-prompts", type=int, default=10000)
    parser.add_argument("--min-prompt-tokens", type=int, default=32)
    parser.add_argument("--max-prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--engine-batch", type=int, default=256)
    parser.add_argument("--naive-batch", type=int, default=64)
    parser.add_argument("--compile", action="store_true", help="torch.compile our engine's decode step")
    parser.add_argument("--skip-naive", action="store_true")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    configure_logging()
    init_ray()
    work = Path(tempfile.mkdtemp(prefix="bench-batch-"))
    prompts = batch.write_prompts(
        work / "prompts.parquet", args.num_prompts, args.min_prompt_tokens, args.max_prompt_tokens
    )
    model_dir = batch.write_model(work / "model", args.preset)
    max_seq_len = args.max_prompt_tokens + args.new_tokens
    rows = [
        batch.our_job(prompts, model_dir, work / "ours", args.new_tokens, args.engine_batch, max_seq_len, args.compile)
    ]
    print(f"ours: {rows[0]}", flush=True)
    if not args.skip_naive:
        rows.append(batch.naive_job(prompts, model_dir, work / "naive", args.new_tokens, args.naive_batch))
    print(
        f"{args.num_prompts} prompts of {args.min_prompt_tokens}-{args.max_prompt_tokens} tokens, {args.new_tokens} new tokens, {args.preset}"
    )
    print("| job | rows | wall s | generated tokens/s |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['job']} | {r['rows']} | {r['wall_s']:.1f} | {r['generated_tokens_per_s']:,.0f} |")
    if len(rows) == 2:
        print(f"speedup: {rows[0]['generated_tokens_per_s'] / rows[1]['generated_tokens_per_s']:.1f}x")
    if args.json_out:
        args.json_out.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
