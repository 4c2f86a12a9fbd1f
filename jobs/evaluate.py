"""Perplexity and bits per byte of a checkpoint on held-out text, scored by engine actors with Ray Data.

    python jobs/evaluate.py --model runs/demo-tiny/model --data heldout.txt [--block-size 128] [--json-out r.json]
    python jobs/evaluate.py --model runs/demo-tiny/model --validation-of runs/demo-tiny   # the run's val blocks
    python jobs/evaluate.py --model openai-community/gpt2 --adapter runs/lora-1/adapter --data heldout.txt
    ray job submit --working-dir . -- python jobs/evaluate.py --model /shared/models/ft-1 --data /shared/heldout/

The text is tokenized and packed into blocks of block_size + 1 tokens as training packs it, so on the same
blocks the perplexity is the training job's validation perplexity (--validation-of scores exactly those).
Bits per byte: the total negative log-likelihood in nats / ln 2 / the UTF-8 bytes of the text the scored
tokens stand for (gpt2_platform/batch/evaluate.py says what is counted). Runs on a running cluster when
RAY_ADDRESS is set, else on an embedded local Ray.
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

logger = logging.getLogger("evaluate")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_arguments(parser, "engine.dtype=fp32")
    parser.add_argument("--model", help="model directory or hub name (same as --set model.path=...)")
    parser.add_argument(
        "--adapter", help="a peft LoRA adapter directory for the model, merged into it at load (model.adapter)"
    )
    parser.add_argument(
        "--data", action="append", default=[], help="held-out text: file, directory or glob (repeatable)"
    )
    parser.add_argument("--validation-of", help="a training run's directory: score its validation blocks")
    parser.add_argument("--block-size", type=int, help="tokens a block predicts (default: the model's context)")
    parser.add_argument("--tokenizer", help="tokenizer (default: the one in the model directory)")
    parser.add_argument("--json-out", help="also write the result as JSON to this file")
    args = parser.parse_args(argv)

    def run() -> None:
        from gpt2_platform.batch.evaluate import load, run_evaluation

        shortcuts = []
        for key, value in (
            ("model.path", args.model),
            ("model.adapter", args.adapter),
            ("model.tokenizer", args.tokenizer),
            ("data.paths", args.data or None),
            ("data.validation_of", args.validation_of),
            ("data.block_size", args.block_size),
        ):
            if value is not None:
                shortcuts.append(f"{key}={json.dumps(value)}")
        config = load(args.config, [*shortcuts, *args.overrides])
        result = run_evaluation(config)
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
        print(f"result: {json.dumps(result, sort_keys=True)}")
        bits = "n/a" if result["bits_per_byte"] is None else f"{result['bits_per_byte']:.4f}"
        print(
            f"perplexity {result['perplexity']:.4f}, bits per byte {bits} ({result['blocks']} blocks of "
            f"{result['block_size']} + 1 tokens, {result['scored_tokens']} tokens scored in {result['wall_s']:.1f} s)"
        )

    return run_main(run)


if __name__ == "__main__":
    sys.exit(main())
