"""Moderation in batch generation on Ray Data: blocked rows are marked and counted, the others are untouched,
and resuming still gives one row per id (under the same moderation only).

The test policy (helpers_moderation) blocks completions over 8 characters and raises on 'explode'; the
tiny model writes at most one character per token and at least one per four (UTF-8), so max_tokens decides
which completions it blocks.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray.cloudpickle

import helpers_moderation
import test_batch
from gpt2_platform.batch import load, run_generation
from test_batch import read_output

model_dir = test_batch.model_dir  # the fixture: the tiny model with the byte tokenizer

ROWS = {  # id: (prompt, max_tokens)
    "allowed": ("alice has 3 apples.", 2),
    "allowed-boundary": ("zapping the unforbidden phrase", 2),  # no term as a whole word
    "blocked-term": ("a Forbidden  phrase here", 2),
    "blocked-failing-policy": ("please explode", 2),
    "blocked-completion": ("tell a long story", 40),
    "blocked-completion-2": ("another long one", 60),
}


@pytest.fixture(scope="module")
def prompts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    table = pa.table(
        {
            "id": list(ROWS),
            "prompt": [prompt for prompt, _ in ROWS.values()],
            "max_tokens": [max_tokens for _, max_tokens in ROWS.values()],
        }
    )
    path = tmp_path_factory.mktemp("moderation-input") / "prompts.parquet"
    pq.write_table(table, path)
    return path


def overrides(prompts: Path, output: Path, model_dir: Path, *extra: str) -> list[str]:
    return [
        f"input.paths=[{prompts}]",
        "input.id_column=id",
        "input.max_tokens_column=max_tokens",
        f"output.path={output}",
        "output.progress_bars=false",
        f"model.path={model_dir}",
        "generation.ignore_eos=true",
        "engine.dtype=fp32",
        "scaling.num_actors=1",
        "moderation.enabled=true",
        "moderation.blocklist=[forbidden phrase, zap]",
        "moderation.callable=helpers_moderation:policy",
        *extra,
    ]


@pytest.fixture(scope="module")
def moderated(ray_cluster, prompts: Path, model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """One run with moderation: (summary, rows by id)."""
    # The actors get the policy by value: they cannot import the tests folder (a real job ships its
    # moderation module in the job's working_dir or an installed package).
    ray.cloudpickle.register_pickle_by_value(helpers_moderation)
    output = tmp_path_factory.mktemp("moderated") / "out"
    summary = run_generation(load(None, overrides(prompts, output, model_dir)))
    return summary, read_output(output)


def test_blocked_rows_are_marked_and_counted_in_the_summary(moderated):
    summary, rows = moderated
    assert summary["rows"] == len(ROWS) and summary["moderation_blocked"] == 4 and summary["errors"] == 4
    assert summary["errors_by_kind"] == {"blocked_prompt": 2, "blocked_completion": 2}
    for row_id in ("allowed", "allowed-boundary"):
        row = rows[row_id]
        assert row["error"] is None and row["finish_reason"] == "length" and row["completion_tokens"] == 2
        assert row["completion"]
    for row_id in ("blocked-term", "blocked-failing-policy"):  # never generated
        row = rows[row_id]
        assert row["error"].startswith("blocked_prompt: blocked by moderation: ")
        assert (row["completion"], row["completion_tokens"], row["finish_reason"]) == (None, 0, "content_filter")
    assert "blocklist term 'forbidden phrase'" in rows["blocked-term"]["error"]
    assert rows["blocked-failing-policy"]["error"].endswith("moderation error")  # the policy raised: fail closed
    for row_id in ("blocked-completion", "blocked-completion-2"):  # generated, then withheld
        row = rows[row_id]
        assert row["error"] == "blocked_completion: blocked by moderation: completion over 8 characters"
        assert (row["completion"], row["finish_reason"]) == (None, "content_filter")
        assert row["completion_tokens"] == ROWS[row_id][1]


def test_moderation_changes_no_allowed_completion_and_resumes_only_under_the_same_settings(
    moderated, prompts: Path, model_dir: Path, tmp_path: Path
):
    summary, rows = moderated
    plain_output = tmp_path / "plain"
    plain = run_generation(load(None, [*overrides(prompts, plain_output, model_dir), "moderation.enabled=false"]))
    assert plain["errors"] == 0 and plain["moderation_blocked"] == 0
    unmoderated = read_output(plain_output)
    for row_id in ("allowed", "allowed-boundary"):
        assert rows[row_id]["completion"] == unmoderated[row_id]["completion"]
    assert all(unmoderated[row_id]["completion_tokens"] == max_tokens for row_id, (_, max_tokens) in ROWS.items())

    output = Path(summary["output"])
    again = run_generation(load(None, overrides(prompts, output, model_dir)))
    assert again["rows_this_run"] == 0 and again["moderation_blocked"] == 4
    with pytest.raises(ValueError, match="different job.*moderation"):
        run_generation(load(None, overrides(prompts, output, model_dir, "moderation.blocklist=[zap]")))


def test_a_callable_that_cannot_be_imported_stops_the_job_before_it_starts(prompts, model_dir, tmp_path: Path):
    output = tmp_path / "out"
    with pytest.raises(ValueError, match="moderation.callable 'no_such_module_xyz:check': cannot import"):
        run_generation(
            load(None, overrides(prompts, output, model_dir, "moderation.callable=no_such_module_xyz:check"))
        )
    assert not output.exists()
