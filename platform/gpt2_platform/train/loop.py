"""The training loop that runs on every Ray Train worker."""

from __future__ import annotations

import logging
import math
import os
import queue
import tempfile
import threading
import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray.train
import ray.train.torch
import torch
import torch.distributed as dist

from gpt2_platform.model import GPT2, flops_per_token
from gpt2_platform.train.collectives import all_reduce
from gpt2_platform.train.config import Config, from_dict
from gpt2_platform.train.history import HISTORY as HISTORY  # trainer.py and the tests import it from here
from gpt2_platform.train.history import append_history, truncate_history
from gpt2_platform.train.loading import build_model
from gpt2_platform.train.loss import LMLoss
from gpt2_platform.train.metrics import TrainMetrics
from gpt2_platform.train.optim import precision_for, weights_dtype
from gpt2_platform.train.parallelize import parallelize
from gpt2_platform.train.profiler import Profiler
from gpt2_platform.train.resume import (
    Resume,
    checkpoint_dir_name,
    choose_checkpoint,
)
from gpt2_platform.train.run_checkpoint import (
    OptimizerStates,
    gather_full_states,
    load_optimizer_state,
    read_checkpoint,
    save_checkpoint,
)
from gpt2_platform.train.scalars import ScalarLog
from gpt2_platform.train.step import TrainStep, build_optimizer, lr_at, resolve_precision
from gpt2_platform.train.throughput import mfu, peak_memory_gib, peak_tflops
from gpt2_platform.train.validation import ValidationShard, evaluate, validation_batches
from gpt2_platform.worker_process import configure_worker_logging

logger = logging.getLogger(__name__)


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or infinite; training stops before saving a broken checkpoint."""


PREFETCH_MICRO_BATCHES = 32
"""Micro-batches read ahead of the step (about 130 KB each for GPT-2's blocks of 1,024 tokens); 0 reads inline
(the probe's baseline)."""


def micro_batches(
    shard: Any,
    batch_size: int,
    device: torch.device,
    seed: int,
    skip: int,
    micro_per_epoch: int,
    prefetch: int = PREFETCH_MICRO_BATCHES,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless (inputs, targets) micro-batches over epochs of this worker's shard, skipping `skip` first.

    A thread reads them `prefetch` ahead, across epoch boundaries: each epoch is a new pass of Ray Data over
    the shard, and its start (the split's coordination, the shuffle buffer filling) would otherwise be time
    the device waits for its next step at every boundary (`tools/probes/epoch_boundary.py` measures the wait).
    Ray Data's own prefetching stops at the end of an epoch.
    """
    blocks = _tokens(shard, batch_size, seed, skip, micro_per_epoch)
    if prefetch:
        blocks = _read_ahead(blocks, prefetch)
    try:
        for tokens in blocks:
            tokens = tokens.to(device, non_blocking=True)  # (B, T + 1)
            yield tokens[:, :-1], tokens[:, 1:]
    finally:
        blocks.close()  # a reader thread stops with it


def _read_ahead(items: Iterator[Any], depth: int) -> Generator[Any, None, None]:
    """`items`, drawn by a thread up to `depth` ahead of the consumer; what the thread raises is raised here."""
    ahead: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item: Any) -> bool:
        while not stop.is_set():
            try:
                ahead.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def read() -> None:
        try:
            for item in items:
                if not put(item):
                    return
        except BaseException as error:
            put(_ReadFailed(error))

    threading.Thread(target=read, name="read-ahead", daemon=True).start()
    try:
        while True:
            item = ahead.get()
            if isinstance(item, _ReadFailed):
                raise RuntimeError("reading the training data failed") from item.error
            yield item
    finally:
        stop.set()


def _tokens(
    shard: Any, batch_size: int, seed: int, skip: int, micro_per_epoch: int
) -> Generator[torch.Tensor, None, None]:
    """The shard's (B, T + 1) token blocks, epoch after epoch, each epoch shuffled by its own seed."""
    epoch, skip = divmod(skip, micro_per_epoch)
    while True:
        batches = shard.iter_torch_batches(
            batch_size=batch_size,
            drop_last=True,
            dtypes=torch.long,
            local_shuffle_buffer_size=max(4 * batch_size, 64),
            local_shuffle_seed=seed + epoch,
        )
        for batch in batches:
            if skip:
                skip -= 1
                continue
            yield batch["tokens"]
        epoch += 1


class _ReadFailed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


def resume_checkpoint(
    run_dir: Path, model: GPT2, device: torch.device, rank: int, expected: str | None
) -> Resume[OptimizerStates] | None:
    """Load the newest whole checkpoint (Ray's latest first) into `model`; the same one on every rank.
    `expected` is the driver's choice: it already warned about what it passed over, so a worker warns only
    where it chose otherwise (a checkpoint that failed to load, or one written since)."""
    latest = ray.train.get_checkpoint()
    resume = choose_checkpoint(
        run_dir, Path(latest.path) if latest is not None else None, lambda d: read_checkpoint(d, model, device)
    )
    step = resume.step if resume is not None else -1
    (low,), (high,) = (all_reduce([step], device, op) for op in (dist.ReduceOp.MIN, dist.ReduceOp.MAX))
    if low != high:
        raise RuntimeError(
            f"workers chose checkpoints of steps {low:g} to {high:g}: {run_dir} must be the same shared storage "
            "on every node (run.storage_path)"
        )
    if rank == 0 and resume is not None:
        skipped = f"; passed over: {'; '.join(resume.skipped)}" if resume.skipped else ""
        level = logging.WARNING if resume.skipped and resume.directory.name != expected else logging.INFO
        logger.log(level, "resuming from %s (step %d)%s", resume.directory, resume.step, skipped)
    return resume


def _inject_failure(run_dir: Path, step: int) -> None:
    marker = run_dir / f".injected-failure-step-{step}"
    if not marker.exists():
        marker.touch()
        logger.warning("fault injection: rank 0 exits at step %d", step)
        os._exit(1)


def _configure_worker_logging() -> None:
    """Our package's INFO logs on the worker's console (as every Ray worker of ours shows them), and Ray
    Train's and Ray Data's at WARNING."""
    configure_worker_logging()
    # Ray Train logs every report and Ray Data every validation pass at INFO; keep their warnings only.
    names = ["ray.train", "ray.data"]
    try:  # Ray 2.60 logs each report under a logger named after this file's path, outside "ray.train".
        from ray.train.v2._internal.execution import context as train_context

        names.append(train_context.__file__)
    except ImportError:
        pass
    for name in names:
        logging.getLogger(name).setLevel(logging.WARNING)


@dataclass(frozen=True)
class _Worker:
    """This worker's place in the run: the run's config and directory, its rank of how many, its device."""

    config: Config
    run_dir: Path
    rank: int
    world: int
    device: torch.device


@dataclass
class _Progress:
    """Where the run stands: its last step done, the tokens trained on so far, and the schedule's length."""

    step: int
    tokens_seen: int
    schedule_steps: int

    def state(self) -> dict[str, int]:
        """What a checkpoint keeps of it."""
        return {"step": self.step, "tokens_seen": self.tokens_seen, "schedule_steps": self.schedule_steps}


@dataclass(frozen=True)
class _Throughput:
    """What turns a window of steps into the report's rates; fixed for the run."""

    tokens_per_step: int
    micro_per_epoch: int
    model_flops: float  # per token
    peak_tflops: float | None


class _Window:
    """The steps since the last report: their loss summed on the device (so no step waits for it), and time."""

    def __init__(self, device: torch.device) -> None:
        self.loss = torch.zeros((), device=device)
        self.num_steps, self.start = 0, time.perf_counter()

    def add(self, loss: torch.Tensor) -> None:
        self.loss += loss
        self.num_steps += 1

    def reset(self) -> None:
        self.loss.zero_()
        self.num_steps, self.start = 0, time.perf_counter()


def train_loop_per_worker(loop_config: dict) -> None:
    """Runs on each worker: build, resume, train to max_steps, report and checkpoint."""
    _configure_worker_logging()
    config = from_dict(loop_config["config"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    worker = _Worker(config, Path(loop_config["run_dir"]), rank, world, ray.train.torch.get_device())
    tc, device = config.train, worker.device
    torch.manual_seed(tc.seed)

    model, step_fn, resume = _build(worker, loop_config.get("resume_from"))
    progress = _Progress(0, 0, tc.max_steps)
    if resume is not None:
        # The schedule keeps the length of the run that started it (see trainer.check_resume).
        progress = _Progress(resume.step, resume.tokens_seen, resume.schedule_steps)
    start_step = progress.step
    throughput = _Throughput(
        tokens_per_step=tc.micro_batch_size * tc.grad_accum_steps * world * config.data.block_size,
        micro_per_epoch=loop_config["num_train_blocks"] // world // tc.micro_batch_size,
        model_flops=flops_per_token(model.config, config.data.block_size),
        peak_tflops=peak_tflops(device, tc.peak_tflops),
    )
    train_shard = ray.train.get_dataset_shard("train")
    val = validation_batches(loop_config["val_tokens"], tc.micro_batch_size, rank, world)
    skip = start_step * tc.grad_accum_steps
    batches = micro_batches(train_shard, tc.micro_batch_size, device, tc.seed + rank, skip, throughput.micro_per_epoch)
    if rank == 0:
        _record_start(worker, model, step_fn.precision.name, start_step, throughput.tokens_per_step)
    if start_step >= tc.max_steps:
        if rank == 0:
            logger.info("run already finished at step %d", start_step)
        return
    _train(worker, model, step_fn, batches, val, progress, throughput)


def _build(worker: _Worker, expected: str | None) -> tuple[GPT2, TrainStep, Resume[OptimizerStates] | None]:
    """The model (with the resumed checkpoint's weights, if any), parallelized, and its train step (with the
    checkpoint's optimizer state); `expected`: the checkpoint the driver chose."""
    config, device = worker.config, worker.device
    tc, scaling = config.train, config.scaling
    model = build_model(config.model).to(device)
    precision = resolve_precision(precision_for(config.optim, tc.precision), device)
    resume = resume_checkpoint(worker.run_dir, model, device, worker.rank, expected)
    model.to(weights_dtype(config.optim))  # after the checkpoint's fp32 weights are in
    train_model = parallelize(
        model,
        device,
        tc.compile,
        tc.gradient_checkpointing,
        scaling.strategy,
        precision.autocast_dtype,
        scaling.cpu_offload,
        tc.checkpoint_blocks,
    )
    optimizer = build_optimizer(model, config.optim, device)
    loss_fn = LMLoss(tc.loss, tc.vocab_multiple)
    step_fn = TrainStep(train_model, optimizer, precision, device, config.optim.grad_clip, loss_fn=loss_fn)
    if resume is not None:
        loaded = resume.loaded
        assert loaded is not None  # resume_checkpoint loads the checkpoint it chooses
        load_optimizer_state(model, step_fn.optimizer, loaded.optimizer)
        if loaded.scaler is not None:
            step_fn.scaler.load_state_dict(loaded.scaler)
    return model, step_fn, resume


def _record_start(worker: _Worker, model: GPT2, precision: str, start_step: int, tokens_per_step: int) -> None:
    """Rank 0: the attempt's start in history.jsonl (after dropping the steps it will redo), and in the log."""
    config, run_dir = worker.config, worker.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    truncate_history(run_dir, start_step)
    append_history(
        run_dir,
        {
            "event": "start",
            "start_step": start_step,
            "world_size": worker.world,
            "tokens_per_step": tokens_per_step,
            "time": time.time(),
        },
    )
    logger.info(
        "training %s (%.1fM params) on %d x %s, %s, compile=%s, from step %d to %d, %d tokens/step",
        config.model.init_from or config.model.preset,
        model.num_params() / 1e6,
        worker.world,
        worker.device.type,
        precision,
        config.train.compile,
        start_step,
        config.train.max_steps,
        tokens_per_step,
    )


def _train(
    worker: _Worker,
    model: GPT2,
    step_fn: TrainStep,
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
    val: ValidationShard | None,
    progress: _Progress,
    throughput: _Throughput,
) -> None:
    """The steps after `progress.step` up to max_steps; a report every log_every steps, at every evaluation
    and at every checkpoint."""
    config, rank, run_dir, device = worker.config, worker.rank, worker.run_dir, worker.device
    tc = config.train
    profiler = Profiler(tc.profile, tc.profile_steps, run_dir / "profile", rank, device)
    # Flushed at every report, so a run that fails loses none of what it wrote.
    scalars = ScalarLog(run_dir, progress.step) if rank == 0 else None
    window = _Window(device)
    for step in range(progress.step + 1, tc.max_steps + 1):
        if rank == 0 and tc.fail_at_step == step:
            _inject_failure(run_dir, step)
        profiler.before_step(step)
        lr = lr_at(step, config.optim, progress.schedule_steps)
        loss, grad_norm = step_fn([next(batches) for _ in range(tc.grad_accum_steps)], lr)
        profiler.after_step(step)
        window.add(loss)
        progress.step, progress.tokens_seen = step, progress.tokens_seen + throughput.tokens_per_step

        is_last = step == tc.max_steps
        do_eval = val is not None and ((tc.eval_every and step % tc.eval_every == 0) or is_last)
        do_checkpoint = (tc.checkpoint_every and step % tc.checkpoint_every == 0) or is_last
        if not (step % tc.log_every == 0 or do_eval or do_checkpoint):
            continue

        # A report step: sync, check the loss, measure, evaluate, checkpoint.
        metrics = _measure(worker, window, progress, lr, grad_norm, throughput)
        if do_eval:
            metrics["val_loss"] = evaluate(step_fn.model, step_fn, val, device)
            metrics["val_ppl"] = math.exp(min(metrics["val_loss"], 50.0))
        _report(metrics, do_checkpoint, rank, run_dir, model, step_fn, config, progress.state(), scalars)
        window.reset()
    if scalars is not None:
        scalars.close()


def _measure(
    worker: _Worker, window: _Window, progress: _Progress, lr: float, grad_norm: torch.Tensor, throughput: _Throughput
) -> dict[str, Any]:
    """A report's metrics over the window, the same on every rank; NonFiniteLossError if the loss is not finite."""
    device, world, step = worker.device, worker.world, progress.step
    (loss_sum,) = all_reduce([window.loss.item()], device)
    mean_loss = loss_sum / world / window.num_steps
    if not math.isfinite(mean_loss):
        raise NonFiniteLossError(
            f"loss became {mean_loss} by step {step}; training stopped without saving this state. "
            f"Lower optim.lr (now {worker.config.optim.lr}), keep optim.grad_clip on, prefer bf16 to fp16, or check the data."
        )
    elapsed = time.perf_counter() - window.start
    tokens_per_s = throughput.tokens_per_step * window.num_steps / elapsed
    metrics: dict[str, Any] = {
        "step": step,
        "loss": mean_loss,
        "lr": lr,
        "grad_norm": float(grad_norm),
        "tokens_per_s": tokens_per_s,
        "step_time_ms": 1000 * elapsed / window.num_steps,
        "tokens_seen": progress.tokens_seen,
        "epoch": step * worker.config.train.grad_accum_steps / max(1, throughput.micro_per_epoch),
    }
    utilization = mfu(tokens_per_s / world, throughput.model_flops, throughput.peak_tflops)
    if utilization is not None:
        metrics["mfu"] = utilization
    peak_mem = peak_memory_gib(device)
    if peak_mem is not None:
        (metrics["peak_mem_gib"],) = all_reduce(
            [peak_mem], device, dist.ReduceOp.MAX if dist.is_initialized() else None
        )
    return metrics


_METRICS: dict[str, TrainMetrics] = {}


def _train_metrics(run_name: str) -> TrainMetrics:
    """One set of gauges per run in this worker process (Ray metrics are registered once)."""
    if run_name not in _METRICS:
        _METRICS[run_name] = TrainMetrics(run_name)
    return _METRICS[run_name]


def _report(
    metrics: dict,
    do_checkpoint: bool,
    rank: int,
    run_dir: Path,
    model: GPT2,
    step_fn: TrainStep,
    config: Config,
    state: dict,
    scalars: ScalarLog | None,
) -> None:
    """Every rank reports (ray.train.report is a barrier); rank 0 alone attaches the checkpoint."""
    if rank == 0:
        append_history(run_dir, {**metrics, "time": time.time()})
        if scalars is not None:
            scalars.record(metrics)
        _train_metrics(config.run.name).record(metrics)
        extra = "".join(f" {k}={metrics[k]:.4g}" for k in ("val_loss", "mfu", "peak_mem_gib") if k in metrics)
        logger.info(
            "step %d loss %.4f lr %.2e grad_norm %.3f %.0f tokens/s%s",
            metrics["step"],
            metrics["loss"],
            metrics["lr"],
            metrics["grad_norm"],
            metrics["tokens_per_s"],
            extra,
        )
    full = gather_full_states(model, step_fn.optimizer) if do_checkpoint else None  # every rank takes part
    if do_checkpoint and rank == 0:
        with tempfile.TemporaryDirectory() as directory:
            save_checkpoint(Path(directory), model, step_fn, state, config, full)
            ray.train.report(
                metrics,
                checkpoint=ray.train.Checkpoint.from_directory(directory),
                checkpoint_dir_name=checkpoint_dir_name(run_dir, state["step"]),
            )
    else:
        ray.train.report(metrics)
