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
from safetensors import safe_open

from conftest import prometheus_lines, tiny_config
from gpt2_platform.config_loader import ConfigError
from gpt2_platform.monitoring import exporter
from gpt2_platform.train.loop import HISTORY
from gpt2_platform.train.resume import OPTIMIZER_STATE, TRAIN_STATE
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


def test_worker_failure_resumes_from_checkpoint(ray_cluster, corpus, tmp_path):
    # (Resubmitting a finished run with a later max_steps continues it: the FSDP test below and
    # tests/test_train_resume.py show it.)
    overrides = ["scaling.num_workers=2", "train.log_every=1", "train.checkpoint_every=4", "train.max_failures=1"]
    config = tiny_config(corpus, tmp_path, *overrides, "train.max_steps=10", "train.fail_at_step=7")
    result = fit(config)

    records = history(result.run_dir)
    starts = [r["start_step"] for r in records if r.get("event") == "start"]
    assert starts == [0, 4], "the restarted workers resume from the step-4 checkpoint"
    after_restart = records[[i for i, r in enumerate(records) if r.get("event") == "start"][1] + 1 :]
    assert [r["step"] for r in after_restart] == [5, 6, 7, 8, 9, 10]
    # The failed attempt's steps 5-6 were dropped from the history when the next attempt redid them.
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 11))
    assert optimizer_steps(result.checkpoint_dir) == 10, "no optimizer step repeated or skipped"
    # Checkpoints were taken at steps 4, 8 and 10; Ray keeps the last train.keep_checkpoints (2).
    kept = sorted(p.name for p in result.run_dir.glob("checkpoint_step_*"))
    assert kept == ["checkpoint_step_00000008", "checkpoint_step_00000010"]
    # TensorBoard: what the failed attempt logged past its checkpoint (steps 5-6) was purged on resume,
    # so every step has one loss, from the attempt that carried on.
    losses = tensorboard_scalars(result.run_dir)["train/loss"]
    assert [step for step, _ in losses] == list(range(1, 11))
    by_step = {r["step"]: r["loss"] for r in records if "loss" in r}
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


def shipped_validation_blocks(config) -> torch.Tensor:
    """The whole validation micro-batches a run of `config` ships to its workers, rebuilt from the seeded split."""
    from gpt2_platform.train.data import build_datasets
    from gpt2_platform.train.trainer import validation_tokens

    tc, workers = config.train, config.scaling.num_workers
    datasets = build_datasets(config.data, 257, tc.micro_batch_size * workers)
    blocks = torch.from_numpy(validation_tokens(datasets, tc.eval_batches * tc.micro_batch_size * workers))
    return blocks[: len(blocks) // tc.micro_batch_size * tc.micro_batch_size].long()


def validation_loss(model_dir: Path, blocks: torch.Tensor) -> float:
    """What training's evaluation should give for these weights, computed in one process: the cross-entropy
    over every target of the blocks."""
    import torch.nn.functional as F

    from gpt2_platform.checkpoint import load_pretrained

    model = load_pretrained(str(model_dir)).eval()
    with torch.no_grad():
        logits = model(blocks[:, :-1])[0]  # (B, T, vocab)
        return F.cross_entropy(logits.flatten(0, 1).double(), blocks[:, 1:].flatten()).item()


# Of the session corpus's 8,181 blocks of 32 tokens, 29 held out: 3 whole micro-batches of 8 (and 5 blocks
# left over), which two workers split 2 and 1; eval_batches=4 ships all 3 to one worker as well.
UNEVEN_VALIDATION = ("data.val_fraction=0.00355", "train.eval_batches=4")


# Under FSDP every forward is a collective: a rank with fewer validation batches than another used to wait in
# the loss all-reduce while the other waited in a forward's all-gather, forever. A hang fails this test.
@pytest.mark.timeout(300)
def test_an_fsdp_run_evaluates_an_uneven_validation_set_resumes_on_fewer_workers_and_exports(
    ray_cluster, corpus, tmp_path
):
    from transformers import AutoModelForCausalLM

    from gpt2_platform import checkpoint

    # With 8-bit AdamW (torchao), whose sharded low-bit states are the hardest to carry across worker counts;
    # torch's AdamW under FSDP is tests/test_ddp.py's.
    overrides = ["scaling.strategy=fsdp", "optim.name=adamw8bit", "train.checkpoint_every=3", "train.eval_every=0"]
    overrides += UNEVEN_VALIDATION
    config = tiny_config(corpus, tmp_path, *overrides, "scaling.num_workers=2", "train.max_steps=6")
    first = fit(config)
    assert optimizer_steps(first.checkpoint_dir) == 6
    moments = torch.load(first.checkpoint_dir / OPTIMIZER_STATE, weights_only=True)["state"]
    moments = moments["transformer.h.0.mlp.c_fc.weight"]
    assert type(moments["exp_avg"]) is torch.Tensor and moments["exp_avg"].shape == (256, 64), "saved whole"
    # Two workers' validation loss is one process's over the same blocks: each token counted once.
    blocks = shipped_validation_blocks(config)
    assert len(blocks) == 3 * 8, f"{len(blocks)} validation blocks: fix UNEVEN_VALIDATION for this corpus"
    assert first.metrics["val_loss"] == pytest.approx(validation_loss(first.checkpoint_dir, blocks), rel=1e-5)

    # The same run on one worker: the gathered checkpoint (weights and optimizer state by parameter name)
    # is sharded again over however many workers there are, and the run keeps its global batch.
    config = tiny_config(corpus, tmp_path, *overrides, "scaling.num_workers=1", "train.max_steps=8")
    again = fit(config)
    starts = [r for r in history(again.run_dir) if r.get("event") == "start"]
    assert [r["start_step"] for r in starts] == [0, 6]
    assert [r["tokens_per_step"] for r in starts] == [2 * 8 * 32] * 2, "one worker accumulates two micro-batches"
    assert optimizer_steps(again.checkpoint_dir) == 8, "no optimizer step repeated or skipped"
    records = [r for r in history(again.run_dir) if "loss" in r]
    assert records[-1]["loss"] < records[0]["loss"], "the resumed run should keep learning"
    assert again.metrics["val_loss"] == pytest.approx(validation_loss(again.model_dir, blocks), rel=1e-5)

    ids = torch.tensor([list(b"alice has 3 apples. bob gives")])
    theirs = AutoModelForCausalLM.from_pretrained(again.model_dir).eval()
    ours = checkpoint.load_pretrained(str(again.model_dir)).eval()
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, ours(ids)[0], rtol=1e-5, atol=1e-5)
    with safe_open(str(again.model_dir / "model.safetensors"), framework="pt") as weights:
        assert {weights.get_tensor(key).dtype for key in weights.keys()} == {torch.float32}

    with pytest.raises(ConfigError, match="optim.name=adamw cannot resume this run's checkpoint") as refused:
        fit(tiny_config(corpus, tmp_path, *UNEVEN_VALIDATION, "scaling.strategy=fsdp", "train.max_steps=10"))
    assert "\n" not in str(refused.value)
