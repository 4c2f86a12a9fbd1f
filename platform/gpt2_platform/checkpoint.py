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

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from gpt2_platform.model import GPT2, GPT2Config

logger = logging.getLogger(__name__)

WEIGHTS_NAME = "model.safetensors"
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


def to_hf_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Our parameters under Hugging Face names and layouts (tied head omitted, as HF saves it)."""
    out = {}
    for name, tensor in clean_state_dict(unwrap(model).state_dict()).items():
        if name == "lm_head.weight":
            continue
        if name.endswith(_CONV1D_SUFFIXES):
            tensor = tensor.t()
        out[name] = tensor.detach().contiguous().cpu()
    return out


def from_hf_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face GPT-2 weights (with or without the `transformer.` prefix) in our layout."""
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
        activation_function="gelu_new",
        resid_pdrop=config.dropout,
        embd_pdrop=config.dropout,
        attn_pdrop=config.dropout,
        layer_norm_epsilon=config.layer_norm_epsilon,
        tie_word_embeddings=True,
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
    resid_pdrop=0.1,
    layer_norm_epsilon=1e-5,
)


def read_hf_config(directory: Path) -> SimpleNamespace:
    """The directory's config.json, over GPT-2's defaults, with the attributes `config_from_hf` reads.

    Read here rather than by AutoConfig or GPT2Config: importing transformers' auto classes imports its
    generation stack as well (torch._dynamo, sympy, and scikit-learn where installed). With
    transformers 5.17 that was 6 s of every Ray actor's start-up on the GPU machine
    (docs/benchmarks.md, session 6), for a file of a few numbers.
    """
    path = directory / CONFIG_NAME
    try:
        fields = json.loads(path.read_text())
    except ValueError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from error
    if not isinstance(fields, dict):
        raise ValueError(f"{path} should hold a JSON object, not {type(fields).__name__}")
    return SimpleNamespace(**{**HF_GPT2_DEFAULTS, **fields})


def config_from_hf(hf: object) -> GPT2Config:
    if getattr(hf, "model_type", "gpt2") != "gpt2":
        raise ValueError(f"checkpoint is a {hf.model_type!r} model; only GPT-2 checkpoints are supported")
    if getattr(hf, "n_inner", None) not in (None, 4 * hf.n_embd):
        raise ValueError(f"checkpoint has n_inner={hf.n_inner}; only the standard 4 x n_embd MLP is supported")
    return GPT2Config(
        n_layer=hf.n_layer,
        n_head=hf.n_head,
        n_embd=hf.n_embd,
        vocab_size=hf.vocab_size,
        n_positions=hf.n_positions,
        dropout=hf.resid_pdrop,
        layer_norm_epsilon=hf.layer_norm_epsilon,
    )


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


def write_weights(model: nn.Module, directory: str | Path, **hf_extra: object) -> None:
    """Write config.json and model.safetensors into an existing directory."""
    directory = Path(directory)
    config = unwrap(model).config
    hf_config(config, **hf_extra).save_pretrained(directory)
    save_file(to_hf_state_dict(model), str(directory / WEIGHTS_NAME), metadata={"format": "pt"})


def save_pretrained(
    model: nn.Module,
    directory: str | Path,
    overwrite: bool = False,
    extra: Callable[[Path], None] | None = None,
    **hf_extra: object,
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


def load_pretrained(name_or_path: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> GPT2:
    """Load a GPT-2 from a local Hugging Face directory or a hub name."""
    directory = resolve(name_or_path, allow_patterns=[CONFIG_NAME, WEIGHTS_NAME, "*.json", "*.txt"])
    weights = directory / WEIGHTS_NAME
    if not (directory / CONFIG_NAME).is_file() or not weights.is_file():
        raise FileNotFoundError(
            f"{directory} must hold {CONFIG_NAME} and {WEIGHTS_NAME} (safetensors; pickle is not loaded)"
        )
    config = config_from_hf(read_hf_config(directory))
    state_dict = from_hf_state_dict(load_file(str(weights)))
    # Built on the meta device, the model allocates and randomly initialises nothing: the file's tensors
    # become its parameters. (Initialising first cost 1.5B random draws for gpt2-xl, only to overwrite them.)
    with torch.device("meta"), _init_skipped():
        model = GPT2(config)
    missing, unexpected = model.load_state_dict(state_dict, strict=False, assign=True)
    missing = [name for name in missing if name != "lm_head.weight"]
    if missing or unexpected:
        raise ValueError(
            f"{weights} does not match a GPT-2 of this shape: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    model.lm_head.weight = model.transformer.wte.weight  # assign replaced wte's parameter: tie the head again
    return model.to(device=device, dtype=dtype)
