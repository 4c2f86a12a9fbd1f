"""Training run configuration: the dataclass tree a training recipe fills (through `config_loader.py`).

The YAML recipes in `jobs/configs/` mirror this tree. Every field has a
default, a docstring and validation that names the field when it is wrong.
The resolved config is saved beside every checkpoint (`config.yaml`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

import yaml

from gpt2_platform.config_loader import ConfigError, build, load_tree
from gpt2_platform.lora import LoraConfig

Precision = Literal["auto", "bf16", "fp16", "fp32"]
CompileMode = Literal["off", "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]
DataFormat = Literal["auto", "text", "jsonl", "parquet"]
Strategy = Literal["ddp", "fsdp"]
LossImpl = Literal["logits", "fused"]
OptimizerName = Literal["adamw", "adamw8bit", "adamw4bit", "adamw_bf16"]
OptimizerOffload = Literal["none", "optimizer", "optimizer_and_gradients"]


@dataclass
class ModelConfig:
    preset: str = "tiny"
    """Architecture preset: tiny, gpt2, gpt2-medium, gpt2-large, gpt2-xl (ignored when init_from is set)."""
    init_from: str | None = None
    """Start from these weights: a local Hugging Face directory or a hub name (e.g. openai-community/gpt2)."""
    dropout: float = 0.0
    """Dropout probability for embeddings, attention output and MLP output."""
    lora: LoraConfig | None = None
    """Train LoRA adapters on a frozen base instead of every weight (null: full fine-tuning; {}: the defaults).
    The run exports a peft adapter (and, with export_merged, the merged model)."""

    def __post_init__(self) -> None:
        from gpt2_platform.model import PRESETS

        if self.init_from is None and self.preset not in PRESETS:
            raise ConfigError(f"model.preset {self.preset!r} is unknown; choose one of {', '.join(PRESETS)}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout must be in [0, 1), got {self.dropout}")


@dataclass
class DataConfig:
    paths: list[str] = field(default_factory=list)
    """Training files: local paths, directories or globs (.txt, .jsonl/.json, .parquet)."""
    format: DataFormat = "auto"
    """File format; auto picks it from each file's extension."""
    text_column: str = "text"
    """Column (Parquet) or key (JSONL) holding the text."""
    tokenizer: str = "byte"
    """Tokenizer: 'byte' (offline byte-level), a local directory or a hub name."""
    block_size: int = 128
    """Tokens per training sequence; at most the model's context length."""
    val_fraction: float = 0.05
    """Fraction of blocks held out for validation."""
    seed: int = 0
    """Seed for the train/validation split."""

    def __post_init__(self) -> None:
        if isinstance(self.paths, str):
            self.paths = [self.paths]
        if self.block_size < 2:
            raise ConfigError(f"data.block_size must be at least 2, got {self.block_size}")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction must be in [0, 1), got {self.val_fraction}")
        if not self.text_column:
            raise ConfigError("data.text_column must not be empty")


@dataclass
class OptimConfig:
    lr: float = 6e-4
    """Peak learning rate after warmup."""
    min_lr: float = 6e-5
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 10
    """Optimizer steps of linear warmup from 0 to lr."""
    weight_decay: float = 0.1
    """AdamW weight decay, applied to matrices only (not biases, LayerNorms)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    name: OptimizerName = "adamw"
    """How AdamW holds its states (train/optim.py): adamw (fp32), adamw8bit or adamw4bit (torchao's low-bit
    states), adamw_bf16 (the model, its gradients and the states in bf16, stochastic rounding)."""
    offload: OptimizerOffload = "none"
    """none; optimizer (states and step in CPU memory, one GPU worker); optimizer_and_gradients (also frees
    each GPU gradient once copied: no gradient accumulation)."""

    def __post_init__(self) -> None:
        for name, choices in (("name", OptimizerName), ("offload", OptimizerOffload)):
            if getattr(self, name) not in get_args(choices):
                raise ConfigError(
                    f"optim.{name} {getattr(self, name)!r} is unknown; choose one of {', '.join(get_args(choices))}"
                )
        if (self.name != "adamw" or self.offload != "none") and importlib.util.find_spec("torchao") is None:
            setting = f"optim.name={self.name}" if self.name != "adamw" else f"optim.offload={self.offload}"
            raise ConfigError(f"{setting} needs torchao, which is not installed (pip install torchao)")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError(f"optim.lr must be a positive finite number, got {self.lr}")
        if not (0 <= self.min_lr <= self.lr):  # also false for NaN
            raise ConfigError(f"optim.min_lr must be in [0, optim.lr={self.lr}], got {self.min_lr}")
        if self.warmup_steps < 0:
            raise ConfigError(f"optim.warmup_steps must be >= 0, got {self.warmup_steps}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ConfigError(f"optim.weight_decay must be >= 0, got {self.weight_decay}")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"optim.{name} must be in [0, 1), got {getattr(self, name)}")
        if not (math.isfinite(self.grad_clip) and self.grad_clip >= 0):
            raise ConfigError(f"optim.grad_clip must be >= 0 (0 disables), got {self.grad_clip}")


@dataclass
class TrainConfig:
    max_steps: int = 100
    """Optimizer steps to train for (the run ends there; a resumed run continues to it)."""
    micro_batch_size: int = 8
    """Sequences per worker per forward/backward pass."""
    grad_accum_steps: int = 1
    """Micro-batches accumulated per optimizer step (ignored if global_batch_size is set)."""
    global_batch_size: int | None = None
    """Sequences per optimizer step over all workers; must equal micro_batch_size x grad_accum_steps x num_workers."""
    precision: Precision = "auto"
    """auto (bf16 on a GPU that has it, else fp32), bf16, fp16 (with a GradScaler) or fp32."""
    compile: CompileMode = "off"
    """torch.compile mode, or off."""
    gradient_checkpointing: bool = False
    """Recompute each block's activations in backward to save memory."""
    checkpoint_blocks: int | None = None
    """With gradient_checkpointing: recompute only the first this many blocks (None: all). The others keep
    their activations and skip the second forward, so a card with memory to spare trains faster."""
    loss: LossImpl = "logits"
    """How the loss is computed from the last hidden states (train/loss.py): logits (the head's matmul, then
    the cross-entropy, in Triton on GPUs) or fused (liger-kernel's fused head + cross-entropy, CUDA only: the fp32
    logits never exist, which saves memory and costs speed; see docs/benchmarks.md)."""
    vocab_multiple: int = 128
    """The head's matmul runs over the vocabulary padded to a multiple of this (1: unpadded). Exact: the
    padding's logits are dropped before the softmax, and checkpoints keep the model's vocabulary."""
    log_every: int = 10
    """Report metrics every this many optimizer steps."""
    eval_every: int = 50
    """Validation every this many steps (0 disables); also at the last step."""
    eval_batches: int = 8
    """Micro-batches per worker in one validation pass."""
    checkpoint_every: int = 50
    """Checkpoint every this many steps (0: only at the end)."""
    keep_checkpoints: int = 2
    """How many recent checkpoints to keep."""
    max_failures: int = 2
    """Times the run restarts from the latest checkpoint after a worker dies."""
    seed: int = 1337
    """Seed for weight init and data order."""
    fail_at_step: int | None = None
    """Fault injection for testing recovery: rank 0 exits hard once when it reaches this step."""
    profile: bool = False
    """Record a torch.profiler trace of a window of steps (TensorBoard format)."""
    profile_steps: list[int] = field(default_factory=lambda: [5, 8])
    """[first, last] optimizer step of the profiled window."""
    peak_tflops: float | None = None
    """Peak dense bf16 TFLOP/s of one GPU for MFU; None looks the card up."""

    def __post_init__(self) -> None:
        if self.loss not in ("logits", "fused"):
            raise ConfigError(f"train.loss must be logits or fused, got {self.loss!r}")
        for name in (
            "max_steps",
            "micro_batch_size",
            "grad_accum_steps",
            "log_every",
            "eval_batches",
            "vocab_multiple",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("eval_every", "checkpoint_every", "max_failures"):
            if getattr(self, name) < 0:
                raise ConfigError(f"train.{name} must be >= 0, got {getattr(self, name)}")
        if self.keep_checkpoints < 1:
            raise ConfigError(f"train.keep_checkpoints must be >= 1, got {self.keep_checkpoints}")
        if self.global_batch_size is not None and self.global_batch_size < 1:
            raise ConfigError(f"train.global_batch_size must be >= 1, got {self.global_batch_size}")
        if self.checkpoint_blocks is not None:
            if self.checkpoint_blocks < 0:
                raise ConfigError(f"train.checkpoint_blocks must be >= 0 or null, got {self.checkpoint_blocks}")
            if not self.gradient_checkpointing:
                raise ConfigError(
                    f"train.checkpoint_blocks={self.checkpoint_blocks} needs train.gradient_checkpointing=true (it "
                    f"says how many blocks recompute); set both, or drop train.checkpoint_blocks"
                )
        if self.peak_tflops is not None and not (math.isfinite(self.peak_tflops) and self.peak_tflops > 0):
            raise ConfigError(f"train.peak_tflops must be a positive number or null, got {self.peak_tflops}")
        if len(self.profile_steps) != 2 or not 1 <= self.profile_steps[0] <= self.profile_steps[1]:
            raise ConfigError(
                f"train.profile_steps must be [first, last] with 1 <= first <= last, got {self.profile_steps}"
            )


@dataclass
class ScalingConfig:
    num_workers: int = 1
    """Training workers (one per GPU)."""
    use_gpu: bool = False
    """Give each worker a GPU (DDP over NCCL); otherwise CPU workers with gloo."""
    cpus_per_worker: float = 1.0
    """CPUs reserved for each worker."""
    resources_per_worker: dict[str, float] = field(default_factory=dict)
    """Extra custom resources per worker, e.g. {accelerator_type:H200: 0.01}."""
    resource_timeout_s: float = 600.0
    """How long to wait for room for the workers (held by other work, or nodes an autoscaler adds); a fixed
    cluster too small for them is refused at once."""
    strategy: Strategy = "ddp"
    """ddp (every worker holds the whole model) or fsdp (FSDP2: parameters, gradients and optimizer state
    sharded over the workers, each block gathered for its own compute; also on one worker, with offload)."""
    cpu_offload: bool = False
    """fsdp only: keep parameters, gradients and optimizer state in CPU memory (the optimizer steps there)."""

    def __post_init__(self) -> None:
        if self.strategy not in ("ddp", "fsdp"):
            raise ConfigError(f"scaling.strategy must be ddp or fsdp, got {self.strategy!r}")
        if self.cpu_offload and self.strategy != "fsdp":
            raise ConfigError("scaling.cpu_offload needs scaling.strategy=fsdp (DDP keeps the whole model on each GPU)")
        if self.cpu_offload and not self.use_gpu:
            # FSDP2 pins the offloaded memory for copies to a GPU: on CPU workers it fails in every worker,
            # after the data is built, and again on every retry.
            raise ConfigError(
                "scaling.cpu_offload=true needs GPU workers (scaling.use_gpu=true): it moves what a GPU holds "
                "into CPU memory, where CPU workers keep everything already; drop scaling.cpu_offload"
            )
        if self.num_workers < 1:
            raise ConfigError(f"scaling.num_workers must be >= 1, got {self.num_workers}")
        if not (math.isfinite(self.resource_timeout_s) and self.resource_timeout_s >= 0):
            raise ConfigError(f"scaling.resource_timeout_s must be >= 0, got {self.resource_timeout_s}")
        for name, amount in self.resources_per_worker.items():
            if not (math.isfinite(amount) and amount >= 0):
                raise ConfigError(f"scaling.resources_per_worker.{name} must be >= 0, got {amount}")
        if not (math.isfinite(self.cpus_per_worker) and self.cpus_per_worker > 0):
            raise ConfigError(f"scaling.cpus_per_worker must be > 0, got {self.cpus_per_worker}")


@dataclass
class RunConfig:
    name: str = "gpt2-run"
    """Run name; resubmitting the same name and storage_path resumes the run."""
    storage_path: str = "runs"
    """Where checkpoints and the final model go (shared storage on a multi-node cluster)."""
    gpu_monitor: bool | None = None
    """Start the per-node GPU exporters (as `jobs/monitor.py start` does) with the run; null: if the cluster has GPUs."""

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name:
            raise ConfigError(f"run.name must be a non-empty name without '/', got {self.name!r}")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def __post_init__(self) -> None:
        train, workers = self.train, self.scaling.num_workers
        # Whether the global batch was asked for, rather than made of the per-worker settings: a resumed run
        # keeps the global batch it started with unless it was asked for (trainer.keep_global_batch).
        self.global_batch_given = train.global_batch_size is not None
        if self.scaling.strategy == "fsdp" and train.precision == "fp16":
            raise ConfigError(
                "train.precision=fp16 is not implemented with scaling.strategy=fsdp (its loss scaling would need "
                "sharded gradients); use bf16 (or fp32), or strategy=ddp"
            )
        if train.loss == "fused" and not self.scaling.use_gpu:
            raise ConfigError(
                "train.loss=fused runs on CUDA GPUs only (Triton kernels); set scaling.use_gpu=true or use logits"
            )
        if train.global_batch_size is not None:
            per_step = train.micro_batch_size * workers
            if train.global_batch_size % per_step:
                raise ConfigError(
                    f"train.global_batch_size={train.global_batch_size} is not divisible by "
                    f"train.micro_batch_size x scaling.num_workers = {train.micro_batch_size} x {workers}; "
                    f"choose a multiple of {per_step}"
                )
            train.grad_accum_steps = train.global_batch_size // per_step
        else:
            train.global_batch_size = train.micro_batch_size * train.grad_accum_steps * workers
        self._check_optimizer()

    def _check_optimizer(self) -> None:
        """The optim.name and optim.offload combinations that cannot work, refused before any worker starts."""
        optim, train, scaling = self.optim, self.train, self.scaling
        if optim.name == "adamw_bf16" and train.precision not in ("auto", "bf16"):
            raise ConfigError(
                f"optim.name=adamw_bf16 holds the weights in bf16, so train.precision={train.precision} cannot "
                "apply; set train.precision=bf16 (or auto)"
            )
        if optim.offload == "none":
            return
        if not scaling.use_gpu:
            raise ConfigError(
                f"optim.offload={optim.offload} needs GPU workers (scaling.use_gpu=true): it moves what a GPU holds "
                "into CPU memory, where CPU workers keep it already"
            )
        if scaling.strategy == "fsdp":
            raise ConfigError(
                f"optim.offload={optim.offload} does not work with scaling.strategy=fsdp (torchao's offload needs "
                "whole gradients); use scaling.cpu_offload=true, or strategy=ddp on one worker"
            )
        if scaling.num_workers > 1:
            raise ConfigError(
                f"optim.offload={optim.offload} runs on one worker only (its backward hooks copy each gradient "
                "before DDP averages it); set scaling.num_workers=1, or use scaling.strategy=fsdp with cpu_offload"
            )
        if train.precision == "fp16":
            raise ConfigError(
                f"optim.offload={optim.offload} cannot use train.precision=fp16 (the GradScaler would unscale the GPU "
                "gradients, not the CPU copies the step uses); use bf16"
            )
        if optim.offload == "optimizer_and_gradients" and train.grad_accum_steps > 1:
            raise ConfigError(
                f"optim.offload=optimizer_and_gradients frees each gradient after backward, so "
                f"train.grad_accum_steps={train.grad_accum_steps} cannot accumulate; use optim.offload=optimizer"
            )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def from_dict(values: dict[str, Any]) -> Config:
    """Validate a nested mapping (as in YAML) into a Config."""
    return build(Config, values)


def load(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load a training recipe (or the defaults) and apply `a.b=c` overrides."""
    return from_dict(load_tree(path, overrides))


def dump(config: Config) -> str:
    """The resolved config as YAML, to save beside checkpoints."""
    return yaml.safe_dump(config.to_dict(), sort_keys=False)
