"""LoRA: a trainable low-rank update `scale * B @ A` beside each targeted projection, the base weights frozen.

Our own small module rather than `peft`'s layers, for three reasons:
- peft wraps each target as `<name>.base_layer`, which renames the base weights: run checkpoints, resume,
  FSDP's gathered state dicts and checkpoint.py's Conv1D transposes all key on the plain names, and keep
  them here (`c_attn.weight` stays `c_attn.weight`; the adapter adds `c_attn.lora_A.weight` and
  `c_attn.lora_B.weight`, the names peft saves for transformers' GPT-2).
- the forward is one expression with nothing to dispatch (peft loops over active adapters and checks
  flags per call), so torch.compile traces it whole and FSDP2 shards it like any other block parameter.
- training workers need not import peft (and the torchao it pulls in).
The adapter's files are peft's format (adapter.py), so what we train loads with `PeftModel.from_pretrained`.

For inference the update is merged into the weights (`merge_lora`): the engine reads weights directly
(engine/kernels.py), so an unmerged adapter would be bypassed there, and merged weights cost nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from gpt2_platform.config_loader import ConfigError

# Our projections, by their names inside a block: transformers' GPT-2 names the same modules the same way.
TARGETS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
# The names peft users write (a module's last name): c_proj is both the attention's and the MLP's.
_SHORT_TARGETS = {"c_attn": ("attn.c_attn",), "c_proj": ("attn.c_proj", "mlp.c_proj"), "c_fc": ("mlp.c_fc",)}


@dataclass
class LoraConfig:
    """`model.lora`: which projections get an adapter, of what rank and scale."""

    r: int = 16
    """Rank of each adapter's update B @ A."""
    alpha: float = 32.0
    """The update is scaled by alpha / r (so a change of r keeps the update's size)."""
    dropout: float = 0.0
    """Dropout on the adapter's input, in training only."""
    targets: list[str] = field(default_factory=lambda: list(TARGETS))
    """Projections with an adapter: attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj (peft's c_attn, c_proj
    and c_fc are accepted: c_proj is both)."""
    export_merged: bool = False
    """Also export the base model with the adapter merged in: a plain Hugging Face directory."""

    def __post_init__(self) -> None:
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise ConfigError(f"model.lora.r must be an integer >= 1, got {self.r!r}")
        if not (isinstance(self.alpha, (int, float)) and math.isfinite(self.alpha) and self.alpha > 0):
            raise ConfigError(f"model.lora.alpha must be a number > 0, got {self.alpha!r}")
        if not (isinstance(self.dropout, (int, float)) and 0.0 <= self.dropout < 1.0):
            raise ConfigError(f"model.lora.dropout must be in [0, 1), got {self.dropout!r}")
        if isinstance(self.targets, str):
            self.targets = [self.targets]
        wanted: set[str] = set()
        for name in self.targets:
            if name not in TARGETS and name not in _SHORT_TARGETS:
                raise ConfigError(
                    f"model.lora.targets: {name!r} is not a projection; choose among {', '.join(TARGETS)}"
                )
            wanted.update(_SHORT_TARGETS.get(name, (name,)))
        if not wanted:
            raise ConfigError(f"model.lora.targets is empty; name at least one of {', '.join(TARGETS)}")
        self.targets = [name for name in TARGETS if name in wanted]  # one spelling, in the model's order

    @property
    def scale(self) -> float:
        return self.alpha / self.r


class LoraLinear(nn.Module):
    """`nn.Linear`'s weight and bias (the same Parameters, frozen) plus `scale * lora_B(lora_A(x))`.

    Holds the base weight under its own name rather than a wrapped `base_layer`, so state dicts keep the
    base model's names. lora_B starts at zero: a fresh adapter leaves the model unchanged.
    """

    def __init__(self, base: nn.Linear, r: int, alpha: float, dropout: float) -> None:
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.r, self.alpha = r, alpha
        self.scale = alpha / r
        factory = dict(device=base.weight.device, dtype=base.weight.dtype)
        self.lora_A = nn.Linear(self.in_features, r, bias=False, **factory)
        self.lora_B = nn.Linear(r, self.out_features, bias=False, **factory)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        if not base.weight.is_meta:
            # peft's initialisation: A as nn.Linear's default, B zero.
            nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
            nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scale

    def merged(self) -> nn.Linear:
        """A plain nn.Linear computing the same function (dropout aside): W + scale * B @ A."""
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        with torch.no_grad():
            delta = self.lora_B.weight.float() @ self.lora_A.weight.float() * self.scale  # (out, in)
            linear.weight = nn.Parameter((self.weight.float() + delta).to(self.weight.dtype))
            if self.bias is not None:
                linear.bias = nn.Parameter(self.bias.detach().clone())
        return linear

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, r={self.r}, alpha={self.alpha:g}"


def target_modules(model: nn.Module, targets: list[str]) -> dict[str, nn.Module]:
    """{full name: module} of the targeted projections of every block, e.g. `transformer.h.0.attn.c_attn`."""
    found = {}
    for name, module in model.named_modules():
        if name.startswith("transformer.h.") and any(name.endswith("." + target) for target in targets):
            found[name] = module
    return found


def apply_lora(model: nn.Module, config: LoraConfig) -> nn.Module:
    """Freeze every parameter of `model` (a plain GPT2, before parallelize) and put a trainable adapter on
    each targeted projection, in place; returns the model.

    Apply before activation checkpointing, compile and DDP/FSDP (train/parallelize.py), and before
    loading a LoRA run's checkpoint (its weights hold the adapters).
    """
    modules = target_modules(model, config.targets)
    assert modules, f"the model has none of the projections {config.targets}"
    for param in model.parameters():
        param.requires_grad_(False)
    for name, module in modules.items():
        if isinstance(module, LoraLinear):
            raise ValueError(f"{name} already has a LoRA adapter; apply_lora once per model")
        assert type(module) is nn.Linear, f"{name} is a {type(module).__name__}, not the nn.Linear LoRA wraps"
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, LoraLinear(module, config.r, config.alpha, config.dropout))
    return model


def lora_modules(model: nn.Module) -> dict[str, LoraLinear]:
    """{full name: adapter} of the model's LoRA projections (none for a plain or merged model)."""
    return {name: module for name, module in model.named_modules() if isinstance(module, LoraLinear)}


def has_lora(model: nn.Module) -> bool:
    return bool(lora_modules(model))


def merge_lora(model: nn.Module) -> nn.Module:
    """Replace each adapter-carrying projection by a plain nn.Linear with the update merged in, in place:
    the model computes the same (in eval) with the plain architecture, which checkpoint.save_pretrained
    writes as a Hugging Face directory transformers loads alone."""
    for name, module in lora_modules(model).items():
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, module.merged())
    return model


def is_lora_key(name: str) -> bool:
    """Whether a state-dict key is an adapter's (`...c_attn.lora_A.weight`)."""
    return ".lora_A." in name or ".lora_B." in name
