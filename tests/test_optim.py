"""gpt2_platform.train.optim: each optim.name trains, checkpoints (as run_checkpoint writes it) and resumes to the
losses of an uninterrupted run; the settings that cannot work are refused in one line naming the setting."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from gpt2_platform.config_loader import ConfigError
from gpt2_platform.train.config import Config, OptimConfig, load
from gpt2_platform.train.optim import precision_for, weights_dtype
from gpt2_platform.train.run_checkpoint import (
    gather_full_states,
    load_optimizer_state,
    read_checkpoint,
    save_checkpoint,
)
from gpt2_platform.train.step import TrainStep, build_optimizer, resolve_precision
from helpers_unit import random_ids, tiny_model

CPU = torch.device("cpu")
NAMES = ["adamw", "adamw8bit", "adamw4bit", "adamw_bf16"]
NUM_STEPS, SAVE_AT = 6, 3


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    ids = [random_ids(4, 33, seed=number % 2) for number in range(NUM_STEPS)]  # two batches, learnable
    return [(t[:, :-1], t[:, 1:]) for t in ids]


def _train(name: str, directory: Path, save: bool, precision: str = "fp32") -> list[float]:
    """Steps SAVE_AT+1.. of the tiny model, from a checkpoint in `directory` or (save) from scratch through
    SAVE_AT, writing it there. The RNG is reseeded at SAVE_AT (bf16's stochastic rounding draws from it)."""
    optim = OptimConfig(name=name, lr=3e-3, warmup_steps=0)
    model = tiny_model(seed=0)
    saved = None if save else read_checkpoint(directory, model, CPU)
    model.to(weights_dtype(optim))
    optimizer = build_optimizer(model, optim, CPU)
    if saved is not None:
        load_optimizer_state(model, optimizer, saved.optimizer)
    step = TrainStep(model, optimizer, resolve_precision(precision_for(optim, precision), CPU), CPU, grad_clip=1.0)
    losses = []
    for number, batch in enumerate(_batches(), start=1):
        if number == SAVE_AT + 1:
            torch.manual_seed(7)
            if save:
                config = Config(optim=optim)
                save_checkpoint(directory, model, step, {"step": SAVE_AT}, config, gather_full_states(model, optimizer))
        if save or number > SAVE_AT:
            losses.append(float(step([batch], lr=3e-3)[0]))
    return losses


@pytest.mark.parametrize("name", NAMES)
def test_each_optimizer_trains_checkpoints_and_resumes_to_the_uninterrupted_losses(name: str, tmp_path: Path) -> None:
    uninterrupted = _train(name, tmp_path, save=True)
    assert all(math.isfinite(x) for x in uninterrupted) and uninterrupted[-1] < uninterrupted[0], uninterrupted
    resumed = _train(name, tmp_path, save=False)
    # Low-bit moments are quantized again on load: a block whose largest moment is negative gets a scale one
    # step of the signed code map smaller, which moves the next losses in their fourth or fifth digit.
    tolerance = 1e-3 if name in ("adamw8bit", "adamw4bit") else 1e-6
    assert resumed == pytest.approx(uninterrupted[SAVE_AT:], rel=tolerance, abs=0), name
    # The checkpoint loads without unpickling anything but tensors, and its weights are fp32 whatever trained.
    torch.load(tmp_path / "optimizer.pt", weights_only=True)
    weights = read_checkpoint(tmp_path, tiny_model(), CPU)
    assert weights is not None


def test_low_bit_states_are_low_bit_and_bf16_holds_everything_in_bf16() -> None:
    for name, kind in (("adamw8bit", "OptimState8bit"), ("adamw4bit", "OptimState4bit")):
        model = tiny_model()
        optimizer = build_optimizer(model, OptimConfig(name=name), CPU)
        TrainStep(model, optimizer, resolve_precision("fp32", CPU), CPU, 1.0)([_batches()[0]], lr=1e-3)
        big = model.transformer.h[0].mlp.c_fc.weight
        assert type(optimizer.state[big]["exp_avg"]).__name__ == kind
    model = tiny_model().to(weights_dtype(OptimConfig(name="adamw_bf16")))
    optimizer = build_optimizer(model, OptimConfig(name="adamw_bf16"), CPU)
    TrainStep(model, optimizer, resolve_precision("bf16", CPU), CPU, 1.0)([_batches()[0]], lr=1e-3)
    for p in model.parameters():
        assert p.dtype == optimizer.state[p]["exp_avg"].dtype == torch.bfloat16


@pytest.mark.parametrize("name", ["adamw8bit", "adamw4bit", "adamw_bf16"])
def test_a_low_bit_step_is_torchaos_own_without_a_compile_wrapper_per_parameter(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpt2_platform.train.optim import _TORCHAO_CLASSES, torchao_optim

    optim = OptimConfig(name=name)
    kwargs = {"bf16_stochastic_round": True} if name == "adamw_bf16" else {}
    models = [tiny_model().to(weights_dtype(optim)) for _ in range(2)]
    ours = build_optimizer(models[0], optim, CPU)
    twin = dict(zip(models[0].parameters(), models[1].parameters(), strict=True))
    groups = [{"params": [twin[p] for p in g["params"]], "weight_decay": g["weight_decay"]} for g in ours.param_groups]
    theirs = getattr(torchao_optim(), _TORCHAO_CLASSES[name])(groups, betas=(optim.beta1, optim.beta2), **kwargs)
    wrapped = []
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda *a, **k: wrapped.append(a) or real_compile(*a, **k))
    torch.manual_seed(1)
    for step in range(3):
        grads = [torch.randn_like(p) * 1e-2 for p in models[0].parameters()]
        counts = []
        for optimizer, model in ((ours, models[0]), (theirs, models[1])):
            for p, grad in zip(model.parameters(), grads, strict=True):
                p.grad = grad.clone()
            for group in optimizer.param_groups:
                group["lr"].fill_(1e-3)
            wrapped.clear()
            torch.manual_seed(100 + step)  # the same random bits for bf16's stochastic rounding
            with torch.compiler.set_stance("force_eager"):  # the same arithmetic, without compiling on a CPU
                optimizer.step()
            counts.append(len(wrapped))
        assert counts[0] == 0 and counts[1] > 0, f"torch.compile calls a step (ours, torchao's): {counts}"
    for mine, other in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(mine, other)
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(ours.state[mine][key].dequantize() if name != "adamw_bf16" else ours.state[mine][key],
                               theirs.state[other][key].dequantize() if name != "adamw_bf16" else theirs.state[other][key])  # fmt: skip


def test_a_low_bit_optimizer_steps_under_the_fp16_grad_scaler() -> None:
    model = tiny_model()
    step = TrainStep(
        model, build_optimizer(model, OptimConfig(name="adamw8bit"), CPU), resolve_precision("fp16", CPU), CPU, 1.0
    )
    losses = [float(step([_batches()[0]], lr=3e-3)[0]) for _ in range(4)]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["optim.name=adam9bit"], r"optim.name .*'adam9bit'"),
        (["optim.offload=disk"], r"optim.offload .*'disk'"),
        (["optim.offload=optimizer"], "optim.offload=optimizer needs GPU workers"),
        (["optim.name=adamw_bf16", "train.precision=fp16"], "optim.name=adamw_bf16 holds the weights in bf16"),
        (["optim.name=adamw_bf16", "train.precision=fp32"], "train.precision=fp32 cannot apply"),
        (["optim.offload=optimizer", "scaling.use_gpu=true", "scaling.strategy=fsdp"], "scaling.strategy=fsdp"),
        (["optim.offload=optimizer", "scaling.use_gpu=true", "scaling.num_workers=2"], "one worker only"),
        (["optim.offload=optimizer", "scaling.use_gpu=true", "train.precision=fp16"], "train.precision=fp16"),
        (
            ["optim.offload=optimizer_and_gradients", "scaling.use_gpu=true", "train.grad_accum_steps=2"],
            "train.grad_accum_steps=2 cannot accumulate",
        ),
    ],
)
def test_settings_that_cannot_work_are_refused_in_one_line(overrides: list[str], expected: str) -> None:
    with pytest.raises(ConfigError, match=expected) as refused:
        load(None, overrides)
    assert "\n" not in str(refused.value)


def test_a_missing_torchao_is_refused_naming_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "torchao" else find_spec(name))
    with pytest.raises(ConfigError, match=r"optim.name=adamw8bit needs torchao, which is not installed"):
        OptimConfig(name="adamw8bit")
    assert OptimConfig().name == "adamw"  # the default needs nothing more


QUIET_PROBE = """
import sys
import torch
from gpt2_platform.model import GPT2, preset
from gpt2_platform.train.config import OptimConfig
from gpt2_platform.train.step import TrainStep, build_optimizer, resolve_precision

cpu = torch.device("cpu")
model = GPT2(preset("tiny"))
build_optimizer(model, OptimConfig(), cpu)
print("torchao after adamw:", "torchao" in sys.modules)
optimizer = build_optimizer(model, OptimConfig(name="adamw8bit"), cpu)
ids = torch.randint(0, 257, (2, 17))
TrainStep(model, optimizer, resolve_precision("fp32", cpu), cpu, 1.0)([(ids[:, :-1], ids[:, 1:])], lr=1e-3)
print("stepped")
"""


def test_torchao_is_imported_only_when_chosen_and_quietly() -> None:
    """Its import logs a warning for each CUDA extension a CPU install lacks, and one from torch's pytree."""
    import subprocess
    import sys

    from conftest import REPO_ROOT

    env = {"PYTHONPATH": str(REPO_ROOT / "platform"), "PATH": "/usr/bin:/bin", "HOME": str(Path.home())}
    done = subprocess.run([sys.executable, "-c", QUIET_PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == "torchao after adamw: False\nstepped\n" and done.stderr == "", done.stderr


class _Copied:
    def synchronize(self) -> None:
        pass


class CPUOffloadOptimizer:
    """What clip_gradients reads of torchao's (which needs CUDA to be built): the CPU copies of the offloaded
    parameters, the events of their gradients' copies, and the small parameters left on the device."""

    def __init__(self, offloaded: list[tuple[torch.Tensor, torch.Tensor]], kept: list[torch.Tensor]) -> None:
        self.param_d2h_map = dict(offloaded)
        self.queue = {device: _Copied() for device, _ in offloaded}
        self.d_param_groups = [{"params": kept}]


def test_offloaded_clipping_measures_and_clips_the_cpu_copies_the_step_uses() -> None:
    from gpt2_platform.train.optim import clip_gradients

    def param(grad: list[float] | None) -> torch.Tensor:
        p = torch.zeros(2, requires_grad=True)
        p.grad = None if grad is None else torch.tensor(grad)
        return p

    device_a, host_a = param(None), param([3.0, 0.0])  # the GPU gradient already freed (optimizer_and_gradients)
    device_b, host_b = param([100.0, 100.0]), param([0.0, 4.0])  # a GPU gradient left over: not what steps
    kept = param([0.0, 12.0])
    optimizer = CPUOffloadOptimizer([(device_a, host_a), (device_b, host_b)], [kept])
    model = torch.nn.ParameterList([device_a, device_b, kept])
    norm = clip_gradients(model, optimizer, max_norm=6.5)  # type: ignore[arg-type]
    assert float(norm) == pytest.approx(13.0)  # sqrt(3² + 4² + 12²)
    scale = 6.5 / 13.0
    torch.testing.assert_close(host_a.grad, torch.tensor([3.0 * scale, 0.0]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(kept.grad, torch.tensor([0.0, 12.0 * scale]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(device_b.grad, torch.tensor([100.0, 100.0]))
