"""Batch generation on Ray Data (CPU, tiny model): error rows, determinism, kill-and-resume, user errors."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from conftest import REPO_ROOT
from gpt2_platform import checkpoint
from gpt2_platform.batch import load, run_generation
from gpt2_platform.batch.output import MANIFEST_NAME, STAGING_NAME, SUMMARY_NAME, part_files
from gpt2_platform.batch.rows import OUTPUT_COLUMNS, derive_seed
from gpt2_platform.model import GPT2, preset
from gpt2_platform.tokenizer import byte_tokenizer

NUM_GOOD_ROWS = 2000
MAX_TOKENS = 6


def _load_main() -> Callable[[list[str]], int]:
    spec = importlib.util.spec_from_file_location("jobs_generate", REPO_ROOT / "jobs" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


generate_main = _load_main()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    model = GPT2(preset("tiny"))
    directory = tmp_path_factory.mktemp("batch") / "model"
    checkpoint.save_pretrained(model, directory, extra=lambda d: byte_tokenizer().save_pretrained(d))
    return directory


@pytest.fixture(scope="module")
def prompts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2000 good rows, then one of each kind of bad row; per-row columns mostly null (the defaults)."""
    good = [f"alice has {i} apples. bob gives her {i % 7}." for i in range(NUM_GOOD_ROWS)]
    bad = [None, "", "x" * 400, "bad temperature", "bad max_tokens", "bad seed"]
    n = len(good) + len(bad)
    max_tokens = [None] * n
    temperature = [None] * n
    seed = [None] * n
    max_tokens[3] = 3  # a good row with its own max_tokens, temperature and seed
    temperature[3] = 0.0
    seed[3] = 12345
    temperature[NUM_GOOD_ROWS + 3] = -1.0
    max_tokens[NUM_GOOD_ROWS + 4] = 0
    seed[NUM_GOOD_ROWS + 5] = -5
    table = pa.table(
        {
            "prompt": pa.array(good + bad, pa.string()),
            "max_tokens": pa.array(max_tokens, pa.int64()),
            "temperature": pa.array(temperature, pa.float64()),
            "seed": pa.array(seed, pa.int64()),
        }
    )
    path = tmp_path_factory.mktemp("input") / "prompts.parquet"
    pq.write_table(table, path, row_group_size=500)
    return path


def overrides(prompts: Path, output: Path, model_dir: Path, *extra: str) -> list[str]:
    return [
        f"input.paths=[{prompts}]",
        "input.max_tokens_column=max_tokens",
        "input.temperature_column=temperature",
        "input.seed_column=seed",
        f"output.path={output}",
        "output.progress_bars=false",
        f"model.path={model_dir}",
        f"generation.max_tokens={MAX_TOKENS}",
        "generation.seed=7",
        "engine.max_batch_size=64",
        "engine.dtype=fp32",
        "scaling.num_actors=1",
        "scaling.batch_size=256",
        *extra,
    ]


def read_output(directory: Path) -> dict[str, dict]:
    table = pq.read_table([str(p) for p in part_files(directory)])
    rows = table.to_pylist()
    by_id = {row["id"]: row for row in rows}
    assert len(by_id) == len(rows), "an id appears twice in the output"
    return by_id


@pytest.fixture(scope="module")
def reference(ray_cluster, prompts: Path, model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """One complete run over all rows: (summary, rows by id)."""
    output = tmp_path_factory.mktemp("reference") / "out"
    # One batch at a time per actor: the plainest schedule, which the other runs must match.
    # With a profiler window of the engine actor, from its start: test_an_actor_asked_for_a_trace_writes_one.
    trace = [
        f"profile.trace_dir={tmp_path_factory.getbasetemp() / 'reference-trace'}",
        "profile.after_s=0",
        "profile.seconds=0.2",
    ]
    summary = run_generation(
        load(None, overrides(prompts, output, model_dir, "scaling.concurrent_batches_per_actor=1", *trace))
    )
    return summary, read_output(output)


def test_an_actor_asked_for_a_trace_writes_one(reference, tmp_path_factory: pytest.TempPathFactory):
    from gpt2_platform import traces

    directory = tmp_path_factory.getbasetemp() / "reference-trace"
    (path,) = traces.trace_files(directory)  # one actor, one whole file (no partial one under the name)
    assert path.name.startswith("engine-") and not list(directory.glob("*.partial"))
    # The engine's thread, not only the one that recorded: its model's operators are in the window.
    assert any(op.name.startswith("aten::") for op in traces.self_times(traces.load(path)))


def test_thousands_of_rows_end_to_end_with_error_rows_counted(reference, prompts: Path):
    summary, rows = reference
    num_rows = NUM_GOOD_ROWS + 6
    assert set(rows) == {f"prompts.parquet:{i}" for i in range(num_rows)}
    assert summary["rows"] == summary["rows_this_run"] == summary["unique_ids"] == num_rows
    assert summary["errors_by_kind"] == {
        "null_prompt": 1,
        "empty_prompt": 1,
        "prompt_too_long": 1,
        "bad_temperature": 1,
        "bad_max_tokens": 1,
        "bad_seed": 1,
    }
    assert summary["errors"] == 6
    good = [rows[f"prompts.parquet:{i}"] for i in range(NUM_GOOD_ROWS)]
    assert all(
        r["error"] is None and r["completion"] is not None and r["finish_reason"] in ("stop", "length") for r in good
    )
    assert summary["completion_tokens"] == sum(r["completion_tokens"] for r in good) > 0
    assert summary["prompt_tokens"] == sum(r["prompt_tokens"] for r in good)
    assert summary["completion_tokens_per_s"] > 0 and summary["wall_s"] > 0
    # Provenance: the settings each row used; seeds derived from the global seed and the id.
    first = good[0]
    assert first["seed"] == derive_seed(7, "prompts.parquet:0")
    assert (first["max_tokens"], first["temperature"]) == (MAX_TOKENS, 1.0)
    assert first["model"].endswith("model") and first["run_id"] == summary["run_id"]
    assert {row["model_sha256"] for row in rows.values()} == {summary["model_sha256"]}
    own = good[3]
    assert (own["seed"], own["max_tokens"], own["temperature"]) == (12345, 3, 0.0)
    assert own["completion_tokens"] <= 3
    for i in range(NUM_GOOD_ROWS, num_rows):
        bad = rows[f"prompts.parquet:{i}"]
        assert bad["error"] and bad["completion"] is None and bad["finish_reason"] == "error"
    assert "context of 256 tokens" in rows[f"prompts.parquet:{NUM_GOOD_ROWS + 2}"]["error"]
    on_disk = json.loads((Path(summary["output"]) / SUMMARY_NAME).read_text())
    assert on_disk["rows"] == num_rows and on_disk["errors"] == 6
    assert list(pq.read_schema(part_files(Path(summary["output"]))[0]).names) == list(OUTPUT_COLUMNS)


def test_same_completions_whatever_the_batch_size_number_of_actors_and_batches_in_flight(
    reference, prompts: Path, model_dir: Path, tmp_path: Path
):
    _, expected = reference
    subset = pq.read_table(prompts).slice(0, 300)
    small = tmp_path / "prompts.parquet"  # same name: the derived ids match the reference's
    pq.write_table(subset, small)
    output = tmp_path / "out"
    summary = run_generation(
        load(
            None,
            overrides(
                small,
                output,
                model_dir,
                "scaling.num_actors=2",
                "scaling.batch_size=37",
                "scaling.concurrent_batches_per_actor=3",
                "engine.max_batch_size=5",
            ),
        )
    )
    assert summary["num_actors"] == 2 and summary["rows"] == 300
    rows = read_output(output)
    for row_id, row in rows.items():
        assert row["completion"] == expected[row_id]["completion"], row_id
        assert row["seed"] == expected[row_id]["seed"]


def test_long_prompts_are_truncated_from_the_left_when_asked(
    prompts: Path, model_dir: Path, tmp_path: Path, ray_cluster
):
    rows_in = pa.table({"id": [10, 11], "prompt": ["y" * 400, "short"]})
    path = tmp_path / "long.parquet"
    pq.write_table(rows_in, path)
    config = load(
        None,
        [
            f"input.paths=[{path}]",
            "input.id_column=id",
            f"output.path={tmp_path / 'out'}",
            "output.progress_bars=false",
            f"model.path={model_dir}",
            "generation.max_tokens=4",
            "generation.long_prompts=truncate",
            "scaling.num_actors=1",
        ],
    )
    summary = run_generation(config)
    rows = read_output(tmp_path / "out")
    assert summary["errors"] == 0
    assert rows["10"]["truncated_tokens"] == 400 - (256 - 4) and rows["10"]["prompt_tokens"] == 252
    assert rows["10"]["completion"] is not None and rows["11"]["truncated_tokens"] == 0


def test_killed_run_resumes_with_exactly_one_row_per_id(reference, prompts: Path, model_dir: Path, tmp_path: Path):
    import ray

    _, expected = reference
    output = tmp_path / "out"
    args = [sys.executable, str(REPO_ROOT / "jobs" / "generate.py")]
    for override in overrides(prompts, output, model_dir, "scaling.batch_size=64"):
        args += ["--set", override]
    env = dict(os.environ, RAY_ADDRESS=ray.get_runtime_context().gcs_address)
    process = subprocess.Popen(
        args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    staging = output / STAGING_NAME
    deadline = time.monotonic() + 120
    try:
        while len(list(staging.glob("*/*.parquet"))) < 3:
            assert process.poll() is None, "the job ended before it could be killed"
            assert time.monotonic() < deadline, "the job wrote no output in time"
            time.sleep(0.05)
    finally:
        os.killpg(process.pid, signal.SIGKILL)  # the driver and anything it started, as a kill -9 would
        process.wait()
    # Let Ray notice the dead driver and stop its actors: until then they hold the cluster's CPUs.
    deadline = time.monotonic() + 10
    while ray.available_resources().get("CPU", 0) < ray.cluster_resources()["CPU"] and time.monotonic() < deadline:
        time.sleep(0.1)
    (run_dir,) = staging.iterdir()
    staged = sorted(run_dir.glob("*.parquet"))
    assert not part_files(output), "nothing is committed before a run ends"
    # A file cut off mid-write, as a copy or a full disk can leave one (the actors' own writes are renamed
    # into place when complete; a kill leaves only a temporary name, which is dropped too).
    data = staged[0].read_bytes()
    (run_dir / "cut-short.parquet").write_bytes(data[: len(data) // 2])
    (run_dir / f".{staged[0].name}.tmp").write_bytes(data[: len(data) // 3])

    summary = run_generation(load(None, overrides(prompts, output, model_dir, "scaling.batch_size=64")))
    rows = read_output(output)
    assert set(rows) == set(expected)
    assert summary["rows"] == len(expected) and summary["unique_ids"] == len(expected)
    assert 0 < summary["rows_this_run"] < len(expected), "the rerun should only generate what was missing"
    assert len({row["run_id"] for row in rows.values()}) == 2
    for row_id, row in rows.items():
        assert (row["completion"], row["error"]) == (expected[row_id]["completion"], expected[row_id]["error"])
    assert not [path for path in staging.rglob("*") if path.is_file()], "staged files were left behind"

    again = run_generation(load(None, overrides(prompts, output, model_dir, "scaling.batch_size=64")))
    assert again["rows_this_run"] == 0 and again["rows"] == len(expected)


def test_a_submitted_job_waits_for_cpus_being_freed_and_puts_a_relative_output_under_home(
    ray_cluster, model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    """As a resumed job meets the actors of the one it replaces, still holding the cluster's CPUs: it waits for
    them (or stops, saying what is missing) instead of Ray Data's "the Dataset job will hang" warning."""
    import threading

    import ray
    from ray.util.debug import reset_log_once

    prompts = tmp_path / "few.parquet"
    pq.write_table(pa.table({"prompt": ["alice has 1", "bob has 2", "carol has 3"]}), prompts)
    relative = Path("submitted-out") / tmp_path.name
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}")  # what the job supervisor gives a submitted driver
    ray_warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: ray_warnings.append(record.getMessage())
    logging.getLogger("ray.data").addHandler(handler)
    reset_log_once("cpu_warning")  # Ray Data says it once per process

    @ray.remote(num_cpus=ray.cluster_resources()["CPU"])
    class Holder:
        def ready(self) -> bool:
            return True

    holder = Holder.remote()
    ray.get(holder.ready.remote())
    caplog.set_level(logging.INFO, logger="gpt2_platform.batch")

    # The holder goes once the second job has said it waits (not after a fixed time, which had to be long
    # enough for the job to get there on a loaded machine).
    def release_when_waiting(record: logging.LogRecord) -> None:
        if record.getMessage().startswith("waiting up to 60 s"):
            threading.Thread(target=ray.kill, args=(holder,)).start()

    release = logging.Handler(logging.INFO)
    release.emit = release_when_waiting
    try:
        config = [f"input.paths=[{prompts}]", f"output.path={relative}", f"model.path={model_dir}"]
        config += ["output.progress_bars=false", "generation.max_tokens=2", "scaling.num_actors=1"]
        with pytest.raises(ValueError, match=r"does not have the resources this job needs free: 2 CPU \(free: 0\)"):
            run_generation(load(None, [*config, "scaling.wait_for_resources_s=1"]))
        logging.getLogger("gpt2_platform.batch").addHandler(release)
        summary = run_generation(load(None, config))
    finally:
        logging.getLogger("gpt2_platform.batch").removeHandler(release)
        logging.getLogger("ray.data").removeHandler(handler)
        ray.kill(holder)
    expected = Path.home() / "gpt2-platform" / relative
    assert summary["output"] == str(expected) and summary["rows"] == 3 and summary["errors"] == 0
    assert not (tmp_path / relative).exists()
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("waiting up to 60 s for 2 CPU (free: 0)") for m in messages), messages
    assert any(f"relative inside a submitted job; writing to {expected}" in m for m in messages), messages
    assert not [w for w in ray_warnings if "will hang" in w], ray_warnings


# ---- user errors: caught before Ray starts -------------------------------------------------------------


def test_missing_input_and_missing_column_are_clear_errors(prompts: Path, model_dir: Path, tmp_path: Path):
    with pytest.raises(ValueError, match="does not exist"):
        run_generation(load(None, overrides(tmp_path / "nope.parquet", tmp_path / "out", model_dir)))
    with pytest.raises(ValueError, match="has no column 'text'.*input.prompt_column"):
        run_generation(load(None, [*overrides(prompts, tmp_path / "out", model_dir), "input.prompt_column=text"]))
    with pytest.raises(ValueError, match="has no column 'uid'.*input.id_column"):
        run_generation(load(None, [*overrides(prompts, tmp_path / "out", model_dir), "input.id_column=uid"]))
    assert not (tmp_path / "out").exists()


def test_an_output_path_that_holds_something_else_is_refused(prompts: Path, model_dir: Path, tmp_path: Path):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not this job's output.*notes.txt"):
        run_generation(load(None, overrides(prompts, foreign, model_dir)))

    other_parquet = tmp_path / "other"
    other_parquet.mkdir()
    pq.write_table(pa.table({"x": [1]}), other_parquet / "data.parquet")
    with pytest.raises(ValueError, match="not this job's output"):
        run_generation(load(None, overrides(prompts, other_parquet, model_dir)))

    # Our layout, but a part file without our columns.
    ours = tmp_path / "ours"
    ours.mkdir()
    (ours / MANIFEST_NAME).write_text(json.dumps({"identity": {}}))
    with pytest.raises(ValueError, match="different job"):
        run_generation(load(None, overrides(prompts, ours, model_dir)))


def test_resuming_into_the_output_of_another_input_or_seed_is_refused(
    reference, prompts: Path, model_dir: Path, tmp_path: Path
):
    output = Path(reference[0]["output"])
    other = tmp_path / "other.parquet"
    pq.write_table(pq.read_table(prompts).slice(0, 2), other)
    with pytest.raises(ValueError, match="different job.*input_files"):
        run_generation(load(None, overrides(other, output, model_dir)))
    with pytest.raises(ValueError, match="different job.*generation"):
        run_generation(load(None, [*overrides(prompts, output, model_dir), "generation.seed=8"]))


def test_resuming_with_other_weights_or_tokenizer_at_the_same_path_is_refused_and_says_which_file(
    reference, prompts: Path, model_dir: Path, tmp_path: Path
):
    output = tmp_path / "out"
    shutil.copytree(reference[0]["output"], output)
    model = tmp_path / "model"
    shutil.copytree(model_dir, model)
    # The same files at another path are the same model: the copied output resumes, with nothing left to do.
    again = run_generation(load(None, overrides(prompts, output, model)))
    assert again["rows_this_run"] == 0 and again["model_sha256"] == reference[0]["model_sha256"]
    recorded = json.loads((output / MANIFEST_NAME).read_text())["identity"]["model_files"]
    assert sorted(recorded) == ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]

    # Retrained weights of the same shape at the same path: same size, and the old mtime put back.
    weights = model / checkpoint.WEIGHTS_NAME
    before = weights.stat()
    with open(weights, "r+b") as handle:
        handle.seek(before.st_size - 100)  # inside the last tensor, past the safetensors header
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 0xFF]))
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    with pytest.raises(
        ValueError, match=r"different job \(model_files\.model\.safetensors changed: was '[0-9a-f]{64}'"
    ):
        run_generation(load(None, overrides(prompts, output, model)))
    shutil.copy2(model_dir / checkpoint.WEIGHTS_NAME, weights)  # the original weights again: resumes
    assert run_generation(load(None, overrides(prompts, output, model)))["rows_this_run"] == 0

    tokenizer_config = model / "tokenizer_config.json"
    tokenizer_config.write_text(tokenizer_config.read_text().replace("<|endoftext|>", "<|end|>"))
    with pytest.raises(ValueError, match=r"model_files\.tokenizer_config\.json changed"):
        run_generation(load(None, overrides(prompts, output, model)))


def test_cli_exits_2_with_one_error_line(capsys: pytest.CaptureFixture[str], model_dir: Path, tmp_path: Path):
    code = generate_main(
        ["--input", str(tmp_path / "missing.parquet"), "--output", str(tmp_path / "out"), "--model", str(model_dir)]
    )
    out = capsys.readouterr().out
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(errors) == 1 and "does not exist" in errors[0], out
    code = generate_main(["--input", str(tmp_path / "x.parquet"), "--model", str(model_dir)])
    out = capsys.readouterr().out
    assert code == 2 and "output.path is empty" in out, out


PRELOAD_PROBE = """
import json, sys
import ray
from gpt2_platform.batch.worker import ACTOR_IMPORTS
from gpt2_platform.runtime import init_ray

init_ray(num_cpus=1, preload=ACTOR_IMPORTS)

@ray.remote(num_cpus=1)
def imported(names):
    return [name for name in names if name in sys.modules]

print(json.dumps(ray.get(imported.remote([*ACTOR_IMPORTS, "transformers", "gpt2_platform.train.loop"]))))
ray.shutdown()
"""


def test_a_job_that_starts_its_own_ray_has_its_workers_import_the_actors_modules_ahead(tmp_path: Path):
    # The batch job starts Ray with init_ray(preload=ACTOR_IMPORTS): a worker Ray hands a task or an actor
    # has imported them before it, and nothing else of ours (the training loop stays unloaded).
    from gpt2_platform.batch.worker import ACTOR_IMPORTS

    env = {**os.environ, "HOME": str(tmp_path), "PYTHONPATH": str(REPO_ROOT / "platform")}
    env.pop("RAY_ADDRESS", None)
    result = subprocess.run(
        [sys.executable, "-c", PRELOAD_PROBE], env=env, capture_output=True, text=True, timeout=180, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-3000:]
    imported = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(ACTOR_IMPORTS) | {"transformers"} <= set(imported), imported
    assert "gpt2_platform.train.loop" not in imported


CUDA_QUERIES_PROBE = """
import importlib, json
import torch, torch.cuda

asked = []
for name in ("is_available", "device_count", "init", "_lazy_init", "current_device", "get_device_capability"):
    def spy(*args, _name=name, _original=getattr(torch.cuda, name), **kwargs):
        asked.append(_name)
        return _original(*args, **kwargs)
    setattr(torch.cuda, name, spy)
from gpt2_platform.batch.worker import ACTOR_IMPORTS
for module in ACTOR_IMPORTS:
    importlib.import_module(module)
print(json.dumps(asked))
"""


def test_importing_the_preloaded_modules_asks_cuda_nothing():
    # A preloaded worker imports them before Ray sets its CUDA_VISIBLE_DEVICES: a CUDA query at import
    # would fix the devices the process sees, and two actors would share one GPU.
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "platform")}
    result = subprocess.run(
        [sys.executable, "-c", CUDA_QUERIES_PROBE], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []


def test_an_actor_warms_only_the_sampling_modes_its_job_can_use():
    from gpt2_platform.batch.config import GenerationConfig, InputConfig
    from gpt2_platform.batch.worker import sampling_modes

    columns = InputConfig(paths=["p.parquet"])
    assert sampling_modes(GenerationConfig(temperature=0.0), columns) == ("greedy",)
    assert sampling_modes(GenerationConfig(temperature=0.8), columns) == ("greedy", "plain")
    assert sampling_modes(GenerationConfig(temperature=0.8, top_p=0.9), columns) == ("greedy", "filtered")
    # A per-row temperature column can sample even when the default is greedy.
    with_column = InputConfig(paths=["p.parquet"], temperature_column="temperature")
    assert sampling_modes(GenerationConfig(temperature=0.0), with_column) == ("greedy", "plain")


def test_a_logprobs_column_holds_each_generated_tokens_log_probability(ray_cluster, model_dir: Path, tmp_path: Path):
    # Greedy rows and a sampled one, and an error row (null): each list as long as the completion, equal to
    # transformers' log_softmax of the token at its position; a second run resumes into the same columns.
    from transformers import GPT2LMHeadModel

    path = tmp_path / "lp.parquet"
    pq.write_table(pa.table({"id": [1, 2, 3, 4], "prompt": ["alice has", "bob gives", "", "carol"]}), path)
    base = [
        f"input.paths=[{path}]", "input.id_column=id", f"output.path={tmp_path / 'out'}",
        "output.progress_bars=false", f"model.path={model_dir}", "generation.max_tokens=5",
        "generation.ignore_eos=true", "generation.logprobs=true", "engine.dtype=fp32", "scaling.num_actors=1",
    ]  # fmt: skip
    summary = run_generation(load(None, [*base, "generation.temperature=0"]))
    assert summary["errors"] == 1
    table = pq.read_table([str(p) for p in part_files(tmp_path / "out")])
    assert "logprobs" in table.column_names
    rows = {row["id"]: row for row in table.to_pylist()}
    assert rows["3"]["logprobs"] is None and rows["3"]["error"] is not None
    hf = GPT2LMHeadModel.from_pretrained(model_dir).eval()
    tokenizer = byte_tokenizer()
    for row_id in ("1", "2", "4"):
        row = rows[row_id]
        prompt, completion = tokenizer.encode(row["prompt"]), tokenizer.encode(row["completion"])
        assert len(row["logprobs"]) == len(completion) == row["completion_tokens"] == 5
        with torch.no_grad():
            expected = torch.log_softmax(hf(torch.tensor([prompt + completion])).logits[0].double(), dim=-1)
        want = [expected[len(prompt) - 1 + i, t].item() for i, t in enumerate(completion)]
        assert row["logprobs"] == pytest.approx(want, abs=1e-4)
    # The same job again: nothing left to do, and the output keeps its logprobs column.
    again = run_generation(load(None, [*base, "generation.temperature=0"]))
    assert again["rows_this_run"] == 0 and again["rows"] == 4
    # Another logprobs setting is another job: refused, naming the field.
    without = [option for option in base if option != "generation.logprobs=true"]
    with pytest.raises(Exception, match="generation.logprobs"):
        run_generation(load(None, [*without, "generation.temperature=0"]))


def test_a_cluster_that_no_longer_holds_the_job_is_said_once_and_its_return_too(
    ray_cluster, caplog: pytest.LogCaptureFixture
):
    # A lost node leaves the job waiting without an error (Ray restarts its actors and reads where there is
    # room): the watch says so once, not at every look, and says when the cluster holds it again.
    import ray

    from gpt2_platform.batch.generate import capacity_watch

    cpus = ray.cluster_resources()["CPU"]
    needed = {"CPU": cpus + 1, "GPU": 0.0}
    caplog.set_level(logging.INFO, logger="gpt2_platform.batch.generate")
    with capacity_watch(needed, period_s=0.05):
        time.sleep(0.5)  # some ten looks at a cluster one CPU short
        needed["CPU"] = cpus  # as if a node had joined
        time.sleep(0.3)
    lines = [r.getMessage() for r in caplog.records if r.name == "gpt2_platform.batch.generate"]
    short = [line for line in lines if "no longer holds what this job needs" in line]
    assert len(short) == 1, lines
    assert f"{cpus + 1:g} CPU (the cluster has {cpus:g})" in short[0] and "GPU" not in short[0]
    assert "resubmit with the same output" in short[0]
    assert lines[-1] == "the cluster holds what this job needs again; it goes on", lines
    with capacity_watch({"CPU": 1.0, "GPU": 0.0}, period_s=0.05):
        caplog.clear()
        time.sleep(0.2)
    assert not [r for r in caplog.records if r.name == "gpt2_platform.batch.generate"], (
        "a cluster with room says nothing"
    )
