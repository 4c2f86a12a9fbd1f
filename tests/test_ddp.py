"""Two Ray Train workers with DDP, and two with FSDP, take exactly the step one process takes on the same
global batch; DDP all-reduces gradients only on the last micro-step of each accumulation."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import ray.cloudpickle
import ray.train
import torch
from ray.train.torch import TorchTrainer

from gpt2_platform.model import GPT2, preset
from gpt2_platform.train.parallelize import parallelize
from gpt2_platform.train.step import TrainStep, resolve_precision

pytestmark = pytest.mark.slow

GLOBAL_BATCH, SEQ_LEN, NUM_STEPS = 8, 32, 3


def global_batch() -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, 257, (GLOBAL_BATCH, SEQ_LEN + 1), generator=generator)


def train(
    micro_batches: list[torch.Tensor], wrap_ddp: bool, all_reduced_at: list[int] | None = None, strategy: str = "ddp"
) -> GPT2:
    """NUM_STEPS steps of the tiny model (seeded init) on the given micro-batches.

    `all_reduced_at`, under DDP: gets the micro-step (counted from 1 over the run) of every gradient
    bucket DDP all-reduces, through a communication hook that then all-reduces as DDP would.

    SGD with momentum rather than AdamW: its update is linear in the gradient, so
    the two runs must agree to float precision; Adam's m/sqrt(v) turns float noise
    in near-zero gradients into full-size updates and hides real differences.
    """
    torch.manual_seed(0)
    device = torch.device("cpu")
    model = GPT2(preset("tiny"))
    train_model = parallelize(model, device, strategy=strategy) if wrap_ddp else model
    if all_reduced_at is not None:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        micro_step = [0]
        model.register_forward_pre_hook(lambda module, args: micro_step.__setitem__(0, micro_step[0] + 1))

        def counting_hook(state: list[int], bucket):
            state.append(micro_step[0])
            return allreduce_hook(None, bucket)

        train_model.register_comm_hook(all_reduced_at, counting_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    step = TrainStep(train_model, optimizer, resolve_precision("fp32", device), device, grad_clip=1.0)
    for _ in range(NUM_STEPS):
        step([(b[:, :-1], b[:, 1:]) for b in micro_batches], lr=0.5)
    return model


def ddp_worker(loop_config: dict) -> None:
    """Each rank takes its half of the global batch as 2 micro-batches of 2 (sync on the last only)."""
    rank = ray.train.get_context().get_world_rank()
    local = global_batch()[rank * 4 : (rank + 1) * 4]
    all_reduced_at: list[int] = []
    model = train([local[:2], local[2:]], wrap_ddp=True, all_reduced_at=all_reduced_at)
    assert isinstance(model, GPT2)
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, f"{loop_config['out']}.rank{rank}")
    torch.save(all_reduced_at, f"{loop_config['out']}.all_reduced_at.rank{rank}")
    # The same steps with the model sharded by FSDP2 over the two workers; rank 0 saves it gathered whole.
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sharded = train([local[:2], local[2:]], wrap_ddp=True, strategy="fsdp")
    state = get_model_state_dict(sharded, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save(state, f"{loop_config['out']}.fsdp")


def test_two_ddp_workers_and_two_fsdp_workers_match_one_process_with_the_same_global_batch(ray_cluster, tmp_path: Path):
    # The workers cannot import this test module: ship its functions by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    out = tmp_path / "ddp_state.pt"
    TorchTrainer(
        ddp_worker,
        train_loop_config={"out": str(out)},
        scaling_config=ray.train.ScalingConfig(num_workers=2, use_gpu=False),
        run_config=ray.train.RunConfig(name="ddp-equivalence", storage_path=str(tmp_path)),
    ).fit()
    ranks = [torch.load(f"{out}.rank{r}", weights_only=True) for r in (0, 1)]
    sharded = torch.load(f"{out}.fsdp", weights_only=True)
    # 2 micro-steps a step: buckets all-reduced on micro-steps 2, 4 and 6 only, never on 1, 3 or 5.
    for rank in (0, 1):
        all_reduced_at = torch.load(f"{out}.all_reduced_at.rank{rank}", weights_only=True)
        assert set(all_reduced_at) == {2, 4, 6}, f"rank {rank} all-reduced on micro-steps {all_reduced_at}"

    batch = global_batch()
    single = train([batch[:4], batch[4:]], wrap_ddp=False).state_dict()
    torch.manual_seed(0)
    initial = GPT2(preset("tiny")).state_dict()  # the weights before training
    for name, expected in single.items():
        assert torch.equal(ranks[0][name], ranks[1][name]), f"ranks disagree on {name}: gradients were not synced"
        update = (expected - initial[name]).abs().max().item()
        difference = (ranks[0][name] - expected).abs().max().item()
        assert update > 0, f"{name} did not train"
        assert difference <= 1e-4 * update + 1e-7, (
            f"{name}: DDP differs by {difference:.2e} for an update of {update:.2e}"
        )
        if name == "lm_head.weight" and name not in sharded:  # tied to the token embedding: saved once
            continue
        difference = (sharded[name] - expected).abs().max().item()
        assert difference <= 1e-4 * update + 1e-7, (
            f"{name}: FSDP differs by {difference:.2e} for an update of {update:.2e}"
        )
