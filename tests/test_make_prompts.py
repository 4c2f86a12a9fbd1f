"""jobs/make_prompts.py (gpt2_platform.batch.make_prompts): text and JSONL files become the Parquet file the batch
job reads, checked by the job's own input reader with the settings of the command it prints; bad input stops it
with one line naming file:line, and nothing is written."""

from __future__ import annotations

import importlib.util
import json
import shlex
from collections.abc import Callable
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from conftest import REPO_ROOT
from gpt2_platform.batch import load
from gpt2_platform.batch.inputs import check_input, find_input_files
from gpt2_platform.batch.rows import resolve_values


def _load_main() -> Callable[[list[str]], int]:
    spec = importlib.util.spec_from_file_location("jobs_make_prompts", REPO_ROOT / "jobs" / "make_prompts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


make_prompts_main = _load_main()


def run(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, list[str]]:
    code = make_prompts_main([str(a) for a in argv])
    return code, capsys.readouterr().out.splitlines()


def read_back(line: str, tmp_path: Path):
    """The printed command's config, input and --set settings, through the batch job's own input checks."""
    assert line.startswith("wrote ") and "; next: python jobs/generate.py " in line, line
    words = shlex.split(line.split("; next: ", 1)[1])
    recipe, source = words[words.index("--config") + 1], words[words.index("--input") + 1]
    settings = words[words.index("--set") + 1 :]
    config = load(REPO_ROOT / recipe, [f"input.paths=[{source}]", f"output.path={tmp_path / 'out'}", *settings])
    files = find_input_files(config.input.paths)
    check_input(files, config)
    return config, pq.read_table(files[0].path, columns=config.input.columns()).to_pylist()


def test_text_lines_become_prompts_with_line_ids_that_the_job_reads(capsys, tmp_path: Path):
    source = tmp_path / "prompts.txt"
    source.write_text("alice has 3 apples.\r\n  bob gives\nnow alice has \n\n")  # CRLF, spaces kept, blank tail
    code, out = run(capsys, "--split", "lines", source, tmp_path / "p" / "prompts.parquet")
    assert code == 0 and len(out) == 1 and out[0].startswith("wrote 3 rows to ")
    config, rows = read_back(out[0], tmp_path)
    assert config.task == "generate" and config.input.id_column == "id"
    assert rows == [
        {"prompt": "alice has 3 apples.", "id": "prompts.txt:1"},
        {"prompt": "  bob gives", "id": "prompts.txt:2"},
        {"prompt": "now alice has ", "id": "prompts.txt:3"},
    ]
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == ["prompts.parquet"]  # no temporary left
    # The README's command as it stands, without the printed settings, reads it too (ids '<file name>:<row>').
    as_is = load(REPO_ROOT / "jobs/configs/generate-tiny.yaml", [f"input.paths=[{tmp_path / 'p'}]"])
    check_input(find_input_files(as_is.input.paths), as_is)


def test_paragraphs_for_scoring_keep_their_lines_and_are_named_by_their_first(capsys, tmp_path: Path):
    source = tmp_path / "stories.txt"
    source.write_text("\nalice has 3 apples.\nbob gives her 2.\n\n\n\nnow she has 5.\n")
    code, out = run(capsys, source, tmp_path / "texts.parquet", "--split", "paragraphs", "--task", "score")
    assert code == 0, out
    config, rows = read_back(out[0], tmp_path)
    assert config.task == "score" and out[0].count("score-tiny.yaml") == 1
    assert rows == [
        {"text": "alice has 3 apples.\nbob gives her 2.", "id": "stories.txt:2"},
        {"text": "now she has 5.", "id": "stories.txt:7"},
    ]


def test_jsonl_fields_the_job_reads_per_row_are_carried_over(capsys, tmp_path: Path):
    source = tmp_path / "prompts.jsonl"
    records = [
        {"id": 7, "question": "alice has", "max_tokens": 5, "temperature": 0, "lang": "en"},
        {"id": "b-2", "question": "bob has", "seed": 2**63 - 1},
        {"id": "c", "question": "carol has", "temperature": 1.5},
    ]
    source.write_text("\n".join(json.dumps(r) for r in records[:2]) + "\n\n" + json.dumps(records[2]) + "\n")
    code, out = run(capsys, source, tmp_path / "prompts.parquet", "--field", "question")
    assert code == 0, out
    config, rows = read_back(out[0], tmp_path)
    assert [r["id"] for r in rows] == ["7", "b-2", "c"]
    assert [r["prompt"] for r in rows] == ["alice has", "bob has", "carol has"]
    assert [(r["max_tokens"], r["temperature"], r["seed"]) for r in rows] == [
        (5, 0.0, None),
        (None, None, 2**63 - 1),
        (None, 1.5, None),
    ]
    for row in rows:  # what each row's values become in the job: none is an error row
        _, error = resolve_values(row["id"], row["max_tokens"], row["temperature"], row["seed"], config.generation)
        assert error is None


def test_jsonl_for_scoring_carries_the_continuation_and_derives_ids(capsys, tmp_path: Path):
    source = tmp_path / "pairs.jsonl"
    source.write_text(
        '{"text": "alice has 3 apples.", "continuation": " bob has none."}\n{"text": "x", "continuation": " y"}\n'
    )
    code, out = run(capsys, source, tmp_path / "pairs.parquet", "--task", "score")
    assert code == 0, out
    config, rows = read_back(out[0], tmp_path)
    assert config.input.continuation_column == "continuation"
    assert rows[0] == {"text": "alice has 3 apples.", "id": "pairs.jsonl:1", "continuation": " bob has none."}


@pytest.mark.parametrize(
    ("name", "content", "flags", "expected"),
    [
        ("bad.jsonl", '{"prompt": "a"}\n{"prompt": "b",}\n', [], "bad.jsonl:2 is not valid JSON"),
        ("list.jsonl", '{"prompt": "a"}\n["b"]\n', [], "list.jsonl:2 is an array, not an object"),
        ("field.jsonl", '{"prompt": "a"}\n{"text": "b"}\n', [], "field.jsonl:2 has no field 'prompt'"),
        (
            "dup.jsonl",
            '{"id": 1, "prompt": "a"}\n{"id": 2, "prompt": "b"}\n{"id": "1", "prompt": "c"}\n',
            [],
            "dup.jsonl:3: id '1' is already line 1's",
        ),
        ("some.jsonl", '{"id": 1, "prompt": "a"}\n{"prompt": "b"}\n', [], "some.jsonl:2 has no id"),
        ("range.jsonl", '{"prompt": "a", "temperature": 3}\n', [], "range.jsonl:1: temperature must be in [0, 2]"),
        ("blank.jsonl", '{"prompt": "a"}\n{"prompt": " "}\n', [], "blank.jsonl:2: field 'prompt' is empty"),
        ("empty.txt", "", [], "empty.txt holds no prompts"),
        ("gap.txt", "a\n\nb\n", [], "gap.txt:2 is blank"),
        ("latin.txt", "caf\xe9\n", [], "latin.txt:1 is not UTF-8"),
        ("flags.jsonl", '{"prompt": "a"}\n', ["--split", "paragraphs"], "--split is for text input"),
    ],
)
def test_bad_input_stops_with_one_line_and_writes_nothing(capsys, tmp_path: Path, name, content, flags, expected):
    source = tmp_path / "in" / name
    source.parent.mkdir()
    source.write_bytes(content.encode("latin-1" if name == "latin.txt" else "utf-8"))
    output = tmp_path / "out" / "prompts.parquet"
    code, out = run(capsys, source, output, *flags)
    assert code == 2 and len(out) == 1 and out[0].startswith("error: ") and expected in out[0], out
    assert not output.parent.exists()


def test_an_existing_output_is_kept_unless_overwrite(capsys, tmp_path: Path):
    source, output = tmp_path / "prompts.txt", tmp_path / "prompts.parquet"
    source.write_text("a\n")
    assert run(capsys, source, output)[0] == 0
    source.write_text("a\nb\n")
    code, out = run(capsys, source, output)
    assert code == 2 and "exists; pass --overwrite" in out[0] and pq.read_metadata(output).num_rows == 1
    assert run(capsys, source, output, "--overwrite")[0] == 0 and pq.read_metadata(output).num_rows == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prompts.parquet", "prompts.txt"]
