"""LoRA adapters in peft's format: `adapter_config.json` + `adapter_model.safetensors`.

What we write, `PeftModel.from_pretrained(GPT2LMHeadModel...)` loads (and vLLM, and any hub user), and
we load the LoRA adapters peft saves for transformers' GPT-2. Our module names are transformers' GPT-2
names, and a LoRA's A `(r, in)` and B `(out, r)` have the same layout in both (peft keeps them as
nn.Linear even over GPT-2's Conv1D), so keys map one to one under peft's `base_model.model.` prefix.

For inference an adapter is merged into the base weights at load (`checkpoint.load_pretrained(...,
adapter=...)`): the engine then runs a plain model, at the base model's speed.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from gpt2_platform import checkpoint
from gpt2_platform.lora import TARGETS, LoraConfig, is_lora_key, lora_modules, merge_lora
from gpt2_platform.model import GPT2, GPT2Config

logger = logging.getLogger(__name__)

ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
# peft's prefix for a PeftModel's keys: its LoraModel (`base_model`) over the transformers model (`model`).
PEFT_PREFIX = "base_model.model."
_KEY = re.compile(r"transformer\.h\.(\d+)\.(" + "|".join(re.escape(t) for t in TARGETS) + r")\.lora_([AB])\.weight")
# peft LoraConfig fields that make an adapter compute something a merge of B @ A does not, each with the
# value under which it changes nothing.
_REFUSED_FIELDS: dict[str, object] = {
    "use_dora": False,
    "bias": "none",
    "lora_bias": False,
    "modules_to_save": None,
    "alpha_pattern": None,
    "layer_replication": None,
    "trainable_token_indices": None,
    "target_parameters": None,
}


@dataclass
class Adapter:
    """A LoRA adapter read from disk, in our names: what `merge_adapter` adds to a model's weights."""

    source: str
    config: dict
    """adapter_config.json as written."""
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    """{module name (`transformer.h.0.attn.c_attn`): (A `(r, in)`, B `(out, r)`)}"""
    scales: dict[str, float]
    """{module name: the factor on B @ A}"""


def peft_config(lora: LoraConfig, base_name_or_path: str | None) -> dict:
    """adapter_config.json for our adapters: peft's LoraConfig fields, with the modules by transformers' names.

    fan_in_fan_out: transformers' GPT-2 keeps these projections as Conv1D (weight `(in, out)`); peft
    transposes its base weight, not the adapter, when merging.
    """
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_name_or_path,
        "r": lora.r,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": list(lora.targets),
        "fan_in_fan_out": True,
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "inference_mode": True,
    }


def _base_name(base_name_or_path: str | Path | None) -> str | None:
    """A local base by its absolute path (the adapter may be read from elsewhere), a hub name as given."""
    if base_name_or_path is None:
        return None
    path = Path(base_name_or_path).expanduser()
    return str(path.resolve()) if path.is_dir() else str(base_name_or_path)


def write_adapter_files(
    directory: Path, tensors: dict[str, torch.Tensor], lora: LoraConfig, base_name_or_path: str | Path | None
) -> None:
    """adapter_config.json and adapter_model.safetensors into an existing directory; `tensors` under our
    names (`transformer.h.0.attn.c_attn.lora_A.weight`)."""
    assert tensors and all(is_lora_key(name) for name in tensors), "only adapter weights go in an adapter"
    config = peft_config(lora, _base_name(base_name_or_path))
    (directory / ADAPTER_CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    peft_tensors = {PEFT_PREFIX + name: t.detach().contiguous().cpu() for name, t in tensors.items()}
    save_file(peft_tensors, str(directory / ADAPTER_WEIGHTS_NAME), metadata={"format": "pt"})


def lora_config_of(model: nn.Module) -> LoraConfig:
    """The LoraConfig `apply_lora` gave the model, read back from its adapters."""
    modules = lora_modules(checkpoint.unwrap(model))
    if not modules:
        raise ValueError("the model has no LoRA adapters to write (apply_lora first)")
    first = next(iter(modules.values()))
    dropout = getattr(first.lora_dropout, "p", 0.0)
    targets = sorted({name.split(".", 3)[3] for name in modules})
    return LoraConfig(r=first.r, alpha=first.alpha, dropout=dropout, targets=targets)


def write_adapter(
    model: nn.Module,
    directory: str | Path,
    base_name_or_path: str | Path | None,
    overwrite: bool = False,
    state_dict: dict[str, torch.Tensor] | None = None,
    extra: Callable[[Path], None] | None = None,
) -> Path:
    """The model's adapters as a peft adapter directory, atomically; `state_dict`: the model's gathered whole
    (a sharded model's own holds only its shards); `extra(dir)` may add files (a tokenizer)."""
    lora = lora_config_of(model)
    full = checkpoint.clean_state_dict(checkpoint.unwrap(model).state_dict() if state_dict is None else state_dict)
    tensors = {name: t for name, t in full.items() if is_lora_key(name)}
    with checkpoint.staged_directory(directory, overwrite=overwrite) as stage:
        write_adapter_files(stage, tensors, lora, base_name_or_path)
        if extra is not None:
            extra(stage)
    logger.info("saved LoRA adapter (r=%d, %d modules) to %s", lora.r, len(tensors) // 2, directory)
    return Path(directory)


def export_lora(
    checkpoint_dir: str | Path,
    lora: LoraConfig,
    adapter_dir: str | Path,
    base_name_or_path: str | Path | None,
    merged_dir: str | Path | None = None,
    extra: Callable[[Path], None] | None = None,
    base_dir: str | Path | None = None,
) -> None:
    """A LoRA run's checkpoint (a Hugging Face directory whose weights also hold the adapters) as a peft
    adapter directory and, given `merged_dir`, the base with the adapter merged in; given `base_dir`, the base
    alone (for a run whose base exists nowhere else: fresh weights of a preset). Each replaces any earlier
    export, atomically, and `extra(dir)` may add files (a tokenizer) to each."""
    checkpoint_dir = Path(checkpoint_dir)
    raw: dict[str, torch.Tensor] = {}
    for file in checkpoint.weight_files(checkpoint_dir):
        raw.update(load_file(str(file)))
    tensors = {name: t for name, t in raw.items() if is_lora_key(name)}
    if not tensors:
        raise ValueError(f"{checkpoint_dir} holds no LoRA adapter weights: it is not a LoRA run's checkpoint")
    with checkpoint.staged_directory(adapter_dir, overwrite=True) as stage:
        write_adapter_files(stage, tensors, lora, base_name_or_path)
        if extra is not None:
            extra(stage)
    logger.info("saved LoRA adapter (r=%d, %d modules) to %s", lora.r, len(tensors) // 2, adapter_dir)
    if merged_dir is None and base_dir is None:
        return
    base = {name: t for name, t in raw.items() if not is_lora_key(name)}
    model = checkpoint.model_from_hf_weights(checkpoint.read_config(checkpoint_dir), base, checkpoint_dir)
    if base_dir is not None:
        checkpoint.save_pretrained(model, base_dir, overwrite=True, extra=extra)
    if merged_dir is None:
        return
    merge_adapter(model, _adapter_from(str(checkpoint_dir), peft_config(lora, None), tensors))
    checkpoint.save_pretrained(model, merged_dir, overwrite=True, extra=extra)


def resolve_adapter_dir(name_or_path: str | Path) -> Path:
    """A local adapter directory, or a hub repo's adapter files downloaded into the Hugging Face cache."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if path.exists() or str(name_or_path).startswith((".", "/", "~")) or str(name_or_path).count("/") != 1:
        raise FileNotFoundError(
            f"adapter {name_or_path} is not a directory; point it at a peft adapter directory "
            f"({ADAPTER_CONFIG_NAME} + {ADAPTER_WEIGHTS_NAME})"
        )
    return checkpoint.resolve(str(name_or_path), allow_patterns=[ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME])


def read_adapter(name_or_path: str | Path) -> Adapter:
    """A peft LoRA adapter (local directory or hub name) in our names; what we cannot merge is refused in
    one line naming the file and the field or key."""
    directory = resolve_adapter_dir(name_or_path)
    config_path, weights_path = directory / ADAPTER_CONFIG_NAME, directory / ADAPTER_WEIGHTS_NAME
    if not config_path.is_file():
        raise FileNotFoundError(
            f"adapter {directory} holds no {ADAPTER_CONFIG_NAME}; point it at a peft adapter directory "
            f"({ADAPTER_CONFIG_NAME} + {ADAPTER_WEIGHTS_NAME})"
        )
    if not weights_path.is_file():
        pickled = (directory / "adapter_model.bin").is_file()
        raise FileNotFoundError(
            f"adapter {directory} holds no {ADAPTER_WEIGHTS_NAME}"
            + ("; its adapter_model.bin (pickle) is not loaded: save it with safetensors" if pickled else "")
        )
    config = checkpoint.read_json_object(config_path)
    return _adapter_from(str(directory), config, load_file(str(weights_path)), where=str(config_path))


def _adapter_from(source: str, config: dict, tensors: dict[str, torch.Tensor], where: str | None = None) -> Adapter:
    """An Adapter from adapter_config.json's fields and the weights (peft's keys or ours)."""
    where = where or source
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: peft_type {config.get('peft_type')!r} is not a LoRA adapter; only LORA is merged")
    for name, harmless in _REFUSED_FIELDS.items():
        value = config.get(name, harmless)
        if value != harmless and value not in (None, False, {}, []):
            raise ValueError(f"{where}: {name}={value!r} is not supported (only plain LoRA: {name}={harmless!r})")
    alpha, r = config.get("lora_alpha"), config.get("r")
    if not (_is_positive_number(alpha) and _is_positive_number(r)):
        raise ValueError(f"{where}: r and lora_alpha must be numbers > 0, got r={r!r}, lora_alpha={alpha!r}")
    parts: dict[str, dict[str, torch.Tensor]] = {}
    foreign = []
    for key, tensor in tensors.items():
        name = key.removeprefix(PEFT_PREFIX)
        if name.startswith("h."):  # saved over transformers' GPT2Model, which has no `transformer.` level
            name = "transformer." + name
        match = _KEY.fullmatch(name)
        if match is None:
            foreign.append(key)
            continue
        parts.setdefault(name.rsplit(".lora_", 1)[0], {})[match.group(3)] = tensor
    if foreign:
        raise ValueError(
            f"{source}: the adapter holds weights this model does not merge: {', '.join(sorted(foreign)[:3])}"
            f"{' ...' if len(foreign) > 3 else ''} (only LoRA on {', '.join(TARGETS)})"
        )
    if not parts:
        raise ValueError(f"{source}: the adapter holds no LoRA weights")
    weights, scales = {}, {}
    for module, pair in sorted(parts.items()):
        if set(pair) != {"A", "B"} or pair["A"].dim() != 2 or pair["B"].shape != (pair["B"].shape[0], len(pair["A"])):
            shapes = {side: tuple(t.shape) for side, t in pair.items()}
            raise ValueError(f"{source}: {module} needs lora_A (r, in) and lora_B (out, r), got {shapes}")
        rank = len(pair["A"])
        weights[module] = (pair["A"], pair["B"])
        scales[module] = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    return Adapter(source, config, weights, scales)


def _is_positive_number(value: object) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def check_adapter(adapter: Adapter, config: GPT2Config, base: str) -> None:
    """The adapter fits a GPT-2 of `config` (layers and projection sizes), or a ValueError in one line."""
    sizes = {
        "attn.c_attn": (config.n_embd, 3 * config.n_embd),
        "attn.c_proj": (config.n_embd, config.n_embd),
        "mlp.c_fc": (config.n_embd, config.mlp_width),
        "mlp.c_proj": (config.mlp_width, config.n_embd),
    }
    trained_on = adapter.config.get("base_model_name_or_path")
    hint = f"it was trained on another base model ({trained_on})" if trained_on else "it was trained on another base"
    for module, (a, b) in adapter.weights.items():
        layer, target = module.split(".", 3)[2:]
        if int(layer) >= config.n_layer:
            raise ValueError(
                f"adapter {adapter.source} does not fit the model {base}: it adapts layer {layer}, the model has "
                f"{config.n_layer} layers; {hint}"
            )
        inputs, outputs = sizes[target]
        if a.shape[1] != inputs or b.shape[0] != outputs:
            raise ValueError(
                f"adapter {adapter.source} does not fit the model {base}: its {module} maps {a.shape[1]} to "
                f"{b.shape[0]} features, the model's {inputs} to {outputs}; {hint}"
            )


def merge_adapter(model: GPT2, adapter: Adapter, base: str | None = None) -> GPT2:
    """Add each adapted projection's `scale * B @ A` to its weight, in place (in fp32, then the weight's
    dtype): the model then computes what the base with the adapter computes, with no adapter at run time."""
    assert not lora_modules(model), "merge_adapter takes a plain model; a LoRA-trained one merges with merge_lora"
    check_adapter(adapter, model.config, base or "given")
    with torch.no_grad():
        for module, (a, b) in adapter.weights.items():
            weight = model.get_submodule(module).weight  # (out, in): nn.Linear's layout
            delta = b.to(weight.device, torch.float32) @ a.to(weight.device, torch.float32) * adapter.scales[module]
            weight.copy_((weight.float() + delta).to(weight.dtype))
    logger.info("merged LoRA adapter %s (%d projections) into the weights", adapter.source, len(adapter.weights))
    return model


def save_merged(model: nn.Module, directory: str | Path, overwrite: bool = False, **kwargs: Any) -> Path:
    """A LoRA-trained model with its adapters merged in, saved as a plain Hugging Face directory (the model
    itself is left as it was)."""
    import copy

    merged = merge_lora(copy.deepcopy(checkpoint.unwrap(model)))
    return checkpoint.save_pretrained(merged, directory, overwrite=overwrite, **kwargs)
