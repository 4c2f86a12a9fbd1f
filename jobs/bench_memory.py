"""Which training setups fit gpt2-xl (or any preset) on a 24, 16 or 12 GB card, and what each costs in speed.

    python jobs/bench_memory.py --presets gpt2 gpt2-xl --caps 24 16 12     # on one GPU
    python jobs/bench_memory.py --presets gpt2-xl --caps 24 --compile --grad-accum 4 \
        --setups "ddp + adamw8bit + checkpointing"                          # the 24 GB recipe as it ships
    python jobs/bench_memory.py --presets gpt2-xl --caps 24 16 12 --compile --setups \
        "ddp + adamw8bit + checkpointing" "ddp + adamw_bf16 + checkpointing" \
        "ddp + offload optimizer and gradients + checkpointing"             # the recipes' setups
    python jobs/bench_memory.py --presets gpt2 --parity-steps 300 --parity-text tinyshakespeare.txt \
        --batch-size 8 --setups "ddp + adamw8bit + checkpointing" "ddp + adamw_bf16 + checkpointing"
    python jobs/bench_memory.py --presets gpt2-xl --caps 24 --compile --setups "ddp + lora r16" \
        --profile profiles/                                                   # LoRA, with a trace per run

Every (preset, setup) trains a few steps in a child process held to a memory cap with
`torch.cuda.set_per_process_memory_fraction`, trying the smallest cap first; the table gives the caps it
fits, its peak memory and its tokens/s (bf16, one worker, the same batch for every row; eager unless
--compile). With --parity-steps, each setup instead trains that many steps on real text (bytes as tokens,
the same init and order for every setup) with no cap, and the table compares its final loss with the
reference setup's (bf16 autocast, fp32 AdamW): issue 38 asks for 1%.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "platform"))

import torch  # noqa: E402

from gpt2_platform.bench import memory  # noqa: E402
from gpt2_platform.bench.train_step import text_batches  # noqa: E402
from gpt2_platform.jobs_common import configure_logging  # noqa: E402

logger = logging.getLogger("bench_memory")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["gpt2", "gpt2-xl"])
    parser.add_argument("--setups", nargs="+", default=list(memory.SETUPS), choices=list(memory.SETUPS))
    parser.add_argument("--caps", nargs="+", type=float, default=[24, 16, 12], help="memory caps in GB (GiB)")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=3, help="timed steps, after one untimed")
    parser.add_argument(
        "--grad-accum", type=int, default=1, help="micro-batches a step, as train.grad_accum_steps (the recipes: 4)"
    )
    parser.add_argument("--compile", action="store_true", help="torch.compile the model in every setup")
    parser.add_argument("--parity-steps", type=int, default=0, help="compare loss curves over this many steps")
    parser.add_argument("--parity-text", type=Path, help="the text file for --parity-steps (bytes as tokens)")
    parser.add_argument("--json-out", type=Path)
    parser.add_argument(
        "--profile", type=Path, help="also profile two steps of each run into this directory (jobs/trace_summary.py)"
    )
    parser.add_argument("--one", nargs=2, metavar=("PRESET", "SETUP"), help=argparse.SUPPRESS)
    parser.add_argument("--cap-gib", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    compile_mode = "default" if args.compile else "off"
    if args.grad_accum < 1:
        parser.error(f"--grad-accum must be at least 1, got {args.grad_accum}")
    shape = ["--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len), "--steps", str(args.steps)]
    shape += ["--grad-accum", str(args.grad_accum)]
    shape += ["--compile"] if args.compile else []
    shape += ["--profile", str(args.profile.resolve())] if args.profile else []
    if args.parity_steps and args.parity_text is None:
        parser.error("--parity-steps needs --parity-text")
    if args.one and args.parity_steps:  # the child: one loss curve, as a JSON line
        batches = text_batches(args.parity_text, args.parity_steps, args.batch_size, args.seq_len, torch.device("cpu"))
        print(json.dumps({"losses": memory.loss_curve(*args.one, batches, compile_mode)}))
        return 0
    if args.one:  # the child: one run, its result as a JSON line
        run = memory.run_one(
            *args.one,
            args.cap_gib,
            args.batch_size,
            args.seq_len,
            args.steps,
            compile_mode,
            args.profile,
            args.grad_accum,
        )
        print(json.dumps(memory.to_json([run])[0]))
        return 0
    configure_logging()
    if args.parity_steps:
        return parity(args, shape)

    def log(run: memory.Run) -> None:
        outcome = (
            f"{run.peak_reserved_gib:.1f} GiB reserved, {run.tokens_per_s:,.0f} tokens/s" if run.fits else run.error
        )
        logger.info("%s, %s, cap %s GB: %s", run.preset, run.setup, run.cap_gib, outcome)

    runs = []
    for preset_name in args.presets:
        for setup in args.setups:
            runs += memory.smallest_cap(Path(__file__).resolve(), preset_name, setup, args.caps, shape, log)
    accum = f", {args.grad_accum} micro-batches a step" if args.grad_accum > 1 else ""
    print(
        f"batch {args.batch_size} x {args.seq_len}{accum}, bf16, {'compiled' if args.compile else 'eager'}, one worker"
    )
    print(memory.as_markdown(runs, args.caps))
    if args.json_out:
        memory.write(args.json_out, runs)
    return 0


def parity(args: argparse.Namespace, shape: list[str]) -> int:
    """Each preset's loss curves, the reference setup's first, each in a child process; the final losses."""
    setups = [memory.REFERENCE_SETUP, *(s for s in args.setups if s != memory.REFERENCE_SETUP)]
    text = ["--parity-steps", str(args.parity_steps), "--parity-text", str(args.parity_text)]
    report = {}
    for preset_name in args.presets:
        curves = {}
        for setup in setups:
            found, error = memory.child(Path(__file__).resolve(), preset_name, setup, [*shape, *text])
            if found is None:
                logger.error("%s, %s: %s", preset_name, setup, error)
                continue
            curves[setup] = found["losses"]
            logger.info("%s, %s: final loss %.4f", preset_name, setup, memory.final_loss(curves[setup]))
        if memory.REFERENCE_SETUP not in curves:
            logger.error("%s: the reference setup failed, nothing to compare with", preset_name)
            return 1
        print(
            f"{preset_name}, {args.parity_steps} steps of {args.parity_text.name}, batch {args.batch_size} x {args.seq_len}"
        )
        print(memory.parity_as_markdown(curves))
        report[preset_name] = curves
    if args.json_out:
        args.json_out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
