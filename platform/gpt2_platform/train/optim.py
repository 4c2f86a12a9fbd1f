"""Optimizer memory as a setting: which AdamW holds its states how (optim.name) and where (optim.offload).

    adamw       torch's AdamW: fp32 states (8 bytes a parameter), fused on a GPU.
    adamw8bit   torchao's AdamW8bit: both moments in 8 bits with a scale per block (2 bytes a parameter).
    adamw4bit   torchao's AdamW4bit: 4-bit moments (1 byte a parameter), a little further from adamw's curve.
    adamw_bf16  torchao's AdamW over a model held in bf16: weights, gradients and both moments in bf16
                (8 bytes a parameter in all, against adamw's 16). The update is computed in fp32 and rounded
                stochastically into the bf16 weight: a plain rounding drops every update smaller than half a
                bf16 step of the weight, which late in training is most of them.

`offload: optimizer` keeps the states and the step on the CPU (torchao's CPUOffloadOptimizer: gradients go to
the CPU during backward, the weights come back after the step); `optimizer_and_gradients` also frees each
GPU gradient once copied, which saves their memory but cannot accumulate micro-batches.

torchao's low-bit states are tensor subclasses whose blocks depend on each shard's shape. A checkpoint holds
them dequantized, keyed by parameter name, as plain tensors: any number of workers loads it with
`torch.load(weights_only=True)`, and it is quantized again into this run's blocks.
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from gpt2_platform.checkpoint import clean_state_dict
from gpt2_platform.config_loader import ConfigError
from gpt2_platform.train.config import OptimConfig

logger = logging.getLogger(__name__)

_TORCHAO_CLASSES = {"adamw8bit": "AdamW8bit", "adamw4bit": "AdamW4bit", "adamw_bf16": "_AdamW"}
_MOMENTS = {"exp_avg": True, "exp_avg_sq": False, "max_exp_avg_sq": False}  # name -> signed


def weights_dtype(optim: OptimConfig) -> torch.dtype:
    """The dtype the model's weights (and so its gradients) are held in for this optimizer."""
    return torch.bfloat16 if optim.name == "adamw_bf16" else torch.float32


def precision_for(optim: OptimConfig, requested: str) -> str:
    """train.precision as this optimizer runs it: weights held in bf16 compute in bf16 ("auto" too, on a CPU)."""
    return "bf16" if optim.name == "adamw_bf16" else requested


@functools.cache
def torchao_optim() -> Any:
    """torchao.optim, imported on first use and quietly: its import tries CUDA extensions a CPU install lacks
    and registers an enum with torch's pytree, each of which logs a warning that asks nothing of the user."""
    noisy = [logging.getLogger("torchao"), logging.getLogger("torch.utils._pytree")]
    levels = [log.level for log in noisy]
    for log in noisy:
        log.setLevel(logging.ERROR)
    try:
        import torchao.optim
    finally:
        for log, level in zip(noisy, levels, strict=True):
            log.setLevel(level)
    # Said at the first compiled step of every low-bit state; it only means that compile's cache skips them.
    warnings.filterwarnings("ignore", message=r".*does not implement _stable_hash_for_caching")
    return torchao.optim


def check_same_setting(optim: OptimConfig, saved_config: dict) -> None:
    """Refuse to resume a checkpoint written under another optim.name or optim.offload (`saved_config`: the
    checkpoint's config.yaml): its state is laid out for that optimizer."""
    saved = saved_config.get("optim", {})
    for field in ("name", "offload"):
        before, now = saved.get(field, getattr(OptimConfig, field)), getattr(optim, field)
        if before != now:
            raise ConfigError(
                f"optim.{field}={now} cannot resume this run's checkpoint, written with optim.{field}={before}; "
                f"set optim.{field}={before}, or start a new run from its export (model.init_from)"
            )


def make_optimizer(groups: list[dict], optim: OptimConfig, device: torch.device) -> torch.optim.Optimizer:
    """The optimizer `optim` asks for over parameter groups (their own weight decay each)."""
    params = [p for group in groups for p in group["params"]]
    want_bf16 = optim.name == "adamw_bf16"
    if want_bf16 != all(p.dtype == torch.bfloat16 for p in params):
        raise ValueError(f"optim.name={optim.name} needs the model's weights in {weights_dtype(optim)} (weights_dtype)")
    kwargs: dict[str, Any] = {"lr": optim.lr, "betas": (optim.beta1, optim.beta2)}
    if optim.name == "adamw":
        optimizer_class: Any = torch.optim.AdamW
        # Fused needs every parameter on the GPU: FSDP's CPU offload keeps them (and this step) on the CPU.
        on_gpu = device.type == "cuda" and all(p.device.type == "cuda" for p in params)
        kwargs["fused"] = on_gpu or None
    else:
        optimizer_class = getattr(torchao_optim(), _TORCHAO_CLASSES[optim.name])
        if want_bf16:
            kwargs["bf16_stochastic_round"] = True
    if optim.offload != "none":
        if device.type != "cuda":
            raise ValueError(f"optim.offload={optim.offload} moves optimizer state off a GPU; this worker has none")
        offload = torchao_optim().CPUOffloadOptimizer
        gradients = optim.offload == "optimizer_and_gradients"
        kwargs.pop("fused", None)  # torchao picks the CPU's fused AdamW itself
        return offload(groups, optimizer_class, offload_gradients=gradients, **kwargs)
    optimizer = optimizer_class(groups, **kwargs)
    if optim.name != "adamw":
        _compile_update_once(optimizer)
        if device.type == "cpu":
            _step_eagerly(optimizer)
    return optimizer


def _compile_update_once(optimizer: torch.optim.Optimizer) -> None:
    """torchao's step, with its per-parameter update compiled once instead of wrapped in a new torch.compile
    for every parameter of every step. Building that wrapper (dynamo checks the function's source file on
    the disk each time) costs the host more than the update's kernels take on a GPU, and gpt2-xl has some
    580 parameters, so the GPU waited on it (tools/probes/optimizer_step_host.py times both on a CPU). The
    arithmetic is torchao's own `single_param_adam`, its arguments as torchao's step passes them."""
    from torchao.optim.adam import single_param_adam

    update = torch.compile(single_param_adam, fullgraph=True, dynamic=False)
    new_buffer = optimizer._new_buffer  # type: ignore[attr-defined]
    is_adamw, stochastic_round = optimizer.is_adamw, optimizer.bf16_stochastic_round  # type: ignore[attr-defined]

    @torch.no_grad()
    def step(closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # One compiled variant per parameter shape and dtype, a fixed number for a model: no cache limit.
        with torch._dynamo.utils.disable_cache_limit():
            for group in optimizer.param_groups:
                if not isinstance(group["lr"], torch.Tensor):
                    raise RuntimeError("a low-bit optimizer's lr must stay a tensor: change it with set_lr")
                beta1, beta2 = group["betas"]
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    state = optimizer.state[p]
                    if not state:
                        state["step"] = torch.tensor(0.0)
                        state["exp_avg"], state["exp_avg_sq"] = new_buffer(p, True), new_buffer(p, False)
                        if group["amsgrad"]:
                            state["max_exp_avg_sq"] = new_buffer(p, False)
                    state["step"] += 1
                    # p.detach(): torchao's way around compile's trouble with FSDP2's DTensor parameters.
                    update(p.detach(), p.grad, state["step"], state["exp_avg"], state["exp_avg_sq"],
                           state.get("max_exp_avg_sq"), group["lr"], beta1, beta2, group["weight_decay"],
                           group["eps"], is_adamw, stochastic_round and p.dtype is torch.bfloat16)  # fmt: skip
        return loss

    optimizer.step = step  # type: ignore[method-assign]


def _step_eagerly(optimizer: torch.optim.Optimizer) -> None:
    """torchao compiles its update once per parameter shape; on a CPU that takes longer than a small run
    trains, and the eager update is the same arithmetic."""
    compiled_step = optimizer.step

    @functools.wraps(compiled_step)
    def step(*args: Any, **kwargs: Any) -> Any:
        with torch.compiler.set_stance("force_eager"):
            return compiled_step(*args, **kwargs)

    optimizer.step = step  # type: ignore[method-assign]


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """torchao keeps each group's lr as a tensor (its compiled step takes it as an input, not a constant)."""
    for group in optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


def is_offloaded(optimizer: torch.optim.Optimizer) -> bool:
    return type(optimizer).__name__ == "CPUOffloadOptimizer"


def clip_gradients(model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
    """The global gradient norm, clipped to `max_norm` if positive. An offloaded optimizer steps with the CPU
    copies its backward hooks took, so those are the gradients measured and clipped."""
    if not is_offloaded(optimizer):
        if max_norm > 0:
            return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        return torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    for copied in optimizer.queue.values():  # the copies to the CPU, on a side stream
        copied.synchronize()
    params = [optimizer.param_d2h_map[p] for p in optimizer.queue]
    params += [p for group in optimizer.d_param_groups for p in group["params"]]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_([p for p in params if p.grad is not None], max_norm, norm)
    return norm


# ---- checkpoints: the states dequantized, by parameter name -------------------------------------------------


def _units(model: nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[tuple[torch.optim.Optimizer, dict]]:
    """(an optimizer that holds states, {name: its parameter}); CPUOffloadOptimizer holds one per offloaded
    parameter (over its CPU copy) and one for the small ones it leaves on the GPU."""
    names = {p: name for name, p in clean_state_dict(dict(model.named_parameters())).items()}
    if not is_offloaded(optimizer):
        yield optimizer, {names[p]: p for group in optimizer.param_groups for p in group["params"]}
        return
    for p, inner in optimizer.optim_dict.items():
        yield inner, {names[p]: optimizer.param_d2h_map[p]}
    if optimizer.d_opt is not None:
        yield optimizer.d_opt, {names[p]: p for group in optimizer.d_opt.param_groups for p in group["params"]}


def _whole(value: torch.Tensor) -> torch.Tensor:
    """A state tensor as a plain, whole tensor on the CPU (all ranks take part for a sharded one)."""
    if isinstance(value, DTensor):
        local = value.to_local()
        if type(local) is not torch.Tensor:
            local = local.dequantize()
        plain = DTensor.from_local(local, value.device_mesh, value.placements, shape=value.shape, stride=value.stride())
        return plain.full_tensor().cpu()
    if type(value) is not torch.Tensor:
        value = value.dequantize()
    return value.detach().cpu().clone()


def portable_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """On every rank (a sharded model's states are gathered): {"state": {name: {key: plain tensor}},
    "param_groups": [hyperparameters]}. Loads into any number of workers, whatever the sharding."""
    state: dict[str, dict] = {}
    for unit, params in _units(model, optimizer):
        for name, p in params.items():
            if p in unit.state:
                state[name] = {key: _whole(value) for key, value in unit.state[p].items()}
    groups = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    return {"state": state, "param_groups": [{k: _plain(v) for k, v in g.items()} for g in groups]}


def _plain(value: Any) -> Any:
    return value.item() if isinstance(value, torch.Tensor) else value


def _placed(whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A whole state tensor laid out as parameter `like` is: this rank's shard of a sharded one."""
    if isinstance(like, DTensor):
        mesh_device = torch.device(like.device_mesh.device_type)
        # Every rank holds the whole tensor: each takes its own shard, without a scatter.
        shard = distribute_tensor(whole.to(mesh_device), like.device_mesh, like.placements, src_data_rank=None)
        return shard.to(like.device)
    return whole.to(like.device)


def load_portable_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, saved: dict) -> None:
    """`portable_state_dict`'s output into this run's optimizer (the same optim.name and offload), sharded as
    this run shards, each low-bit moment quantized again into this run's blocks."""
    found = saved["state"]
    for unit, params in _units(model, optimizer):
        state = {}
        for position, (name, p) in enumerate(params.items()):
            if name in found:
                state[position] = {
                    key: value.cpu() if key == "step" else _placed(value, p) for key, value in found[name].items()
                }
        groups = unit.state_dict()["param_groups"]
        unit.load_state_dict({"state": state, "param_groups": groups})
        _quantize_again(unit, list(params.values()))


def _quantize_again(unit: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    """torchao's states loaded as plain tensors, back into the low-bit buffers its step makes."""
    new_buffer = getattr(unit, "_new_buffer", None)
    if new_buffer is None:  # torch's AdamW (an offloaded one)
        return
    for p in params:
        for key, signed in _MOMENTS.items():
            if key in unit.state.get(p, {}):
                buffer = new_buffer(p, signed)
                buffer.copy_(unit.state[p][key])
                unit.state[p][key] = buffer


def uses_portable_state(optimizer: torch.optim.Optimizer) -> bool:
    """Whether checkpoints hold this optimizer's state in `portable_state_dict`'s form (every optimizer but
    torch's own AdamW on the GPU, whose checkpoints stay as they were)."""
    return is_offloaded(optimizer) or hasattr(optimizer, "_new_buffer")
