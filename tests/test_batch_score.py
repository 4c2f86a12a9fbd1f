"""Task score of the batch job (CPU, tiny model, real Ray and Parquet): per-row log-likelihoods against
transformers, error rows, resume, and the job's identity."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import test_batch
from gpt2_platform.batch import load, run_generation
from gpt2_platform.batch.output import STAGING_NAME, SUMMARY_NAME, part_files
from gpt2_platform.config_loader import ConfigError
from gpt2_platform.tokenizer import byte_tokenizer
from test_batch import generate_main, read_output

model_dir = test_batch.model_dir  # the fixture: the tiny model (context 256) with the byte tokenizer
CONTEXT = 256


def hf_token_logprobs(model_dir: Path, ids: list[int]) -> list[float]:
    """transformers' log-probability of each token after the first, given the ones before it (float64)."""
    from transformers import GPT2LMHeadModel

    hf = hf_token_logprobs.models.setdefault(model_dir, GPT2LMHeadModel.from_pretrained(model_dir).eval())
    with torch.no_grad():
        logits = hf(torch.tensor([ids[:-1]])).logits[0].double()  # a block of CONTEXT + 1: inputs ids[:-1]
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


hf_token_logprobs.models = {}


def score_overrides(path: Path, output: Path, model_dir: Path, *extra: str) -> list[str]:
    return [
        "task=score",
        f"input.paths=[{path}]",
        "input.id_column=id",
        f"output.path={output}",
        "output.progress_bars=false",
        f"model.path={model_dir}",
        "engine.dtype=fp32",
        "engine.max_batch_size=8",
        "scaling.num_actors=1",
        "scaling.batch_size=8",
        *extra,
    ]


def score_config(path: Path, output: Path, model_dir: Path, *extra: str):
    return load(None, score_overrides(path, output, model_dir, *extra))


def test_scored_rows_match_transformers_and_bad_rows_become_error_rows(
    ray_cluster, model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    texts = [f"alice has {i} apples and bob gives her {i % 7} more." * (1 + i % 3) for i in range(12)]
    texts += ["ab", "z" * (CONTEXT + 1)]  # the shortest text, and one of context + 1 tokens (scored whole)
    bad = [None, "", "x", "y" * (CONTEXT + 2)]
    path = tmp_path / "texts.parquet"
    pq.write_table(pa.table({"id": list(range(len(texts) + len(bad))), "body": texts + bad}), path)
    args = [
        f"--set={option}" for option in score_overrides(path, tmp_path / "out", model_dir, "input.prompt_column=body")
    ]
    assert generate_main(args) == 0  # through the job's command line
    out = capsys.readouterr().out
    assert "18 rows (18 this run, 4 errors)" in out and "perplexity over all scored rows" in out, out
    summary = json.loads((tmp_path / "out" / SUMMARY_NAME).read_text())
    rows = read_output(tmp_path / "out")
    assert summary["task"] == "score" and summary["rows"] == len(texts) + len(bad)
    assert summary["errors_by_kind"] == {"null_text": 1, "empty_text": 1, "text_too_short": 1, "text_too_long": 1}
    assert "over the 257 a scored row may hold" in rows[str(len(texts) + 3)]["error"]
    tokenizer = byte_tokenizer()
    total, count = 0.0, 0
    for i, text in enumerate(texts):
        row = rows[str(i)]
        ids = tokenizer.encode(text)
        want = hf_token_logprobs(model_dir, ids)
        assert row["error"] is None and row["text"] == text
        assert (row["scored_tokens"], row["prompt_tokens"]) == (len(ids) - 1, len(ids))
        assert row["log_likelihood"] == pytest.approx(math.fsum(want), abs=1e-4 * len(want) ** 0.5)
        assert row["perplexity"] == pytest.approx(math.exp(-row["log_likelihood"] / len(want)), rel=1e-12)
        total, count = total + row["log_likelihood"], count + len(want)
    for i in range(len(texts), len(texts) + len(bad)):
        row = rows[str(i)]
        assert row["error"] and row["log_likelihood"] is None and row["perplexity"] is None
        assert row["scored_tokens"] == 0
    assert summary["scored_tokens"] == count
    assert summary["perplexity"] == pytest.approx(math.exp(-total / count), rel=1e-9)


def test_a_continuation_is_scored_given_its_context_and_a_cut_run_resumes(ray_cluster, model_dir: Path, tmp_path: Path):
    # Row 10 is context + 1 tokens in all (scored whole), row 11 one more.
    contexts = [f"carol has {i} pears." for i in range(10)] + ["q" * 200, "q" * 200, None, "ctx", "ctx"]
    continuations = [f" she eats {i % 4}." for i in range(10)] + ["r" * 57, "r" * 58, "x", None, ""]
    path = tmp_path / "pairs.parquet"
    table = pa.table({"id": [f"r{i}" for i in range(len(contexts))], "context": contexts, "ending": continuations})
    pq.write_table(table, path)
    extra = ("input.prompt_column=context", "input.continuation_column=ending")
    output = tmp_path / "out"
    first = run_generation(score_config(path, output, model_dir, *extra))
    expected = read_output(output)
    assert not (output / STAGING_NAME).exists()  # a finished output holds only its own files
    assert first["errors_by_kind"] == {
        "text_too_long": 1,
        "null_text": 1,
        "null_continuation": 1,
        "empty_continuation": 1,
    }
    tokenizer = byte_tokenizer()
    for i in range(11):
        row = expected[f"r{i}"]
        context, ending = tokenizer.encode(contexts[i]), tokenizer.encode(continuations[i])
        want = hf_token_logprobs(model_dir, context + ending)[-len(ending) :]  # the continuation's tokens only
        assert (row["scored_tokens"], row["prompt_tokens"]) == (len(ending), len(context) + len(ending))
        assert row["log_likelihood"] == pytest.approx(math.fsum(want), abs=1e-4 * len(want) ** 0.5)
        assert (row["text"], row["continuation"]) == (contexts[i], continuations[i])

    # A run cut short: one batch's file still staged (never committed), another lost with the actor.
    files = part_files(output)
    assert len(files) == 2  # 15 rows in batches of 8
    staged = output / STAGING_NAME / "interrupted"
    staged.mkdir(parents=True)
    shutil.move(files[0], staged / "batch.parquet")
    lost = set(pq.read_table(files[1], columns=["id"]).column("id").to_pylist())
    os.remove(files[1])
    # Settings scoring does not read (the sampling seed) leave it the same job.
    resumed = run_generation(score_config(path, output, model_dir, *extra, "generation.seed=5"))
    assert resumed["rows_this_run"] == len(lost) and resumed["rows"] == len(contexts)
    rows = read_output(output)
    assert rows.keys() == expected.keys()
    for row_id, row in rows.items():
        assert (row["log_likelihood"], row["error"]) == (expected[row_id]["log_likelihood"], expected[row_id]["error"])
    assert len({rows[i]["run_id"] for i in lost}) == 1 and resumed["perplexity"] == first["perplexity"]
    assert not (output / STAGING_NAME).exists()

    # Generation into a scoring output, or scoring without the continuation, is another job: refused.
    with pytest.raises(ValueError, match=r"its rows are of task score \(log-likelihoods\), this run is task generate"):
        run_generation(score_config(path, output, model_dir, *extra, "task=generate", "input.continuation_column=null"))
    with pytest.raises(ValueError, match="different job.*continuation_column"):
        run_generation(score_config(path, output, model_dir, "input.prompt_column=context"))


def test_meaningless_score_settings_are_refused_naming_the_field(model_dir: Path, tmp_path: Path):
    path, output = tmp_path / "x.parquet", tmp_path / "out"
    with pytest.raises(ConfigError, match="input.continuation_column is for task: score"):
        score_config(path, output, model_dir, "task=generate", "input.continuation_column=ending")
    with pytest.raises(ConfigError, match="input.temperature_column set with task: score"):
        score_config(path, output, model_dir, "input.temperature_column=t")
    with pytest.raises(ConfigError, match="generation.logprobs is for task: generate"):
        score_config(path, output, model_dir, "generation.logprobs=true")
    with pytest.raises(ConfigError, match="moderation is for task: generate"):
        score_config(path, output, model_dir, "moderation.enabled=true", "moderation.blocklist=[x]")
    with pytest.raises(ConfigError, match="task"):
        score_config(path, output, model_dir, "task=rank")
    pq.write_table(pa.table({"id": [1], "prompt": ["a"], "ending": [3]}), path)
    with pytest.raises(ValueError, match=r"column 'ending' \(input.continuation_column\) is int64, not text"):
        run_generation(score_config(path, output, model_dir, "input.continuation_column=ending"))
