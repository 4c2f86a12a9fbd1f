"""jobs/evaluate.py on a real local Ray (CPU, fp32): its perplexity is the training job's validation perplexity
on the same blocks, and on held-out text it is the training code's own evaluate() of the blocks training's
packing makes of that text; bits per byte count the scored tokens' bytes."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from conftest import REPO_ROOT
from gpt2_platform import demo_data
from gpt2_platform.checkpoint import load_pretrained
from gpt2_platform.train.data import TokenizeAndPack
from gpt2_platform.train.loop import evaluate, validation_batches

pytestmark = pytest.mark.slow


def _load_main() -> Callable[[list[str]], int]:
    spec = importlib.util.spec_from_file_location("jobs_evaluate", REPO_ROOT / "jobs" / "evaluate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


evaluate_main = _load_main()
QUICK = ["--set", "engine.dtype=fp32", "--set", "progress_bars=false", "--set", "scaling.num_actors=1"]


def run_evaluate(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "result.json"
    assert evaluate_main([*args, *QUICK, "--json-out", str(out)]) == 0
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def trained(tiny_run):
    """A few steps of the real training job; its last report evaluates the exported weights (conftest.py: the
    session's 8-step run, eval_batches=3, val_fraction=0.02, evaluated at steps 4 and 8, which
    tests/test_train_resume.py resumes from copies)."""
    assert tiny_run.metrics["step"] == 8 and "val_loss" in tiny_run.metrics
    return tiny_run


def test_perplexity_on_a_runs_validation_blocks_is_the_training_jobs_validation_perplexity(trained, tmp_path: Path):
    result = run_evaluate(tmp_path, "--model", str(trained.model_dir), "--validation-of", str(trained.run_dir))
    # eval_batches=3 micro-batches of 8 blocks of 32 + 1 tokens, scored whole, on one worker.
    assert (result["blocks"], result["block_size"], result["scored_tokens"]) == (24, 32, 24 * 32)
    assert result["loss"] == pytest.approx(trained.metrics["val_loss"], rel=1e-5)
    assert result["perplexity"] == pytest.approx(trained.metrics["val_ppl"], rel=1e-4)
    assert result["perplexity"] < 200  # trained a little: well under the 257 of a uniform guess
    # The byte tokenizer: one byte a token, except end-of-text after the corpus's one document.
    assert result["scored_tokens"] - 1 <= result["scored_bytes"] <= result["scored_tokens"]
    assert result["bits_per_byte"] == pytest.approx(result["nll_nats"] / math.log(2) / result["scored_bytes"])


def test_perplexity_on_held_out_text_is_the_training_codes_evaluate_of_its_blocks(trained, tmp_path: Path):
    # More stories than one read batch (256 documents): the stream is packed whole, its tail dropped once.
    held_out = demo_data.write_jsonl(tmp_path / "held_out.jsonl", num_stories=300, seed=123)
    result = run_evaluate(tmp_path, "--model", str(trained.model_dir), "--data", str(held_out), "--block-size", "48")

    # The blocks training's packing makes of all the stories at once, and training's evaluate() of them.
    stories = [json.loads(line)["text"] for line in held_out.read_text().splitlines()]
    blocks = TokenizeAndPack(str(trained.model_dir), 48)({"text": np.array(stories, object)})["tokens"]
    model = load_pretrained(trained.model_dir, device=torch.device("cpu"))
    step_fn = SimpleNamespace(autocast=contextlib.nullcontext)  # fp32: what TrainStep.autocast() is on CPU
    loss = evaluate(model, step_fn, validation_batches(blocks, 1, 0, 1), torch.device("cpu"))
    assert result["blocks"] == len(blocks) > 10 and result["scored_tokens"] == len(blocks) * 48
    assert result["perplexity"] == pytest.approx(math.exp(loss), rel=1e-4)
    end_of_text = int((blocks[:, 1:] == 256).sum())  # one after each story: they stand for no text
    assert end_of_text > 10
    assert result["scored_bytes"] == result["scored_tokens"] - end_of_text
    assert result["bits_per_byte"] == pytest.approx(
        loss * len(blocks) * 48 / math.log(2) / result["scored_bytes"], rel=1e-4
    )


def test_bad_arguments_exit_2_with_one_line(capsys: pytest.CaptureFixture[str], trained, tmp_path: Path):
    model = str(trained.model_dir)
    cases = [
        (["--model", model], "set exactly one of data.paths"),
        (["--model", model, "--data", str(tmp_path / "missing.txt")], "does not exist"),
        (["--model", model, "--data", str(tmp_path), "--block-size", "999"], "over the engine's context of 256"),
        (["--model", model, "--validation-of", str(tmp_path)], "holds no config.yaml"),
        (["--model", model, "--validation-of", str(trained.run_dir), "--block-size", "16"], "not the run's"),
    ]
    for args, expected in cases:
        assert evaluate_main(args) == 2
        out = capsys.readouterr().out
        errors = [line for line in out.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and expected in errors[0], out
