"""The driver: validate the run, build the data, start the TorchTrainer, export the model."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import ray.train
import yaml
from ray.train.torch import TorchTrainer

from gpt2_platform import checkpoint as ckpt
from gpt2_platform.config_loader import ConfigError
from gpt2_platform.monitoring import exporter
from gpt2_platform.runtime import init_ray
from gpt2_platform.tokenizer import load_tokenizer
from gpt2_platform.train.config import Config, dump
from gpt2_platform.train.data import TOKENS_COLUMN, Datasets, build_datasets, files_by_format
from gpt2_platform.train.loading import model_config
from gpt2_platform.train.loop import HISTORY, train_loop_per_worker
from gpt2_platform.train.lora_run import check_same_lora, export_lora_run
from gpt2_platform.train.optim import check_same_setting
from gpt2_platform.train.resources import cluster_room, is_placement_timeout, lost_room_error, placement_timeout
from gpt2_platform.train.resume import RUN_CONFIG, Resume, choose_checkpoint
from gpt2_platform.train.shared_paths import check_shared_paths
from gpt2_platform.train.step import lr_at

logger = logging.getLogger(__name__)

FINAL_MODEL_DIR = "model"


@dataclass
class TrainResult:
    run_dir: Path
    model_dir: Path
    checkpoint_dir: Path | None
    metrics: dict


def run_dir_of(config: Config) -> Path:
    """Where the run lives. A relative storage_path is taken from the current directory, except
    under `ray job submit`, whose working directory is a temporary copy: there it goes under
    ~/gpt2-platform/ (use an absolute path on shared storage for multi-node clusters)."""
    storage = Path(os.path.expanduser(config.run.storage_path))
    if not storage.is_absolute() and _in_submitted_job():
        storage = Path.home() / "gpt2-platform" / storage
        logger.warning("run.storage_path is relative inside a submitted job; using %s", storage)
    return storage.resolve() / config.run.name


class StorageError(ValueError):
    """run.storage_path cannot hold the run; the message names the directory and why."""


def check_writable(run_dir: Path, storage_path: str) -> None:
    """Fail before any Ray work if the run directory cannot be created and written (checked by doing it,
    in the deepest directory that exists, because permission bits do not tell for root or a read-only mount)."""
    fix = "choose a directory you can write, e.g. --set run.storage_path=~/gpt2-runs"
    try:
        existing = run_dir
        while not existing.exists():
            existing = existing.parent
        if not existing.is_dir():
            raise StorageError(f"run.storage_path={storage_path} cannot be created: {existing} is a file; {fix}")
        os.rmdir(tempfile.mkdtemp(prefix=".write-check-", dir=existing))
    except OSError as error:
        raise StorageError(
            f"run.storage_path={storage_path} is not writable: {error.strerror} in {existing}; {fix}"
        ) from error


def _in_submitted_job() -> bool:
    # The job supervisor hands the job's runtime env to its driver in this variable.
    return "RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ


def validate(config: Config) -> None:
    """Checks that need more than one field, done before any Ray work starts."""
    arch = model_config(config.model)
    if config.data.block_size > arch.n_positions:
        raise ConfigError(
            f"data.block_size={config.data.block_size} exceeds the model's context of {arch.n_positions} tokens; "
            f"lower data.block_size"
        )
    if config.train.fail_at_step is not None and config.train.fail_at_step > config.train.max_steps:
        raise ConfigError(
            f"train.fail_at_step={config.train.fail_at_step} is past train.max_steps={config.train.max_steps}"
        )
    files_by_format(config.data)  # paths, formats and the text column, before Ray starts
    blocks = config.train.checkpoint_blocks
    if blocks is not None and blocks > arch.n_layer:
        raise ConfigError(
            f"train.checkpoint_blocks={blocks} is more than the model's {arch.n_layer} blocks; "
            f"use at most {arch.n_layer} (or null for all)"
        )
    if config.train.compile != "off" and config.train.gradient_checkpointing:
        logger.warning(
            "gradient checkpointing under torch.compile recomputes through the compiled graph; expect slower steps"
        )


def check_resume(config: Config, run_dir: Path) -> Resume | None:
    """What resuming this run will do, said before it starts: which checkpoint (passing over broken ones),
    and what a changed train.max_steps does to the learning-rate schedule.

    The cosine schedule keeps the length it had when the run started: stretching it under a running
    optimizer would throw the learning rate back up toward optim.lr. Steps past that length train at
    optim.min_lr; a run that stops before the schedule's end stops above it.
    """
    resume: Resume[None] | None = choose_checkpoint(run_dir)
    if resume is None:
        return None
    tc = config.train
    if resume.skipped:
        logger.warning(
            "resuming from %s (step %d), the newest whole checkpoint; passed over: %s",
            resume.directory.name,
            resume.step,
            "; ".join(resume.skipped),
        )
    if tc.max_steps < resume.step:
        raise ConfigError(
            f"train.max_steps={tc.max_steps} is below step {resume.step}, where run {config.run.name!r} already is "
            f"({resume.directory}); set train.max_steps >= {resume.step} to continue it, or choose another run.name"
        )
    if tc.max_steps == resume.step:
        logger.info("run %s is already at train.max_steps=%d; exporting its model again", config.run.name, tc.max_steps)
    elif tc.max_steps > resume.schedule_steps:
        logger.warning(
            "train.max_steps=%d goes past the %d steps this run's learning-rate schedule was made for; the schedule "
            "stays, so steps %d-%d train at optim.min_lr=%g (for a schedule of their own, start a new run with "
            "model.init_from set to this run's export)",
            tc.max_steps,
            resume.schedule_steps,
            max(resume.schedule_steps, resume.step) + 1,
            tc.max_steps,
            config.optim.min_lr,
        )
    elif tc.max_steps < resume.schedule_steps:
        logger.warning(
            "train.max_steps=%d stops this run before the end of its %d-step learning-rate schedule; its last step "
            "trains at lr %.3g, not optim.min_lr=%g",
            tc.max_steps,
            resume.schedule_steps,
            lr_at(tc.max_steps, config.optim, resume.schedule_steps),
            config.optim.min_lr,
        )
    saved = yaml.safe_load((resume.directory / RUN_CONFIG).read_text())
    check_same_setting(config.optim, saved)
    check_same_lora(config.model.lora, saved)
    if tc.max_steps > resume.step:
        keep_global_batch(config, saved)
    return resume


def keep_global_batch(config: Config, saved: dict) -> None:
    """Keep the global batch of the run being resumed, whose saved config is `saved`, by changing
    train.grad_accum_steps in `config`, unless train.global_batch_size was given.

    On other workers or another micro-batch size, the same accumulation would change the tokens of
    every optimizer step (and so the step the learning-rate schedule was tuned for). Where no whole
    number of micro-batches makes the old batch, the nearest is taken and a warning says so.
    """
    tc, workers = config.train, config.scaling.num_workers
    old_train = saved.get("train", {})
    old_batch = old_train.get("global_batch_size") or (
        old_train.get("micro_batch_size", tc.micro_batch_size)
        * old_train.get("grad_accum_steps", 1)
        * saved.get("scaling", {}).get("num_workers", 1)
    )
    block = config.data.block_size
    if old_batch == tc.global_batch_size:
        return
    if config.global_batch_given:
        logger.warning(
            "train.global_batch_size=%d changes this run's global batch from %d sequences a step to %d",
            tc.global_batch_size,
            old_batch,
            tc.global_batch_size,
        )
        return
    per_micro_step = tc.micro_batch_size * workers
    accum = max(1, round(old_batch / per_micro_step))
    before = tc.grad_accum_steps
    tc.grad_accum_steps, tc.global_batch_size = accum, accum * per_micro_step
    if tc.global_batch_size == old_batch:
        logger.info(
            "train.grad_accum_steps %d -> %d keeps the run's %d sequences (%d tokens) per optimizer step on "
            "%d worker(s) of train.micro_batch_size=%d",
            before,
            accum,
            old_batch,
            old_batch * block,
            workers,
            tc.micro_batch_size,
        )
    else:
        logger.warning(
            "the run trained on %d sequences (%d tokens) per optimizer step, which %d worker(s) of "
            "train.micro_batch_size=%d cannot make; it goes on with %d (%d tokens, train.grad_accum_steps=%d). "
            "Set train.global_batch_size to choose, or a micro-batch size that divides the old batch",
            old_batch,
            old_batch * block,
            workers,
            tc.micro_batch_size,
            tc.global_batch_size,
            tc.global_batch_size * block,
            accum,
        )


def export_model(checkpoint_dir: Path, config: Config, target: Path) -> Path:
    """The final model as a Hugging Face directory with its tokenizer, replacing any earlier export."""

    def fill(stage: Path) -> None:
        for name in (ckpt.CONFIG_NAME, ckpt.WEIGHTS_NAME, "config.yaml"):
            shutil.copy2(checkpoint_dir / name, stage / name)
        load_tokenizer(config.data.tokenizer).save_pretrained(stage)

    with ckpt.staged_directory(target, overwrite=True) as stage:
        fill(stage)
    return target


def validation_tokens(datasets: Datasets, num_rows: int) -> np.ndarray | None:
    """The first `num_rows` validation blocks as one array `(rows, block_size + 1)`."""
    if datasets.val is None:
        return None
    return datasets.val.take_batch(min(num_rows, datasets.num_val_blocks), batch_format="numpy")[TOKENS_COLUMN]


def fit(config: Config) -> TrainResult:
    """Train as configured (resuming the run of the same name), export and return where things are."""
    validate(config)
    run_dir = run_dir_of(config)
    check_writable(run_dir, config.run.storage_path)
    resume = check_resume(config, run_dir)
    init_ray()
    check_shared_paths(config, run_dir)
    with cluster_room(config.scaling):
        return _train_and_export(config, run_dir, resume)


def _train_and_export(config: Config, run_dir: Path, resume: Resume | None) -> TrainResult:
    """Build the data, run the TorchTrainer, export the final model."""
    exporter.start_if_wanted(config.run.gpu_monitor)
    tc, scaling = config.train, config.scaling
    datasets = build_datasets(
        config.data, model_config(config.model).vocab_size, tc.micro_batch_size * scaling.num_workers
    )
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={
            "config": config.to_dict(),
            "run_dir": str(run_dir),
            "resume_from": resume.directory.name if resume is not None else None,
            "num_train_blocks": datasets.num_train_blocks,
            # The same validation blocks every evaluation, shipped with the config (small: at most
            # eval_batches micro-batches per worker), so workers never re-read a dataset for them.
            "val_tokens": validation_tokens(datasets, tc.eval_batches * tc.micro_batch_size * scaling.num_workers),
        },
        scaling_config=ray.train.ScalingConfig(
            num_workers=scaling.num_workers,
            use_gpu=scaling.use_gpu,
            resources_per_worker={"CPU": scaling.cpus_per_worker, **scaling.resources_per_worker},
        ),
        run_config=ray.train.RunConfig(
            name=config.run.name,
            storage_path=str(run_dir.parent),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=tc.keep_checkpoints),
            # A restart that finds no room for its workers within scaling.resource_timeout_s fails the run
            # (placement_timeout), instead of waiting again: Ray counts that as a controller failure.
            failure_config=ray.train.FailureConfig(max_failures=tc.max_failures, controller_failure_limit=0),
            # Ray Train logs every report at INFO; rank 0 logs the metrics itself.
            logging_config=ray.train.LoggingConfig(log_level="WARNING"),
        ),
        datasets={"train": datasets.train},
    )
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(dump(config))
    except OSError as error:  # the check above passed, but the storage changed (or filled up) since
        raise StorageError(f"cannot write the run directory {run_dir}: {error.strerror}") from error
    try:
        with placement_timeout(scaling):
            result = trainer.fit()
    except ray.train.ControllerError as error:
        if not is_placement_timeout(error):
            raise
        last: Resume[None] | None = choose_checkpoint(run_dir)
        raise lost_room_error(scaling, last.directory if last is not None else None) from error
    # Ray's latest checkpoint, unless it is broken and the run resumed from an older one and stopped there.
    ray_latest = Path(result.checkpoint.path) if result.checkpoint is not None else None
    final: Resume[None] | None = choose_checkpoint(run_dir, ray_latest)
    if final is None:
        raise RuntimeError(f"training finished without a checkpoint in {run_dir}; see the worker logs above")
    if config.model.lora is not None:
        model_dir = export_lora_run(final.directory, config, run_dir, run_dir / FINAL_MODEL_DIR)
    else:
        model_dir = export_model(final.directory, config, run_dir / FINAL_MODEL_DIR)
    logger.info("model exported to %s (history: %s)", model_dir, run_dir / HISTORY)
    return TrainResult(
        run_dir=run_dir,
        model_dir=model_dir,
        checkpoint_dir=final.directory,
        metrics=dict(result.metrics or {}),
    )
