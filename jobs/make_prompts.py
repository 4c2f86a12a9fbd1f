"""Build the Parquet file of prompts that jobs/generate.py reads (or scores) from a text or JSONL file.

    python jobs/make_prompts.py prompts.txt prompts.parquet                       # one prompt per line
    python jobs/make_prompts.py stories.txt stories.parquet --split paragraphs    # blocks between blank lines
    python jobs/make_prompts.py prompts.jsonl prompts.parquet [--field question]  # one JSON object per line
    python jobs/make_prompts.py texts.jsonl texts.parquet --task score            # texts to score

Columns: `id` (the JSONL `id`, else '<source file name>:<line>') and `prompt` (`text` with --task score,
as jobs/configs/score-tiny.yaml reads), plus the JSONL fields the job reads per row: `max_tokens`,
`temperature` and `seed` (with --task score: `continuation`). A blank line in a text file of lines, an empty
prompt, a line that is not a JSON object, a missing field or a repeated id stops it with one line naming
file:line (exit 2), and nothing is written. It prints the jobs/generate.py command that reads the file.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Run from a checkout without installing: the package lives in platform/.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "platform"))

from gpt2_platform.jobs_common import run_main  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help="text file (one prompt per line) or JSONL file (.jsonl, .ndjson)")
    parser.add_argument("output", help="the Parquet file to write (*.parquet)")
    parser.add_argument("--task", choices=["generate", "score"], default="generate", help="the job that reads it")
    parser.add_argument("--format", choices=["auto", "text", "jsonl"], default="auto", help="auto: by suffix")
    parser.add_argument("--split", choices=["lines", "paragraphs"], help="text: a prompt per line (default) or block")
    parser.add_argument("--field", help="JSONL: the field holding the prompt (default: prompt; --task score: text)")
    parser.add_argument("--overwrite", action="store_true", help="replace the output if it exists")
    args = parser.parse_args(argv)

    def run() -> None:
        from gpt2_platform.batch.make_prompts import make_prompts

        made = make_prompts(
            args.source,
            args.output,
            task=args.task,
            fmt=args.format,
            split=args.split,
            text_field=args.field,
            overwrite=args.overwrite,
        )
        print(f"wrote {made.num_rows} rows to {made.path}; next: {made.command()}")

    return run_main(run)


if __name__ == "__main__":
    sys.exit(main())
