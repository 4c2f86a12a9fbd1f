"""Batch job configuration (generation or scoring): dataclasses loaded from YAML, with `--set a.b=c` overrides.

The tree mirrors `jobs/configs/generate-*.yaml` and `jobs/configs/score-*.yaml`. It goes through the YAML
loader training uses (`gpt2_platform.config_loader`), so types, unknown keys and
`--set` behave the same in both jobs.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from gpt2_platform.config_loader import ConfigError, build, load_tree
from gpt2_platform.engine.config import MAX_SEED, MAX_TEMPERATURE, MAX_TOP_K, EngineConfig
from gpt2_platform.moderation import ModerationConfig

LongPrompts = Literal["reject", "truncate"]
Task = Literal["generate", "score"]


@dataclass
class InputConfig:
    paths: list[str] = field(default_factory=list)
    """Parquet files, directories or globs holding the prompts."""
    prompt_column: str = "prompt"
    """Column with the prompt text (task score: the text to score, or the context of the continuation)."""
    id_column: str | None = None
    """Column with a unique id per row (string or integer); null derives '<file name>:<row index>'."""
    max_tokens_column: str | None = None
    """Optional column with a per-row max_tokens (null in a row: generation.max_tokens)."""
    temperature_column: str | None = None
    """Optional column with a per-row temperature (null in a row: generation.temperature)."""
    seed_column: str | None = None
    """Optional column with a per-row seed in [0, 2**63) (null in a row: derived from generation.seed and the id)."""
    continuation_column: str | None = None
    """Task score only: a column of text scored after the prompt column's, conditioned on it (only its tokens are
    scored); null scores the prompt column's text itself."""

    def __post_init__(self) -> None:
        if isinstance(self.paths, str):
            self.paths = [self.paths]
        if not self.prompt_column:
            raise ConfigError("input.prompt_column must not be empty")
        for name in ("id_column", "max_tokens_column", "temperature_column", "seed_column", "continuation_column"):
            if getattr(self, name) == "":
                raise ConfigError(f"input.{name} must be a column name or null, not empty")

    def columns(self) -> list[str]:
        """The input columns the job reads."""
        optional = (
            self.id_column,
            self.continuation_column,
            self.max_tokens_column,
            self.temperature_column,
            self.seed_column,
        )
        return list(dict.fromkeys([self.prompt_column, *(c for c in optional if c)]))


@dataclass
class OutputConfig:
    path: str = ""
    """Output directory: Parquet files plus _summary.json; rerunning with the same path resumes."""
    progress_bars: bool = True
    """Show Ray Data's progress bars while the job runs."""

    def __post_init__(self) -> None:
        if not self.path:
            raise ConfigError("output.path is empty; set it to a directory, e.g. --set output.path=out/")


@dataclass
class ModelConfig:
    path: str = ""
    """Model to generate with: a Hugging Face directory (as jobs/train.py exports) or a hub name."""
    tokenizer: str | None = None
    """Tokenizer: a directory, a hub name or 'byte'; null takes the one in the model directory."""
    adapter: str | None = None
    """A peft LoRA adapter for the model (a directory or hub name): merged into its weights at load, so the
    engine runs at the base model's speed; null: the model alone."""

    def __post_init__(self) -> None:
        if not self.path:
            raise ConfigError("model.path is empty; set it to a model directory, e.g. --set model.path=runs/x/model")
        if self.adapter == "":
            raise ConfigError("model.adapter is empty; set it to a LoRA adapter directory, or null for none")


@dataclass
class GenerationConfig:
    max_tokens: int = 32
    """Tokens to generate per row, unless the row's max_tokens column says otherwise."""
    temperature: float = 1.0
    """Sampling temperature in [0, 2] (0 = greedy), unless the row's temperature column says otherwise."""
    top_k: int = 0
    """Sample among the k most likely tokens; 0 = no limit."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; 1 = no limit."""
    seed: int = 0
    """Global seed: a row without its own seed gets one derived from this and its id."""
    stop: list[str] = field(default_factory=list)
    """Strings that end a completion (not included in it)."""
    ignore_eos: bool = False
    """Keep generating past the end-of-text token."""
    long_prompts: LongPrompts = "reject"
    """A prompt that leaves no room for max_tokens: 'reject' (an error row) or 'truncate' (keep its end)."""
    logprobs: bool = False
    """Write each generated token's log-probability in a `logprobs` column (under the model's raw logits,
    before temperature, top-k and top-p)."""

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ConfigError(f"generation.max_tokens must be >= 1, got {self.max_tokens}")
        if not (math.isfinite(self.temperature) and 0.0 <= self.temperature <= MAX_TEMPERATURE):
            raise ConfigError(f"generation.temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        if not 0 <= self.top_k <= MAX_TOP_K:
            raise ConfigError(f"generation.top_k must be in [0, 2**31 - 1], got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"generation.top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.seed <= MAX_SEED:
            raise ConfigError(f"generation.seed must be in [0, 2**63 - 1], got {self.seed}")
        if any(not s for s in self.stop):
            raise ConfigError("generation.stop must not hold empty strings")


@dataclass
class ScalingConfig:
    num_actors: int | None = None
    """Engine actors; null: one per GPU share (GPUs / num_gpus_per_actor), or 1 on a cluster without GPUs."""
    num_gpus_per_actor: float | None = None
    """GPU share per actor (0.25 packs four small models on a GPU); null: 1 with GPUs, 0 (CPU actors) without."""
    num_cpus_per_actor: float = 1.0
    """CPUs reserved per actor."""
    batch_size: int = 256
    """Rows per map_batches call, so also at most per output file."""
    concurrent_batches_per_actor: int = 2
    """Batches each actor works on at once, all fed to its one engine: the next batch's rows fill the slots
    that the current batch's finished rows free, instead of the engine draining at the end of each batch."""
    wait_for_resources_s: float = 60.0
    """How long to wait at the start for the actors' CPUs and GPUs to be free (e.g. held by a job that is
    ending); then the job stops with an error saying what was missing. 0: do not wait."""

    def __post_init__(self) -> None:
        if self.num_actors is not None and self.num_actors < 1:
            raise ConfigError(f"scaling.num_actors must be >= 1 or null, got {self.num_actors}")
        if self.num_gpus_per_actor is not None and not 0 <= self.num_gpus_per_actor:
            raise ConfigError(f"scaling.num_gpus_per_actor must be >= 0 or null, got {self.num_gpus_per_actor}")
        if self.num_gpus_per_actor is not None and self.num_gpus_per_actor > 1 and self.num_gpus_per_actor % 1:
            raise ConfigError(f"scaling.num_gpus_per_actor above 1 must be whole, got {self.num_gpus_per_actor}")
        if not (math.isfinite(self.num_cpus_per_actor) and self.num_cpus_per_actor > 0):
            raise ConfigError(f"scaling.num_cpus_per_actor must be > 0, got {self.num_cpus_per_actor}")
        if self.batch_size < 1:
            raise ConfigError(f"scaling.batch_size must be >= 1, got {self.batch_size}")
        if not (math.isfinite(self.wait_for_resources_s) and self.wait_for_resources_s >= 0):
            raise ConfigError(f"scaling.wait_for_resources_s must be >= 0, got {self.wait_for_resources_s}")
        if self.concurrent_batches_per_actor < 1:
            raise ConfigError(
                f"scaling.concurrent_batches_per_actor must be >= 1, got {self.concurrent_batches_per_actor}"
            )


@dataclass
class ProfileConfig:
    trace_dir: str | None = None
    """Where each engine actor writes a Chrome trace (CPU and CUDA activity, torch.profiler) of a window of its
    work: `engine-<host>-<pid>.pt.trace.json`, which `python jobs/trace_summary.py <dir>` summarises (the device's
    busy share, its gaps, the kernels by time) and Perfetto opens. null: no trace."""
    after_s: float = 20.0
    """Seconds after the engine is ready that the window starts: past the first prefills and graph captures,
    into the steady state a long job spends most of its time in."""
    seconds: float = 0.5
    """The window's length. A trace holds every kernel and launch: at about 100 kernels a decode step, a second
    is a file of tens of MB."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.after_s) and self.after_s >= 0):
            raise ConfigError(f"profile.after_s must be >= 0, got {self.after_s}")
        if not (math.isfinite(self.seconds) and 0 < self.seconds <= 10):
            raise ConfigError(f"profile.seconds must be in (0, 10], got {self.seconds} (a trace grows with it)")


@dataclass
class GenerateConfig:
    task: Task = "generate"
    """'generate': a completion per row; 'score': the log-likelihood, scored tokens and perplexity of each row's
    text (or of its continuation given the text), from the engine's log-probabilities, generating nothing."""
    input: InputConfig = field(default_factory=InputConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    """What and how to generate (task generate; task score reads none of it)."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """The engine's settings: the dataclass Serve's `args.engine` takes (gpt2_platform.engine.config)."""
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    moderation: ModerationConfig = field(default_factory=ModerationConfig)
    """Content checks of prompts and completions (gpt2_platform.moderation); blocked rows get an error."""
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    """A profiler trace of each engine actor's steady state (off unless profile.trace_dir is set)."""

    def __post_init__(self) -> None:
        if self.task == "generate" and self.input.continuation_column:
            raise ConfigError(
                "input.continuation_column is for task: score (the log-likelihood of a continuation); "
                "remove it, or set task: score"
            )
        if self.task != "score":
            return
        per_row = ("max_tokens_column", "temperature_column", "seed_column")
        set_columns = [f"input.{name}" for name in per_row if getattr(self.input, name)]
        if set_columns:
            raise ConfigError(
                f"{', '.join(set_columns)} set with task: score, which samples nothing; remove them "
                "(they are per-row settings of task: generate)"
            )
        if self.generation.logprobs:
            raise ConfigError(
                "generation.logprobs is for task: generate (log-probabilities of generated tokens); task: score "
                "writes the log-likelihood of the text itself: remove generation.logprobs"
            )
        if self.moderation.enabled:
            raise ConfigError("moderation is for task: generate; task: score generates no text: disable moderation")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def load(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> GenerateConfig:
    """Load a YAML recipe (or the defaults) and apply `a.b=c` overrides."""
    tree = load_tree(path, overrides)
    # Sections a user leaves out still get validated (e.g. output.path must be set).
    for section in ("input", "output", "model"):
        tree.setdefault(section, {})
    return build(GenerateConfig, tree)
