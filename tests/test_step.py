"""gpt2_platform.train.step (and parallelize): accumulation, schedule, precision, optimizer groups."""

from __future__ import annotations

import math

import pytest
import torch

from gpt2_platform.train.config import OptimConfig
from gpt2_platform.train.parallelize import parallelize
from gpt2_platform.train.step import Precision, TrainStep, build_optimizer, lr_at, resolve_precision
from helpers_unit import random_ids, tiny_model

CPU = torch.device("cpu")
FP32 = Precision("fp32", None, use_grad_scaler=False)


def _batch(batch: int, seq_len: int = 32, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    ids = random_ids(batch, seq_len + 1, seed=seed)
    return ids[:, :-1], ids[:, 1:]


def _sgd_step(model: torch.nn.Module) -> TrainStep:
    # Plain SGD with lr 1: each parameter moves by exactly minus its gradient.
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.0)
    return TrainStep(model, optimizer, FP32, CPU, grad_clip=0.0)


def _gradients(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    _, loss = model(inputs, targets)
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def test_accumulated_micro_batches_equal_one_large_batch() -> None:
    inputs, targets = _batch(8)
    accumulated, single = tiny_model(seed=0), tiny_model(seed=0)
    before = {name: p.detach().clone() for name, p in single.named_parameters()}
    with torch.no_grad():
        _, big_batch_loss = single(inputs, targets)

    micro = [(inputs[i : i + 2], targets[i : i + 2]) for i in range(0, 8, 2)]
    loss_accumulated, _ = _sgd_step(accumulated)(micro, lr=1.0)
    loss_single, _ = _sgd_step(single)([(inputs, targets)], lr=1.0)

    torch.testing.assert_close(loss_accumulated, big_batch_loss, atol=1e-6, rtol=0)
    torch.testing.assert_close(loss_single, big_batch_loss, atol=1e-6, rtol=0)
    moved = 0
    for (name, a), b in zip(accumulated.named_parameters(), single.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0, msg=name)
        moved += not torch.equal(b, before[name])
    assert moved == len(before)  # the step really updated every parameter


def test_step_sets_lr_clears_gradients_and_reports_the_norm() -> None:
    model = tiny_model(seed=0)
    inputs, targets = _batch(2)
    expected_norm = torch.nn.utils.get_total_norm(list(_gradients(model, inputs, targets).values()))
    model.zero_grad(set_to_none=True)
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.5), FP32, CPU, grad_clip=0.0)
    _, grad_norm = step([(inputs, targets)], lr=0.125)
    assert step.optimizer.param_groups[0]["lr"] == 0.125
    assert all(p.grad is None for p in model.parameters())
    torch.testing.assert_close(grad_norm, expected_norm, rtol=1e-5, atol=0)


def test_grad_clip_bounds_the_update() -> None:
    inputs, targets = _batch(2)
    clipped, reference = tiny_model(seed=0), tiny_model(seed=0)
    grads = _gradients(reference, inputs, targets)
    norm = torch.nn.utils.get_total_norm(list(grads.values()))
    clip = float(norm) / 4
    before = [p.detach().clone() for p in clipped.parameters()]
    step = TrainStep(clipped, torch.optim.SGD(clipped.parameters(), lr=1.0), FP32, CPU, grad_clip=clip)
    _, reported = step([(inputs, targets)], lr=1.0)
    torch.testing.assert_close(reported, norm, rtol=1e-5, atol=0)  # the norm before clipping
    update = torch.nn.utils.get_total_norm([b - p.detach() for b, p in zip(before, clipped.parameters(), strict=True)])
    assert float(update) == pytest.approx(clip, rel=1e-3)


def test_lr_warmup_is_linear_then_cosine_decays_to_min_lr() -> None:
    optim = OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=10)
    max_steps = 100
    assert lr_at(1, optim, max_steps) == pytest.approx(optim.lr / 10)
    for step in range(1, 11):
        assert lr_at(step, optim, max_steps) == pytest.approx(optim.lr * step / 10)
    assert lr_at(10, optim, max_steps) == pytest.approx(optim.lr)
    assert lr_at(max_steps, optim, max_steps) == pytest.approx(optim.min_lr)
    assert lr_at(max_steps + 50, optim, max_steps) == pytest.approx(optim.min_lr)
    after_warmup = [lr_at(step, optim, max_steps) for step in range(10, max_steps + 1)]
    assert all(a > b for a, b in zip(after_warmup, after_warmup[1:], strict=False))
    # Cosine, not linear: halfway through the decay it is midway, a quarter in it is still near the peak.
    assert lr_at(55, optim, max_steps) == pytest.approx((optim.lr + optim.min_lr) / 2)
    quarter = optim.min_lr + 0.5 * (1 + math.cos(math.pi / 4)) * (optim.lr - optim.min_lr)
    assert lr_at(32.5, optim, max_steps) == pytest.approx(quarter)


def test_lr_without_warmup_starts_at_peak() -> None:
    optim = OptimConfig(lr=1e-3, min_lr=0.0, warmup_steps=0)
    assert lr_at(0, optim, 50) == pytest.approx(1e-3)
    assert lr_at(50, optim, 50) == pytest.approx(0.0, abs=1e-12)
    assert all(math.isfinite(lr_at(step, optim, 1)) for step in range(0, 5))


def test_resolve_precision() -> None:
    auto = resolve_precision("auto", CPU)
    assert (auto.name, auto.autocast_dtype, auto.use_grad_scaler) == ("fp32", None, False)
    fp16 = resolve_precision("fp16", CPU)
    assert (fp16.autocast_dtype, fp16.use_grad_scaler) == (torch.float16, True)
    bf16 = resolve_precision("bf16", CPU)
    assert (bf16.autocast_dtype, bf16.use_grad_scaler) == (torch.bfloat16, False)
    assert resolve_precision("fp32", CPU) == auto
    with pytest.raises(ValueError, match="fp8"):
        resolve_precision("fp8", CPU)


def test_build_optimizer_decays_matrices_only() -> None:
    model = tiny_model()
    optim = OptimConfig(lr=2e-3, weight_decay=0.05, beta1=0.8, beta2=0.9)
    optimizer = build_optimizer(model, optim, CPU)
    assert isinstance(optimizer, torch.optim.AdamW)
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0
    assert decay["lr"] == no_decay["lr"] == 2e-3 and decay["betas"] == (0.8, 0.9)
    names = {id(p): name for name, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    not_decayed = {names[id(p)] for p in no_decay["params"]}
    assert {
        "transformer.wte.weight",
        "transformer.h.0.attn.c_attn.weight",
        "transformer.h.1.mlp.c_proj.weight",
    } <= decayed
    assert {"transformer.h.0.attn.c_attn.bias", "transformer.h.0.ln_1.weight", "transformer.ln_f.bias"} <= not_decayed
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    # Every parameter exactly once (the tied head is the embedding).
    assert sorted(decayed | not_decayed) == sorted(names.values())
    assert len(decay["params"]) + len(no_decay["params"]) == len(names)


def test_fp16_step_on_cpu_uses_the_grad_scaler() -> None:
    model = tiny_model(seed=0)
    before = [p.detach().clone() for p in model.parameters()]
    step = TrainStep(model, build_optimizer(model, OptimConfig(), CPU), resolve_precision("fp16", CPU), CPU, 1.0)
    assert step.scaler.is_enabled()
    with step.autocast():
        logits, _ = model(*_batch(1))
    assert logits.dtype == torch.float16
    loss, grad_norm = step([_batch(4)], lr=1e-3)
    assert math.isfinite(float(loss)) and math.isfinite(float(grad_norm))
    # Unscaled before clipping: the norm is the true one, not tens of thousands times it.
    assert 0 < float(grad_norm) < 100
    assert step.scaler.get_scale() > 1
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_bf16_steps_on_cpu_reduce_the_loss() -> None:
    model = tiny_model(seed=0)
    step = TrainStep(model, build_optimizer(model, OptimConfig(), CPU), resolve_precision("bf16", CPU), CPU, 1.0)
    assert not step.scaler.is_enabled()
    with step.autocast():
        logits, _ = model(*_batch(1))
    assert logits.dtype == torch.bfloat16
    batch = _batch(4, seed=1)
    losses = [float(step([batch], lr=1e-3)[0]) for _ in range(20)]
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 1.0, losses
    assert all(p.dtype == torch.float32 for p in model.parameters())  # master weights stay fp32


def test_gradient_checkpointing_gives_the_same_gradients() -> None:
    inputs, targets = _batch(2, seed=2)
    plain = tiny_model(seed=0)
    keys = list(plain.state_dict())
    expected = _gradients(plain, inputs, targets)

    base = tiny_model(seed=0)
    checkpointed = parallelize(base, CPU, "off", gradient_checkpointing=True)
    wrapped = [m for m in checkpointed.modules() if type(m).__name__ == "CheckpointWrapper"]
    assert len(wrapped) == base.config.n_layer  # one per block: checkpointing is really on
    assert list(checkpointed.state_dict()) == keys

    model_grads = _gradients(checkpointed, inputs, targets)
    got = {name.replace("_checkpoint_wrapped_module.", ""): g for name, g in model_grads.items()}
    assert sorted(got) == sorted(expected)
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, atol=1e-5, rtol=0, msg=name)
    # Its weights still load into a plain model.
    tiny_model(seed=1).load_state_dict(checkpointed.state_dict())


def test_checkpointing_some_blocks_wraps_only_those_and_keeps_the_gradients() -> None:
    inputs, targets = _batch(2, seed=3)
    expected = _gradients(tiny_model(seed=0), inputs, targets)
    base = tiny_model(seed=0)
    checkpointed = parallelize(base, CPU, "off", gradient_checkpointing=True, checkpoint_blocks=1)
    blocks = list(checkpointed.transformer.h)
    assert [type(block).__name__ for block in blocks] == ["CheckpointWrapper", "Block"]  # the first only
    got = {
        name.replace("_checkpoint_wrapped_module.", ""): g
        for name, g in _gradients(checkpointed, inputs, targets).items()
    }
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, atol=1e-5, rtol=0, msg=name)
    none = parallelize(tiny_model(seed=0), CPU, "off", gradient_checkpointing=True, checkpoint_blocks=0)
    assert not [m for m in none.modules() if type(m).__name__ == "CheckpointWrapper"]


def test_parallelize_off_without_distributed_returns_the_model() -> None:
    model = tiny_model()
    assert parallelize(model, CPU, "off") is model
