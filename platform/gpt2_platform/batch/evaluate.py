"""Evaluation of a checkpoint on held-out text: perplexity and bits per byte, through the scoring path.

The text is read and tokenized as training's data pipeline does it (train/data.py: `read_documents`,
then `TokenizeAndPack`'s tokens over documents joined by end-of-text), packed into blocks of block_size + 1
tokens over the whole stream (training packs each read batch apart), and each block is one scored engine request (score.py) on engine actors under Ray Data:
every position of the block predicts the next token, as the training loss does with inputs block[:-1]
and targets block[1:]. So on the same blocks, with the same tokenizer and block size, the perplexity is
the training job's validation perplexity: training's validation loss is a mean over micro-batches of
equal token counts, which is the mean over their tokens. `data.validation_of` scores exactly those
blocks: the validation blocks a training run reported val_loss on, rebuilt by the training code from
the run's config.yaml.

What the numbers count:
- perplexity = exp(total negative log-likelihood / scored tokens); a block of block_size + 1 tokens scores
  block_size of them (its first token is only context), and the data's tail shorter than a block is
  dropped, as training drops it.
- bits per byte = total negative log-likelihood in nats / ln 2 / the UTF-8 bytes of the text the scored
  tokens stand for (each scored token's own bytes; end-of-text tokens between documents stand for no text
  and count 0 bytes, but their log-likelihood counts, as in the perplexity).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from gpt2_platform.batch.config import GenerationConfig, InputConfig, ModelConfig, ScalingConfig
from gpt2_platform.batch.score import SCORE_PARAMS, log_likelihood, perplexity, token_byte_lengths
from gpt2_platform.batch.worker import EngineWorker, WorkerSpec
from gpt2_platform.config_loader import ConfigError, build, load_tree
from gpt2_platform.engine.config import EngineConfig
from gpt2_platform.train.config import DataConfig, DataFormat
from gpt2_platform.train.data import TOKENS_COLUMN

if TYPE_CHECKING:
    import ray.data

logger = logging.getLogger(__name__)

TOKENIZE_BATCH_DOCUMENTS = 256
"""Documents tokenized together by one Ray Data task; their tokens are packed over the whole stream."""
PROGRESS_EVERY_S = 10.0


@dataclass
class EvalDataConfig:
    paths: list[str] = field(default_factory=list)
    """Held-out text: files, directories or globs (.txt, .jsonl/.json, .parquet), read as training reads them."""
    format: DataFormat = "auto"
    """File format; auto picks it from each file's extension."""
    text_column: str = "text"
    """Column (Parquet) or key (JSONL) holding the text."""
    block_size: int | None = None
    """Tokens a block predicts (a block holds block_size + 1); null: the engine's context, or with
    validation_of the run's data.block_size."""
    validation_of: str | None = None
    """A training run's directory (run.storage_path/run.name): score the validation blocks its training
    reported val_loss on, instead of paths."""

    def __post_init__(self) -> None:
        if isinstance(self.paths, str):
            self.paths = [self.paths]
        if bool(self.paths) == bool(self.validation_of):
            raise ConfigError(
                "set exactly one of data.paths (held-out text, --data) and data.validation_of (a training run's "
                "directory, --validation-of)"
            )
        if self.block_size is not None and self.block_size < 2:
            raise ConfigError(f"data.block_size must be at least 2 (as training's) or null, got {self.block_size}")
        if not self.text_column:
            raise ConfigError("data.text_column must not be empty")


@dataclass
class EvaluateConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: EvalDataConfig = field(default_factory=EvalDataConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    """The engine's settings (gpt2_platform.engine.config); fp32 on CPU, bf16 on GPUs that have it by default."""
    scaling: ScalingConfig = field(default_factory=lambda: ScalingConfig(batch_size=64))
    """Engine actors and their resources; batch_size is blocks per map_batches call."""
    progress_bars: bool = True
    """Show Ray Data's progress bars while the blocks are scored."""


def load(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> EvaluateConfig:
    """Load a YAML recipe (or the defaults) and apply `a.b=c` overrides."""
    tree = load_tree(path, overrides)
    for section in ("model", "data"):
        tree.setdefault(section, {})
    return build(EvaluateConfig, tree)


class ScoreBlocks(EngineWorker):
    """map_batches callable class: blocks of token ids -> each block's log-likelihood, scored tokens and bytes."""

    def __init__(self, spec: WorkerSpec) -> None:
        super().__init__(spec)
        self.byte_lengths = token_byte_lengths(self.tokenizer)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        blocks = [list(map(int, block)) for block in batch[TOKENS_COLUMN]]
        completions = self.engine.generate(blocks, SCORE_PARAMS)
        failed = [c.error for c in completions if c.error]
        if failed:  # a block the engine cannot score is not a row to skip: the perplexity would be of other text
            raise RuntimeError(f"the engine could not score a block: {failed[0]}")
        scored = [len(block) - 1 for block in blocks]
        return {
            "log_likelihood": np.array(
                [log_likelihood(c.prompt_logprobs, n) for c, n in zip(completions, scored, strict=True)], np.float64
            ),
            "scored_tokens": np.array(scored, np.int64),
            "scored_bytes": np.array([int(self.byte_lengths[block[1:]].sum()) for block in blocks], np.int64),
        }


@contextmanager
def _data_context(progress_bars: bool) -> Iterator[None]:
    """Ordered execution (as training packs its blocks) and the progress bars, for the Datasets made inside."""
    import ray.data

    context = ray.data.DataContext.get_current()
    before = (context.execution_options.preserve_order, context.enable_progress_bars)
    context.execution_options.preserve_order, context.enable_progress_bars = True, progress_bars
    try:
        yield
    finally:
        context.execution_options.preserve_order, context.enable_progress_bars = before


def _training_run(run_dir: Path):
    """The training Config a run directory was made with (its config.yaml)."""
    from gpt2_platform.train import config as train_config

    path = run_dir / "config.yaml"
    if not path.is_file():
        raise ConfigError(
            f"data.validation_of {run_dir} holds no config.yaml; point it at a training run's directory "
            "(run.storage_path/run.name)"
        )
    return train_config.load(path)


def _validation_blocks(run) -> np.ndarray:
    """The blocks training's evaluate() scores: the first eval_batches micro-batches per worker of the seeded
    validation split, whole micro-batches only (train/trainer.py validation_tokens, train/loop.py
    validation_batches)."""
    from gpt2_platform.train.data import build_datasets
    from gpt2_platform.train.loading import model_config
    from gpt2_platform.train.trainer import validation_tokens

    tc, workers = run.train, run.scaling.num_workers
    datasets = build_datasets(run.data, model_config(run.model).vocab_size, tc.micro_batch_size * workers)
    tokens = validation_tokens(datasets, tc.eval_batches * tc.micro_batch_size * workers)
    if tokens is None or len(tokens) < tc.micro_batch_size:
        raise ConfigError(
            "the training run has no validation micro-batch (data.val_fraction 0, or fewer validation blocks than "
            "train.micro_batch_size): there is nothing it reported val_loss on; evaluate held-out text with --data"
        )
    return tokens[: len(tokens) // tc.micro_batch_size * tc.micro_batch_size]


def run_evaluation(config: EvaluateConfig) -> dict[str, Any]:
    """Score the held-out blocks with the model; return the perplexity, bits per byte and what they count."""
    from gpt2_platform import checkpoint
    from gpt2_platform.batch import fingerprint
    from gpt2_platform.batch.generate import connect_and_plan_actors, resolve_adapter
    from gpt2_platform.batch.inputs import InputError

    started = time.perf_counter()
    model_dir, model, tokenizer = _resolve_model(config.model)
    context = config.engine.max_seq_len or checkpoint.read_config(model_dir).n_positions
    run = _training_run(Path(config.data.validation_of).expanduser()) if config.data.validation_of else None
    block_size = _block_size(config.data, run, context)
    data = None if run is not None else _held_out_data(config.data, tokenizer or model, block_size)
    adapter, adapter_dir = resolve_adapter(config.model.adapter, model_dir, model)
    model_sha256 = fingerprint.identity_sha256(fingerprint.model_identity(model_dir, tokenizer, adapter_dir))

    num_actors, gpus_per_actor = connect_and_plan_actors(config.scaling)
    spec = _worker_spec(config, model, model_sha256, tokenizer, adapter, gpus_per_actor)
    with _data_context(config.progress_bars):
        blocks, source = _blocks(config.data, run, data, block_size)
        logger.info("scoring blocks of %d + 1 tokens from %s with %d actor(s)", block_size, source, num_actors)
        totals = _score(blocks, spec, config.scaling, num_actors, gpus_per_actor)
    if not totals["blocks"]:
        raise InputError(
            f"the data holds fewer than block_size + 1 = {block_size + 1} tokens: no block to score; add text or "
            "lower data.block_size"
        )
    nll, tokens, num_bytes = -totals["log_likelihood"], totals["scored_tokens"], totals["scored_bytes"]
    wall_s = time.perf_counter() - started
    return {
        "model": model,
        "adapter": adapter,
        "model_sha256": model_sha256,
        "data": source,
        "block_size": block_size,
        "blocks": totals["blocks"],
        "scored_tokens": tokens,
        "scored_bytes": num_bytes,
        "nll_nats": nll,
        "loss": nll / tokens,
        "perplexity": perplexity(-nll, tokens),
        "bits_per_byte": nll / math.log(2) / num_bytes if num_bytes else None,
        "num_actors": num_actors,
        "wall_s": round(wall_s, 3),
        "tokens_per_s": round(tokens / wall_s, 1),
    }


def _resolve_model(model_config: ModelConfig) -> tuple[Path, str, str | None]:
    """(the model's directory, the model and the tokenizer as the actors load them): a local one by its
    absolute path."""
    from gpt2_platform import checkpoint
    from gpt2_platform.batch.inputs import InputError

    model_dir = checkpoint.resolve(model_config.path)
    if not (model_dir / checkpoint.CONFIG_NAME).is_file():
        raise InputError(
            f"model.path {model_config.path} holds no {checkpoint.CONFIG_NAME}; point it at a model directory"
        )
    model = str(model_dir.resolve()) if Path(model_config.path).expanduser().is_dir() else model_config.path
    tokenizer = model_config.tokenizer
    if tokenizer is not None and Path(tokenizer).expanduser().is_dir():
        tokenizer = str(Path(tokenizer).expanduser().resolve())
    return model_dir, model, tokenizer


def _block_size(data_config: EvalDataConfig, run, context: int) -> int:
    """data.block_size, or its default (the run's, or the engine's context), checked against both."""
    block_size = data_config.block_size or (run.data.block_size if run is not None else context)
    if run is not None and block_size != run.data.block_size:
        raise ConfigError(
            f"data.block_size={block_size} is not the run's data.block_size={run.data.block_size}: its validation "
            "blocks are of the run's size; leave data.block_size unset"
        )
    if block_size > context:
        raise ConfigError(
            f"data.block_size={block_size} is over the engine's context of {context} tokens (a block of "
            f"block_size + 1 tokens predicts block_size of them, as in training); lower data.block_size"
        )
    return block_size


def _held_out_data(data_config: EvalDataConfig, tokenizer: str, block_size: int) -> DataConfig:
    """The held-out text as training's data pipeline reads it, its files checked before Ray starts."""
    from gpt2_platform.train.data import files_by_format

    data = DataConfig(
        paths=data_config.paths,
        format=data_config.format,
        text_column=data_config.text_column,
        tokenizer=tokenizer,
        block_size=block_size,
    )
    files_by_format(data)  # paths, formats, UTF-8 and the text column, before Ray starts
    return data


def _worker_spec(
    config: EvaluateConfig,
    model: str,
    model_sha256: str,
    tokenizer: str | None,
    adapter: str | None,
    gpus_per_actor: float,
) -> WorkerSpec:
    return WorkerSpec(
        model=model,
        model_sha256=model_sha256,
        tokenizer=tokenizer,
        engine=config.engine,
        device="cuda" if gpus_per_actor > 0 else "cpu",
        # What the batch job's rows need, unused here: the actor only scores blocks.
        input=InputConfig(),
        generation=GenerationConfig(),
        run_id="evaluate",
        staging_dir="",
        task="score",
        adapter=adapter,
    )


def _blocks(data_config: EvalDataConfig, run, data: DataConfig | None, block_size: int) -> tuple[ray.data.Dataset, str]:
    """The blocks to score (a column of token ids) and where they come from, in words."""
    import ray.data

    from gpt2_platform.train.data import read_documents

    if run is not None:
        blocks = ray.data.from_numpy(_validation_blocks(run)).rename_columns({"data": TOKENS_COLUMN})
        return blocks, f"the validation blocks of the training run {data_config.validation_of}"
    assert data is not None
    blocks = ray.data.from_numpy(_pack_stream(read_documents(data), data.tokenizer, block_size))
    return blocks.rename_columns({"data": TOKENS_COLUMN}), ", ".join(data_config.paths)


def _score(
    blocks: ray.data.Dataset, spec: WorkerSpec, scaling: ScalingConfig, num_actors: int, gpus_per_actor: float
) -> dict[str, Any]:
    """Every block scored on the engine actors, summed (_sum_scores)."""
    from ray.data import ActorPoolStrategy

    scores = blocks.map_batches(
        ScoreBlocks,
        fn_constructor_kwargs={"spec": spec},
        compute=ActorPoolStrategy(
            size=num_actors,
            max_concurrent_calls_per_actor=scaling.concurrent_batches_per_actor,
            enable_true_multi_threading=True,
        ),
        batch_size=scaling.batch_size,
        batch_format="numpy",
        num_cpus=scaling.num_cpus_per_actor,
        num_gpus=gpus_per_actor,
    )
    return _sum_scores(scores.iter_batches(batch_size=None, batch_format="numpy"))


def _pack_stream(documents, tokenizer: str, block_size: int) -> np.ndarray:
    """Blocks of block_size + 1 tokens over the whole stream of documents (joined by end-of-text), the tail
    shorter than a block dropped once: packing per read batch would drop a tail per batch."""
    from gpt2_platform.train.data import TokenizeAndPack

    # Blocks of one token are a batch's whole stream, in order, with nothing dropped.
    tokenized = documents.map_batches(
        TokenizeAndPack(tokenizer, 0), batch_size=TOKENIZE_BATCH_DOCUMENTS, batch_format="numpy"
    )
    parts = [batch[TOKENS_COLUMN].ravel() for batch in tokenized.iter_batches(batch_size=None, batch_format="numpy")]
    stream = np.concatenate(parts) if parts else np.zeros(0, np.int32)
    width = block_size + 1
    return stream[: len(stream) // width * width].reshape(-1, width)


def _sum_scores(batches: Iterator[dict[str, np.ndarray]]) -> dict[str, Any]:
    """Totals over the scored blocks, with a log line every PROGRESS_EVERY_S for a long run."""
    totals: dict[str, Any] = {"blocks": 0, "log_likelihood": 0.0, "scored_tokens": 0, "scored_bytes": 0}
    parts: list[float] = []
    last_said = time.perf_counter()
    for batch in batches:
        parts.extend(batch["log_likelihood"].tolist())
        totals["blocks"] += len(batch["log_likelihood"])
        totals["scored_tokens"] += int(batch["scored_tokens"].sum())
        totals["scored_bytes"] += int(batch["scored_bytes"].sum())
        if time.perf_counter() - last_said > PROGRESS_EVERY_S:
            last_said = time.perf_counter()
            logger.info(
                "scored %d blocks (%d tokens) so far: perplexity %.4g",
                totals["blocks"],
                totals["scored_tokens"],
                perplexity(math.fsum(parts), totals["scored_tokens"]),
            )
    totals["log_likelihood"] = math.fsum(parts)
    return totals
