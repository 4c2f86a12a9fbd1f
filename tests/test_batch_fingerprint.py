"""Model fingerprints for batch resumes (gpt2_platform.batch.fingerprint): which files count, and a cached
hash that a rewrite of the same size with its old mtime put back does not fool."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from gpt2_platform.batch import fingerprint


@pytest.fixture(autouse=True)
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "gpt2-platform" / fingerprint.CACHE_NAME


def hashed_files(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("hashed ")]


def test_an_unchanged_file_is_not_hashed_again_but_a_rewrite_with_its_old_mtime_is(
    tmp_path: Path, own_cache: Path, caplog: pytest.LogCaptureFixture
):
    caplog.set_level(logging.INFO, logger=fingerprint.__name__)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\x00" * 4096)
    first = fingerprint.file_hashes([weights], tmp_path)
    assert hashed_files(caplog) and own_cache.is_file()
    caplog.clear()
    assert fingerprint.file_hashes([weights], tmp_path) == first
    assert not hashed_files(caplog), "an unchanged file was hashed again"

    # Retrained weights of the same shape: same size, and the old mtime restored (as `cp -p` or `rsync -a` do).
    before = weights.stat()
    with open(weights, "r+b") as handle:
        handle.seek(2048)
        handle.write(b"\x01")
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (weights.stat().st_size, weights.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    again = fingerprint.file_hashes([weights], tmp_path)
    assert hashed_files(caplog) and again["model.safetensors"] != first["model.safetensors"]


def test_a_damaged_cache_is_ignored(tmp_path: Path, own_cache: Path):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"weights")
    expected = fingerprint.file_hashes([weights], tmp_path)
    own_cache.write_text("{not json")
    assert fingerprint.file_hashes([weights], tmp_path) == expected


def test_the_fingerprint_covers_config_whole_or_sharded_weights_and_tokenizer_files(tmp_path: Path):
    for name in (
        "config.json",
        "model.safetensors.index.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "tokenizer.json",
        "vocab.json",
        "merges.txt",
        "README.md",
        "generation_config.json",
    ):
        (tmp_path / name).write_text(name)
    with_tokenizer = [p.name for p in fingerprint.model_files(tmp_path, with_tokenizer=True)]
    assert with_tokenizer == [
        "config.json",
        "merges.txt",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
        "vocab.json",
    ]
    without = [p.name for p in fingerprint.model_files(tmp_path, with_tokenizer=False)]
    assert without == [n for n in with_tokenizer if n not in ("merges.txt", "tokenizer.json", "vocab.json")]
    hashes = fingerprint.file_hashes(fingerprint.model_files(tmp_path, with_tokenizer=True), tmp_path)
    assert fingerprint.combined(hashes) != fingerprint.combined({**hashes, "vocab.json": "0" * 64})


def test_an_actor_refuses_a_model_that_changed_since_the_job_started(tmp_path: Path):
    """What an actor that Ray restarts mid-job checks before it loads the model from the same path."""
    from gpt2_platform.batch.config import GenerationConfig, InputConfig
    from gpt2_platform.batch.worker import WorkerSpec, check_model
    from gpt2_platform.engine.config import EngineConfig

    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (tmp_path / name).write_text(name)
    started_with = fingerprint.identity_sha256(fingerprint.model_identity(tmp_path, None))
    spec = WorkerSpec(
        model=str(tmp_path),
        model_sha256=started_with,
        tokenizer=None,
        engine=EngineConfig(),
        device="cpu",
        input=InputConfig(paths=["p.parquet"]),
        generation=GenerationConfig(),
        run_id="run",
        staging_dir=str(tmp_path / "staging"),
    )
    check_model(spec)
    (tmp_path / "model.safetensors").write_text("retrained")
    with pytest.raises(ValueError, match=f"the model at {tmp_path} is not the one this job started with"):
        check_model(spec)
