"""The fine-tuning flow end to end on a real local Ray: train, checkpoint, fail, resume, export."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import prometheus_lines, tiny_config
from gpt2_platform.monitoring import exporter
from gpt2_platform.train.loop import HISTORY, OPTIMIZER_STATE, TRAIN_STATE
from gpt2_platform.train.trainer import fit

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parent.parent


def history(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / HISTORY).read_text().splitlines()]


def tensorboard_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """(step, value) per tag from the run's TensorBoard event files, as TensorBoard itself reads them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def optimizer_steps(checkpoint_dir: Path) -> int:
    """AdamW's own step count: how many optimizer steps made the weights in this checkpoint."""
    state = torch.load(checkpoint_dir / OPTIMIZER_STATE, weights_only=True)["state"]
    return int(next(iter(state.values()))["step"])


def test_two_workers_learn_and_export_a_model_transformers_loads(ray_cluster, corpus, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = tiny_config(
        corpus,
        tmp_path,
        "scaling.num_workers=2",
        "train.max_steps=40",
        "train.profile=true",
        "train.profile_steps=[2,3]",
        "run.gpu_monitor=true",
    )
    result = fit(config)
    # Asked for, the GPU exporters started with the run (they report "no GPU" here); stop them for other tests.
    assert exporter.stop_exporters() == 1

    records = [r for r in history(result.run_dir) if "loss" in r]
    assert [r["step"] for r in records] == [5, 10, 15, 20, 25, 30, 35, 40]
    assert records[-1]["loss"] < records[0]["loss"] - 1.0, "the loss should fall on learnable data"
    assert records[-1]["val_loss"] < 3.0
    assert all(r["tokens_per_s"] > 0 and r["grad_norm"] > 0 for r in records)
    assert result.metrics["step"] == 40

    # Checkpoint: Hugging Face weights, optimizer and step, resolved config.
    assert json.loads((result.checkpoint_dir / TRAIN_STATE).read_text())["step"] == 40
    assert (result.checkpoint_dir / "config.yaml").read_text().count("num_workers: 2") == 1
    # Rank 0 exported the metrics to Prometheus, tagged with the run.
    (loss_line,) = prometheus_lines("ray_gpt2_train_loss", tag=f'run="{config.run.name}"')
    # One of the reported losses (the exporter samples every few seconds, so not necessarily the last).
    exported = float(loss_line.rsplit(" ", 1)[1])
    assert any(exported == pytest.approx(r["loss"], rel=1e-5) for r in records)
    # TensorBoard scalars beside history.jsonl, the same values at the same steps.
    scalars = tensorboard_scalars(result.run_dir)
    assert {"train/loss", "train/lr", "train/grad_norm", "val/loss", "val/perplexity", "perf/tokens_per_s"} <= set(
        scalars
    )
    assert [(step, pytest.approx(value, rel=1e-5)) for step, value in scalars["train/loss"]] == [
        (r["step"], r["loss"]) for r in records
    ]
    # The profiler's traces of steps 2-3, read as the README says (jobs/trace_summary.py).
    summary = subprocess.run(
        [sys.executable, "jobs/trace_summary.py", str(result.run_dir / "profile")],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "steps 2-3" in summary and "aten::" in summary

    # The export loads with transformers and predicts the corpus' fixed frame.
    tokenizer = AutoTokenizer.from_pretrained(result.model_dir)
    model = AutoModelForCausalLM.from_pretrained(result.model_dir).eval()
    ids = tokenizer(
        "alice has 3 apples. bob gives alice 2 apples. now alice has 5 apples.", return_tensors="pt"
    ).input_ids
    with torch.no_grad():
        loss = model(ids, labels=ids).loss.item()
    untrained = math.log(config_vocab := model.config.vocab_size)
    assert loss < untrained - 2.0, (
        f"exported model should have learned the corpus (loss {loss:.2f}, chance {untrained:.2f})"
    )
    assert config_vocab == 257


def test_worker_failure_resumes_from_checkpoint_and_resubmission_continues(ray_cluster, corpus, tmp_path):
    overrides = ["scaling.num_workers=2", "train.log_every=1", "train.checkpoint_every=4", "train.max_failures=1"]
    config = tiny_config(corpus, tmp_path, *overrides, "train.max_steps=10", "train.fail_at_step=7")
    result = fit(config)

    records = history(result.run_dir)
    starts = [r["start_step"] for r in records if r.get("event") == "start"]
    assert starts == [0, 4], "the restarted workers resume from the step-4 checkpoint"
    after_restart = records[[i for i, r in enumerate(records) if r.get("event") == "start"][1] + 1 :]
    assert [r["step"] for r in after_restart] == [5, 6, 7, 8, 9, 10]
    assert optimizer_steps(result.checkpoint_dir) == 10, "no optimizer step repeated or skipped"

    # Submitting the same run again with a later max_steps continues from step 10.
    again = fit(tiny_config(corpus, tmp_path, *overrides, "train.max_steps=12"))
    assert again.run_dir == result.run_dir
    starts = [r["start_step"] for r in history(again.run_dir) if r.get("event") == "start"]
    assert starts[-1] == 10
    assert optimizer_steps(again.checkpoint_dir) == 12
    assert again.metrics["step"] == 12
    # Checkpoints were taken at steps 4, 8, 10 and 12; Ray keeps the last train.keep_checkpoints (2).
    kept = sorted(p.name for p in again.run_dir.glob("checkpoint_step_*"))
    assert kept == ["checkpoint_step_00000010", "checkpoint_step_00000012"]
    # TensorBoard: what the failed attempt logged past its checkpoint (steps 5-6) was purged on resume,
    # so every step has one loss, from the attempt that carried on.
    losses = tensorboard_scalars(again.run_dir)["train/loss"]
    assert [step for step, _ in losses] == list(range(1, 13))
    by_step = {r["step"]: r["loss"] for r in history(again.run_dir) if "loss" in r}  # the last record per step
    assert [pytest.approx(by_step[step], rel=1e-5) for step, _ in losses] == [value for _, value in losses]


def test_nan_loss_stops_the_run_without_a_checkpoint(ray_cluster, corpus, tmp_path):
    import ray.train

    config = tiny_config(
        corpus, tmp_path, "optim.lr=1e30", "optim.warmup_steps=0", "train.log_every=1", "train.checkpoint_every=1"
    )
    with pytest.raises(ray.train.TrainingFailedError) as failure:
        fit(config)
    message = str(failure.value)
    assert "NonFiniteLossError" in message and "Lower optim.lr" in message
    bad_step = int(re.search(r"loss became \S+ by step (\d+)", message).group(1))
    run_dir = tmp_path / config.run.name
    saved = [json.loads((p / TRAIN_STATE).read_text())["step"] for p in run_dir.glob("checkpoint_step_*")]
    assert all(step < bad_step for step in saved), f"checkpoints {saved} include the broken step {bad_step}"
