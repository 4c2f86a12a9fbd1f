"""Probe: the host time of a low-bit AdamW step, torchao's own against train/optim.py's (the update compiled once).

    python tools/probes/optimizer_step_host.py [--params 580] [--optim adamw8bit] [--steps 5]

Many small parameters (64 x 64, the smallest torchao quantizes), so the kernels take next to nothing and
what is timed is the host's work a parameter: on a GPU that work, not the update's arithmetic, paces a
step whose kernels are short. Both steps compiled (no force_eager), on this machine's CPU; they must leave
the same weights.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "platform"))

import torch  # noqa: E402

from gpt2_platform.train.config import OptimConfig  # noqa: E402
from gpt2_platform.train.optim import _TORCHAO_CLASSES, make_optimizer, torchao_optim  # noqa: E402


def timed(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], steps: int) -> float:
    for p in params:
        p.grad = torch.ones_like(p) * 1e-3
    for _ in range(2):  # compile and state initialisation
        optimizer.step()
    started = time.perf_counter()
    for _ in range(steps):
        optimizer.step()
    return (time.perf_counter() - started) / steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=int, default=580, help="gpt2-xl has about 580")
    parser.add_argument("--optim", default="adamw8bit", choices=sorted(_TORCHAO_CLASSES))
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.optim == "adamw_bf16" else torch.float32
    results = {}
    config = OptimConfig(name=args.optim, lr=1e-4)
    for name in ("torchao's step", "the update compiled once"):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(64, 64, dtype=dtype)) for _ in range(args.params)]
        groups = [{"params": params, "weight_decay": 0.1}]
        if name == "torchao's step":
            kwargs = {"bf16_stochastic_round": True} if args.optim == "adamw_bf16" else {}
            betas = (config.beta1, config.beta2)
            optimizer = getattr(torchao_optim(), _TORCHAO_CLASSES[args.optim])(groups, lr=1e-4, betas=betas, **kwargs)
        else:  # as a training run makes it, but compiled on this CPU too (make_optimizer steps eagerly there)
            optimizer = make_optimizer(groups, config, torch.device("cuda"))
        seconds = timed(optimizer, params, args.steps)
        results[name] = (seconds, params[0].detach().clone())
        print(f"| {name} | {seconds * 1e3:.1f} ms a step | {seconds / args.params * 1e6:.0f} us a parameter |")
    (_, first), (_, second) = results.values()
    print("same weights:", torch.equal(first, second))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
