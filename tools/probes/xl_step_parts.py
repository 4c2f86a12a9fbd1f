"""Probe: where a memory-lean training step's time goes, and which knobs buy it back (issue 38).

    python tools/probes/xl_step_parts.py --preset gpt2-xl --optim adamw8bit --cap 24 --batch-size 4 \
        --checkpoint-blocks 48 --compile blocks

One configuration per process (the cap and compile's caches stay there); prints one JSON line: the peak
memory, tokens/s and the step split into forward+backward, clipping and the optimizer (CUDA events), so a
slow setup says which part is slow. `--checkpoint-blocks K` recomputes only the first K blocks (-1: all);
`--compile whole|blocks|off` compiles the model as one graph or each block on its own.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "platform"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def build(args: argparse.Namespace, device: torch.device):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    from gpt2_platform.lora import LoraConfig, apply_lora
    from gpt2_platform.model import GPT2, preset
    from gpt2_platform.train.config import OptimConfig
    from gpt2_platform.train.loss import LMLoss
    from gpt2_platform.train.optim import precision_for, weights_dtype
    from gpt2_platform.train.step import TrainStep, build_optimizer, resolve_precision

    optim = OptimConfig(name=args.optim, offload=args.offload)
    torch.manual_seed(0)
    with device:
        model = GPT2(preset(args.preset))
    if args.lora:
        apply_lora(model, LoraConfig(r=args.lora))
    model.to(weights_dtype(optim))
    if args.lora and args.frozen_bf16:  # the frozen base in bf16: half its memory, no cast per forward
        for param in model.parameters():
            if not param.requires_grad:
                param.data = param.data.to(torch.bfloat16)
    blocks = model.transformer.h
    count = len(blocks) if args.checkpoint_blocks < 0 else args.checkpoint_blocks
    for index in range(len(blocks)):
        block = blocks[index]
        if index < count:
            block = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        if args.compile == "blocks":
            block.compile()
        blocks[index] = block
    train_model = torch.compile(model) if args.compile == "whole" else model
    precision = resolve_precision(precision_for(optim, "bf16"), device)
    optimizer = build_optimizer(model, optim, device)
    return model, TrainStep(train_model, optimizer, precision, device, 1.0, loss_fn=LMLoss("logits", 128))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="gpt2-xl")
    parser.add_argument("--optim", default="adamw8bit")
    parser.add_argument("--offload", default="none")
    parser.add_argument("--lora", type=int, default=0, help="LoRA rank (0: full fine-tuning)")
    parser.add_argument("--frozen-bf16", action="store_true", help="with --lora: hold the frozen base in bf16")
    parser.add_argument("--cap", type=float, default=24.0, help="GiB")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--checkpoint-blocks", type=int, default=-1)
    parser.add_argument("--compile", choices=["whole", "blocks", "off"], default="blocks")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches a step (the recipes: 4)")
    args = parser.parse_args()
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap * 2**30 / total), device)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    result: dict[str, object] = {key: value for key, value in vars(args).items()}
    try:
        model, step = build(args, device)
        tokens = torch.randint(0, model.config.vocab_size, (args.batch_size, args.seq_len + 1), device=device)
        batch = [(tokens[:, :-1], tokens[:, 1:])] * args.grad_accum
        parts = {"fwd_bwd": 0.0, "clip": 0.0, "optimizer": 0.0}
        events = {name: (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for name in parts}

        # Time the parts by timing the optimizer's and the clip's calls from inside TrainStep's own order.
        optimizer = step.optimizer
        real_step = optimizer.step

        def timed_step(*a, **k):
            events["optimizer"][0].record()
            out = real_step(*a, **k)
            events["optimizer"][1].record()
            return out

        optimizer.step = timed_step  # type: ignore[method-assign]
        import gpt2_platform.train.step as step_module

        real_clip = step_module.clip_gradients

        def timed_clip(*a, **k):
            events["fwd_bwd"][1].record()
            events["clip"][0].record()
            out = real_clip(*a, **k)
            events["clip"][1].record()
            return out

        step_module.clip_gradients = timed_clip
        step(batch, lr=1e-4)
        step(batch, lr=1e-4)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.steps):
            events["fwd_bwd"][0].record()
            step(batch, lr=1e-4)
            torch.cuda.synchronize()
            for name, (first, last) in events.items():
                parts[name] += first.elapsed_time(last) / 1000
        end.record()
        torch.cuda.synchronize()
        elapsed = start.elapsed_time(end) / 1000
        result.update(
            fits=True,
            tokens_per_s=round(args.batch_size * args.seq_len * args.grad_accum * args.steps / elapsed),
            step_s=round(elapsed / args.steps, 4),
            **{f"{name}_s": round(value / args.steps, 4) for name, value in parts.items()},
            peak_allocated_gib=round(torch.cuda.max_memory_allocated(device) / 2**30, 2),
            peak_reserved_gib=round(torch.cuda.max_memory_reserved(device) / 2**30, 2),
        )
    except torch.cuda.OutOfMemoryError as error:
        result.update(fits=False, error=str(error).splitlines()[0][:200])
    finally:
        dist.destroy_process_group()
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
