"""Hugging Face format checkpoints: `config.json` + `model.safetensors`, no pickle.

What we write loads with `transformers.AutoModelForCausalLM.from_pretrained`,
and we load what transformers (or the hub's GPT-2 repos) wrote. A directory
is staged under a temporary name and renamed into place, so a crash never
leaves a half-written checkpoint under the real name.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from gpt2_platform.model import GPT2, GPT2Config

logger = logging.getLogger(__name__)

WEIGHTS_NAME = "model.safetensors"
# transformers' name for the map from each tensor to its file, when save_pretrained shards the weights.
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
# Hugging Face keeps these four as Conv1D, whose weight is (in, out).
_CONV1D_SUFFIXES = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# Wrappers that add a level to parameter names: torch.compile, DDP, activation checkpointing.
_WRAPPER_PARTS = frozenset({"_orig_mod", "module", "_checkpoint_wrapped_module"})
# Causal-mask buffers that old transformers versions saved; they are not weights.
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module under DDP and torch.compile wrappers."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        else:
            return model


def clean_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop the name parts that wrappers add, wherever in the name they appear."""
    return {".".join(p for p in name.split(".") if p not in _WRAPPER_PARTS): t for name, t in state_dict.items()}


def to_hf_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Our parameters under Hugging Face names and layouts (a tied head omitted, as HF saves it);
    `state_dict`: the model's, gathered whole already (a sharded model's holds only its shards)."""
    out = {}
    tied = unwrap(model).config.tie_word_embeddings
    for name, tensor in clean_state_dict(unwrap(model).state_dict() if state_dict is None else state_dict).items():
        if name == "lm_head.weight" and tied:
            continue
        if name.endswith(_CONV1D_SUFFIXES):
            tensor = tensor.t()
        out[name] = tensor.detach().contiguous().cpu()
    return out


def from_hf_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face GPT-2 weights (with or without the `transformer.` prefix) in our layout; a head
    that is not there is the token embedding (a tied model's)."""
    out = {}
    for name, tensor in clean_state_dict(state_dict).items():
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        if not name.startswith(("transformer.", "lm_head.")):
            name = "transformer." + name
        if name.endswith(_CONV1D_SUFFIXES):
            tensor = tensor.t().contiguous()  # these become the parameters themselves (load_pretrained)
        out[name] = tensor
    out.setdefault("lm_head.weight", out.get("transformer.wte.weight"))
    return out


def hf_config(config: GPT2Config, **extra: object):
    """The transformers GPT2Config that describes our model.

    BOS and EOS default to the last vocabulary id, where both GPT-2's BPE and the
    byte-level tokenizer put <|endoftext|>.
    """
    from transformers import GPT2Config as HFGPT2Config

    extra.setdefault("bos_token_id", config.vocab_size - 1)
    extra.setdefault("eos_token_id", config.vocab_size - 1)
    return HFGPT2Config(
        vocab_size=config.vocab_size,
        n_positions=config.n_positions,
        n_embd=config.n_embd,
        n_layer=config.n_layer,
        n_head=config.n_head,
        n_inner=config.n_inner,
        activation_function=config.activation_function,
        resid_pdrop=config.dropout,
        embd_pdrop=config.dropout,
        attn_pdrop=config.dropout,
        layer_norm_epsilon=config.layer_norm_epsilon,
        tie_word_embeddings=config.tie_word_embeddings,
        scale_attn_weights=config.scale_attn_weights,
        scale_attn_by_inverse_layer_idx=config.scale_attn_by_inverse_layer_idx,
        reorder_and_upcast_attn=config.reorder_and_upcast_attn,
        architectures=["GPT2LMHeadModel"],
        **extra,
    )


# transformers' GPT2Config defaults for the fields config_from_hf reads (a config.json may leave any out).
HF_GPT2_DEFAULTS = dict(
    model_type="gpt2",
    vocab_size=50257,
    n_positions=1024,
    n_embd=768,
    n_layer=12,
    n_head=12,
    n_inner=None,
    activation_function="gelu_new",
    resid_pdrop=0.1,
    layer_norm_epsilon=1e-5,
    tie_word_embeddings=True,
    scale_attn_weights=True,
    scale_attn_by_inverse_layer_idx=False,
    reorder_and_upcast_attn=False,
    add_cross_attention=False,
)
# The other names transformers' GPT2Config accepts for four of those fields (its attribute_map).
_HF_ALIASES = {
    "hidden_size": "n_embd",
    "max_position_embeddings": "n_positions",
    "num_attention_heads": "n_head",
    "num_hidden_layers": "n_layer",
}
# Fields of transformers' GPT2Config that change the arithmetic and that our model does not implement,
# with the value under which they change nothing. (Everything else it holds is a dropout rate, which a
# run sets for itself, initialisation, tokens, or the heads of other tasks.)
_REFUSED_FIELDS = {"add_cross_attention": False}


def read_hf_config(directory: Path) -> SimpleNamespace:
    """The directory's config.json, over GPT-2's defaults, with the attributes `config_from_hf` reads.

    Read here rather than by AutoConfig or GPT2Config: importing transformers' auto classes imports its
    generation stack as well (torch._dynamo, sympy, and scikit-learn where installed). With
    transformers 5 that is seconds of every Ray actor's start-up
    (docs/benchmarks.md, a Serve replica's start), for a file of a few numbers.
    """
    fields = read_json_object(directory / CONFIG_NAME)
    for alias, name in _HF_ALIASES.items():
        if alias in fields:
            fields.setdefault(name, fields.pop(alias))
    return SimpleNamespace(**{**HF_GPT2_DEFAULTS, **fields})


def config_from_hf(hf: Any) -> GPT2Config:
    """Our GPT2Config for a transformers one (or `read_hf_config`'s namespace), or a ValueError naming the field
    that we cannot honour."""
    if getattr(hf, "model_type", "gpt2") != "gpt2":
        raise ValueError(f"checkpoint is a {hf.model_type!r} model; only GPT-2 checkpoints are supported")
    for name, harmless in _REFUSED_FIELDS.items():
        if getattr(hf, name, harmless) != harmless:
            raise ValueError(f"{name}={getattr(hf, name)!r} is not implemented (only {name}={harmless!r} is)")
    return GPT2Config(
        n_layer=hf.n_layer,
        n_head=hf.n_head,
        n_embd=hf.n_embd,
        vocab_size=hf.vocab_size,
        n_positions=hf.n_positions,
        dropout=hf.resid_pdrop,
        layer_norm_epsilon=hf.layer_norm_epsilon,
        n_inner=hf.n_inner,
        activation_function=hf.activation_function,
        tie_word_embeddings=hf.tie_word_embeddings,
        scale_attn_weights=hf.scale_attn_weights,
        scale_attn_by_inverse_layer_idx=hf.scale_attn_by_inverse_layer_idx,
        reorder_and_upcast_attn=hf.reorder_and_upcast_attn,
    )


def read_json_object(path: Path) -> dict:
    """A JSON file holding one object (config.json, adapter_config.json); a clear error otherwise."""
    try:
        fields = json.loads(path.read_text())
    except ValueError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from error
    if not isinstance(fields, dict):
        raise ValueError(f"{path} should hold a JSON object, not {type(fields).__name__}")
    return fields


def read_config(directory: Path) -> GPT2Config:
    """The architecture a Hugging Face directory's config.json describes; a field we cannot honour is
    refused with the file's path, the field and its value."""
    try:
        return config_from_hf(read_hf_config(directory))
    except (TypeError, ValueError) as error:
        raise ValueError(f"{directory / CONFIG_NAME}: {error}") from error


@contextmanager
def staged_directory(target: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory beside `target`; on success it replaces `target` in one rename."""
    target = Path(target)
    if target.exists() and not overwrite:
        raise FileExistsError(f"{target} already exists; choose another path or remove it")
    target.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield stage
        if target.exists():
            old = target.with_name(f".{target.name}.old-{os.getpid()}")
            os.replace(target, old)
            os.replace(stage, target)
            shutil.rmtree(old)
        else:
            os.replace(stage, target)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise


def write_weights(
    model: nn.Module, directory: str | Path, state_dict: dict[str, torch.Tensor] | None = None, **hf_extra: object
) -> None:
    """Write config.json and model.safetensors into an existing directory (`state_dict`: as to_hf_state_dict's)."""
    directory = Path(directory)
    config = unwrap(model).config
    hf_config(config, **hf_extra).save_pretrained(directory)
    save_file(to_hf_state_dict(model, state_dict), str(directory / WEIGHTS_NAME), metadata={"format": "pt"})


def save_pretrained(
    model: nn.Module,
    directory: str | Path,
    overwrite: bool = False,
    extra: Callable[[Path], None] | None = None,
    **hf_extra: Any,
) -> Path:
    """Save a model in Hugging Face format, atomically; `extra(dir)` may add files (a tokenizer)."""
    with staged_directory(directory, overwrite=overwrite) as stage:
        write_weights(model, stage, **hf_extra)
        if extra is not None:
            extra(stage)
    logger.info("saved model to %s", directory)
    return Path(directory)


def resolve(name_or_path: str, allow_patterns: list[str] | None = None) -> Path:
    """A local directory, or a hub repo downloaded into the Hugging Face cache."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if path.exists() or name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1:
        raise FileNotFoundError(f"{name_or_path} is not a model directory (expected config.json and model.safetensors)")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name_or_path, allow_patterns=allow_patterns))
    except Exception as error:  # hub errors come in many types; all mean "could not fetch"
        raise FileNotFoundError(
            f"could not load {name_or_path!r}: not a local directory, and the hub download failed "
            f"({type(error).__name__}: {error}). Pass a local Hugging Face directory instead."
        ) from error


@contextmanager
def _init_skipped() -> Iterator[None]:
    """torch.nn.init's in-place initialisers as no-ops, while a model to be loaded into is built on meta.

    Why: init on meta tensors has no effect, yet the first `normal_` on one imports torch._dynamo
    (torch's meta `normal_` is a reference implementation behind dynamo's disable wrapper): 1-2 s of
    each Ray actor's start-up for nothing. The same idea as transformers' `no_init_weights`, which sits
    in its modeling module, itself a 2-6 s import. Not thread-safe: only for a model's construction.
    """
    names = ("normal_", "uniform_", "kaiming_uniform_", "zeros_", "ones_")
    saved = {name: getattr(nn.init, name) for name in names}
    for name in names:
        setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, function in saved.items():
            setattr(nn.init, name, function)


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a Hugging Face directory: model.safetensors, or the shards its index names."""
    index = directory / WEIGHTS_INDEX_NAME
    if (directory / WEIGHTS_NAME).is_file():
        return [directory / WEIGHTS_NAME]
    if not index.is_file():
        raise FileNotFoundError(
            f"{directory} must hold {CONFIG_NAME} and {WEIGHTS_NAME} (or sharded safetensors with "
            f"{WEIGHTS_INDEX_NAME}); pickle (pytorch_model.bin) is not loaded"
        )
    try:
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"{index} is not a safetensors index (a JSON object with a weight_map): {error}") from error
    missing = [name for name in shards if not (directory / name).is_file()]
    if missing:
        raise FileNotFoundError(f"{index} names shards that are not in {directory}: {', '.join(missing)}")
    return [directory / name for name in shards]


def _head_weights(config: GPT2Config, state_dict: dict[str, torch.Tensor], source: Path) -> None:
    """Check the LM head in a checkpoint's weights against its tie_word_embeddings, and drop a tied copy.

    An untied config needs a head of its own (transformers would fill a missing one with random numbers).
    A tied config with a head that differs from the embedding is ambiguous (transformers 5 then keeps
    the file's head and warns that the config is wrong): we refuse rather than guess which was meant.
    """
    head, embedding = state_dict.get("lm_head.weight"), state_dict.get("transformer.wte.weight")
    if not config.tie_word_embeddings:
        if head is None or head is embedding:  # (from_hf_state_dict stands the embedding in for a missing head)
            raise ValueError(f"{source}: tie_word_embeddings is false, but the weights hold no lm_head.weight")
        return
    if head is not None and embedding is not None and head is not embedding and not torch.equal(head, embedding):
        raise ValueError(
            f"{source}: tie_word_embeddings is true, but the weights hold an lm_head.weight that differs from "
            "transformer.wte.weight; if the head is its own, set tie_word_embeddings to false in config.json"
        )
    state_dict.pop("lm_head.weight", None)


def load_pretrained(
    name_or_path: str,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    adapter: str | Path | None = None,
) -> GPT2:
    """Load a GPT-2 from a local Hugging Face directory or a hub name; `adapter`, a peft LoRA adapter
    (directory or hub name), is merged into the weights (adapter.py), so the model runs at the base's speed.

    Every consumer (training's init_from, serving, batch) loads through here, so a config.json field
    this model does not implement is refused once, before any weights are read.
    """
    directory = resolve(name_or_path, allow_patterns=[CONFIG_NAME, "*.safetensors", "*.json", "*.txt"])
    if not (directory / CONFIG_NAME).is_file():
        raise FileNotFoundError(f"{directory} must hold {CONFIG_NAME} and {WEIGHTS_NAME} (safetensors)")
    config = read_config(directory)
    files = weight_files(directory)
    raw: dict[str, torch.Tensor] = {}
    for file in files:
        raw.update(load_file(str(file)))
    model = model_from_hf_weights(config, raw, directory)
    if adapter is not None:  # merged in fp32, before the cast
        from gpt2_platform.adapter import merge_adapter, read_adapter

        merge_adapter(model, read_adapter(adapter), base=str(name_or_path))
    return model.to(device=device, dtype=dtype)


def model_from_hf_weights(config: GPT2Config, raw: dict[str, torch.Tensor], source: Path) -> GPT2:
    """Our model of `config` holding a Hugging Face directory's tensors (`raw`, read from `source`) as its
    parameters; weights that do not match the config are refused in one line."""
    if any(".lora_A." in name or ".lora_B." in name for name in raw):
        raise ValueError(
            f"{source}: the weights hold LoRA adapters beside the base model (a LoRA run's checkpoint); load "
            "the run's exported adapter over its base model, or its merged export"
        )
    state_dict = from_hf_state_dict(raw)
    _head_weights(config, state_dict, source)
    # Built on the meta device, the model allocates and randomly initialises nothing: the file's tensors
    # become its parameters. (Initialising first cost 1.5B random draws for gpt2-xl, only to overwrite them.)
    with torch.device("meta"), _init_skipped():
        model = GPT2(config)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    missing = [name for name in expected if name not in state_dict]
    unexpected = [name for name in state_dict if name not in expected]
    wrong = [
        f"{name} {tuple(t.shape)} (config.json gives {expected[name]})"
        for name, t in state_dict.items()
        if name in expected and tuple(t.shape) != expected[name]
    ]
    if missing or unexpected or wrong:
        raise ValueError(
            f"{source}: the weights do not match a GPT-2 of its config.json: "
            + "; ".join(
                f"{what} {', '.join(names[:4])}{' ...' if len(names) > 4 else ''}"
                for what, names in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong))
                if names
            )
        )
    model.load_state_dict(state_dict, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.transformer.wte.weight  # assign replaced wte's parameter: tie the head again
    return model
