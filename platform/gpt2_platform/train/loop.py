"""The training loop that runs on every Ray Train worker."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import queue
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist

from gpt2_platform import traces
from gpt2_platform.model import GPT2, flops_per_token
from gpt2_platform.train.config import Config, from_dict
from gpt2_platform.train.loading import build_model
from gpt2_platform.train.loss import LMLoss
from gpt2_platform.train.metrics import TrainMetrics
from gpt2_platform.train.optim import precision_for, weights_dtype
from gpt2_platform.train.parallelize import parallelize
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
from gpt2_platform.worker_process import configure_worker_logging

logger = logging.getLogger(__name__)

HISTORY = "history.jsonl"


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or infinite; training stops before saving a broken checkpoint."""


def _all_reduce(values: list[float], device: torch.device, op: Any = None) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=op or dist.ReduceOp.SUM)
    return tensor.tolist()


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


def _read_ahead(items: Iterator[Any], depth: int) -> Iterator[Any]:
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


def _tokens(shard: Any, batch_size: int, seed: int, skip: int, micro_per_epoch: int) -> Iterator[torch.Tensor]:
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


@dataclass
class ValidationShard:
    """This rank's share of the fixed validation micro-batches, and the number of forwards every rank runs.

    Under FSDP every forward is a collective (each block's parameters are all-gathered), so every rank must
    run the same number of them: a rank whose share is shorter runs `filler` for the rest and does not count
    its loss.
    """

    batches: list[torch.Tensor]
    num_forwards: int
    filler: torch.Tensor


def validation_batches(
    tokens: np.ndarray | None, micro_batch_size: int, rank: int, world: int
) -> ValidationShard | None:
    """Rank r's share of the complete validation micro-batches (every r-th one); None, on every rank, if
    there is not one complete micro-batch. Every rank gets the same `tokens`, so all agree on the count."""
    if tokens is None:
        return None
    tokens = torch.from_numpy(tokens.astype(np.int64))  # (rows, T + 1); a copy: the object store's array is read-only
    batches = [tokens[i : i + micro_batch_size] for i in range(0, len(tokens) - micro_batch_size + 1, micro_batch_size)]
    if not batches:
        return None
    return ValidationShard(batches[rank::world], num_forwards=math.ceil(len(batches) / world), filler=batches[0])


@torch.no_grad()
def evaluate(model: torch.nn.Module, step_fn: TrainStep, shard: ValidationShard, device: torch.device) -> float:
    """Mean validation loss per token over every rank's batches (the same number of forwards on each rank)."""
    loss_sum, num_tokens = 0.0, 0
    model.eval()
    for i in range(shard.num_forwards):
        counted = i < len(shard.batches)
        tokens = (shard.batches[i] if counted else shard.filler).to(device)
        with step_fn.autocast():
            _, loss = model(tokens[:, :-1], tokens[:, 1:])
        if counted:  # the model's loss is the mean over the batch's targets
            loss_sum += loss.item() * tokens[:, 1:].numel()
            num_tokens += tokens[:, 1:].numel()
    model.train()
    loss_sum, num_tokens = _all_reduce([loss_sum, num_tokens], device)
    return loss_sum / num_tokens


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
    (low,), (high,) = (_all_reduce([step], device, op) for op in (dist.ReduceOp.MIN, dist.ReduceOp.MAX))
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


def _append_history(run_dir: Path, record: dict) -> None:
    with (run_dir / HISTORY).open("a") as f:
        f.write(json.dumps(record) + "\n")


def truncate_history(run_dir: Path, start_step: int) -> None:
    """Drop the step records past `start_step` from history.jsonl, keeping every start record.

    An attempt that failed after its last checkpoint logged steps the next attempt redoes: without this each
    of them would appear twice. Rewritten through a temporary file, so a crash leaves the old or the new
    history, never half of one.
    """
    path = run_dir / HISTORY
    if not path.exists():
        return
    lines = path.read_text().splitlines()
    kept = []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a worker that died while writing it
            logger.warning("dropping a broken line of %s: %.80s", path, line)
            continue
        if record.get("step", 0) <= start_step:
            kept.append(line)
    if len(kept) == len(lines):
        return
    temporary = path.with_name(f".{HISTORY}.{os.getpid()}.tmp")
    temporary.write_text("".join(line + "\n" for line in kept))
    os.replace(temporary, path)


def _inject_failure(run_dir: Path, step: int) -> None:
    marker = run_dir / f".injected-failure-step-{step}"
    if not marker.exists():
        marker.touch()
        logger.warning("fault injection: rank 0 exits at step %d", step)
        os._exit(1)


# libkineto prints this once a process, with a bare fprintf that neither KINETO_LOG_LEVEL nor TORCH_CPP_LOG_LEVEL
# reaches, when the first profiler starts in a thread other than the one that loaded libtorch, and Ray Train runs
# this loop in a thread of its own. What it then skips is torch's set-up for MTIA devices: the trace is whole.
_KINETO_THREAD_NOTICE = b"External init callback must run in same thread as registerClient"


@contextlib.contextmanager
def _stderr_without(text: bytes) -> Iterator[None]:
    """Hold back what this process writes to its stderr meanwhile (any thread, C or Python), and write it
    afterwards less the lines that contain `text`."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = memoryview(b"".join(line for line in held if text not in line))
            while kept:
                kept = kept[os.write(2, kept) :]


class Profiler:
    """torch.profiler over a window of optimizer steps, written as Chrome trace files (gpt2_platform/traces.py).

    Each step is a range of its own in the trace (`traces.STEP_PREFIX` and its number), so a summary and
    a timeline viewer show where one ends and the next begins.
    """

    def __init__(self, enabled: bool, window: list[int], out_dir: Path, rank: int, device: torch.device) -> None:
        self.first, self.last = window
        self.out_dir, self.rank, self.device = out_dir, rank, device
        self.profiler: torch.profiler.profile | None = None
        self.step_range: torch.profiler.record_function | None = None
        self.enabled = enabled

    def before_step(self, step: int) -> None:
        if self.enabled and step == self.first:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(
                activities=activities,
                record_shapes=True,
                on_trace_ready=torch.profiler.tensorboard_trace_handler(
                    str(self.out_dir), worker_name=f"rank{self.rank}"
                ),
            )
            with _stderr_without(_KINETO_THREAD_NOTICE):
                self.profiler.__enter__()
        if self.profiler is not None:
            self.step_range = torch.profiler.record_function(f"{traces.STEP_PREFIX}{step}")
            self.step_range.__enter__()

    def after_step(self, step: int) -> None:
        if self.profiler is None:
            return
        assert self.step_range is not None
        self.step_range.__exit__(None, None, None)
        if step < self.last:
            return
        self.profiler.__exit__(None, None, None)
        self.profiler = None
        if self.rank == 0:
            logger.info(
                "profiler trace of steps %d-%d written to %s; summary: python jobs/trace_summary.py %s; "
                "timeline: open it in %s",
                self.first,
                self.last,
                self.out_dir,
                self.out_dir,
                traces.VIEWER,
            )


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


def train_loop_per_worker(loop_config: dict) -> None:
    """Runs on each worker: build, resume, train to max_steps, report and checkpoint."""
    _configure_worker_logging()
    config = from_dict(loop_config["config"])
    run_dir = Path(loop_config["run_dir"])
    tc = config.train
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device()
    torch.manual_seed(tc.seed)

    model = build_model(config.model).to(device)
    precision = resolve_precision(precision_for(config.optim, tc.precision), device)
    resume = resume_checkpoint(run_dir, model, device, rank, loop_config.get("resume_from"))
    model.to(weights_dtype(config.optim))  # after the checkpoint's fp32 weights are in
    scaling = config.scaling
    train_model = parallelize(
        model,
        device,
        tc.compile,
        tc.gradient_checkpointing,
        scaling.strategy,
        precision.autocast_dtype,
        scaling.cpu_offload,
    )
    optimizer = build_optimizer(model, config.optim, device)
    loss_fn = LMLoss(tc.loss, tc.vocab_multiple)
    step_fn = TrainStep(train_model, optimizer, precision, device, config.optim.grad_clip, loss_fn=loss_fn)
    start_step, tokens_seen, schedule_steps = 0, 0, tc.max_steps
    if resume is not None:
        load_optimizer_state(model, step_fn.optimizer, resume.loaded.optimizer)
        if resume.loaded.scaler is not None:
            step_fn.scaler.load_state_dict(resume.loaded.scaler)
        # The schedule keeps the length of the run that started it (see trainer.check_resume).
        start_step, tokens_seen, schedule_steps = resume.step, resume.tokens_seen, resume.schedule_steps
    block_size = config.data.block_size
    tokens_per_step = tc.micro_batch_size * tc.grad_accum_steps * world * block_size
    micro_per_epoch = loop_config["num_train_blocks"] // world // tc.micro_batch_size
    train_shard = ray.train.get_dataset_shard("train")
    val = validation_batches(loop_config["val_tokens"], tc.micro_batch_size, rank, world)
    batches = micro_batches(
        train_shard, tc.micro_batch_size, device, tc.seed + rank, start_step * tc.grad_accum_steps, micro_per_epoch
    )
    model_flops = flops_per_token(model.config, block_size)
    peak = peak_tflops(device, tc.peak_tflops)
    profiler = Profiler(tc.profile, tc.profile_steps, run_dir / "profile", rank, device)
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        truncate_history(run_dir, start_step)
        _append_history(
            run_dir,
            {
                "event": "start",
                "start_step": start_step,
                "world_size": world,
                "tokens_per_step": tokens_per_step,
                "time": time.time(),
            },
        )
        logger.info(
            "training %s (%.1fM params) on %d x %s, %s, compile=%s, from step %d to %d, %d tokens/step",
            config.model.init_from or config.model.preset,
            model.num_params() / 1e6,
            world,
            device.type,
            precision.name,
            tc.compile,
            start_step,
            tc.max_steps,
            tokens_per_step,
        )
    if start_step >= tc.max_steps:
        if rank == 0:
            logger.info("run already finished at step %d", start_step)
        return
    # Flushed at every report, so a run that fails loses none of what it wrote.
    scalars = ScalarLog(run_dir, start_step) if rank == 0 else None

    window_loss = torch.zeros((), device=device)
    window_steps, window_start = 0, time.perf_counter()
    for step in range(start_step + 1, tc.max_steps + 1):
        if rank == 0 and tc.fail_at_step == step:
            _inject_failure(run_dir, step)
        profiler.before_step(step)
        lr = lr_at(step, config.optim, schedule_steps)
        loss, grad_norm = step_fn([next(batches) for _ in range(tc.grad_accum_steps)], lr)
        profiler.after_step(step)
        window_loss += loss
        window_steps += 1
        tokens_seen += tokens_per_step

        is_last = step == tc.max_steps
        do_eval = val is not None and ((tc.eval_every and step % tc.eval_every == 0) or is_last)
        do_checkpoint = (tc.checkpoint_every and step % tc.checkpoint_every == 0) or is_last
        if not (step % tc.log_every == 0 or do_eval or do_checkpoint):
            continue

        # A report step: sync, check the loss, measure, evaluate, checkpoint.
        (loss_sum,) = _all_reduce([window_loss.item()], device)
        mean_loss = loss_sum / world / window_steps
        if not math.isfinite(mean_loss):
            raise NonFiniteLossError(
                f"loss became {mean_loss} by step {step}; training stopped without saving this state. "
                f"Lower optim.lr (now {config.optim.lr}), keep optim.grad_clip on, prefer bf16 to fp16, or check the data."
            )
        elapsed = time.perf_counter() - window_start
        tokens_per_s = tokens_per_step * window_steps / elapsed
        metrics: dict[str, Any] = {
            "step": step,
            "loss": mean_loss,
            "lr": lr,
            "grad_norm": float(grad_norm),
            "tokens_per_s": tokens_per_s,
            "step_time_ms": 1000 * elapsed / window_steps,
            "tokens_seen": tokens_seen,
            "epoch": step * tc.grad_accum_steps / max(1, micro_per_epoch),
        }
        utilization = mfu(tokens_per_s / world, model_flops, peak)
        if utilization is not None:
            metrics["mfu"] = utilization
        peak_mem = peak_memory_gib(device)
        if peak_mem is not None:
            (metrics["peak_mem_gib"],) = _all_reduce(
                [peak_mem], device, dist.ReduceOp.MAX if dist.is_initialized() else None
            )
        if do_eval:
            metrics["val_loss"] = evaluate(train_model, step_fn, val, device)
            metrics["val_ppl"] = math.exp(min(metrics["val_loss"], 50.0))
        state = {"step": step, "tokens_seen": tokens_seen, "schedule_steps": schedule_steps}
        _report(metrics, do_checkpoint, rank, run_dir, model, step_fn, config, state, scalars)
        window_loss.zero_()
        window_steps, window_start = 0, time.perf_counter()
    if scalars is not None:
        scalars.close()


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
        _append_history(run_dir, {**metrics, "time": time.time()})
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
