"""What a model directory holds, by content: SHA-256 of each file that decides what a batch row contains.

A batch output records these hashes, so a resume with other weights (or another config or tokenizer)
at the same path is refused instead of mixing two models' rows under one label.

Why a full SHA-256 and not a header hash plus sampled blocks: only a hash of every byte proves two
weight files equal; a fine-tune that touches a few layers (or an edited lm_head) can leave sampled
blocks and the safetensors header unchanged. Hashing is a few seconds per GB on one core, and each
file's hash is cached under the key (device, inode, size, mtime_ns, ctime_ns), so only the first job
on a model pays it. Why ctime is in the key: size and mtime alone can repeat (`cp -p` and `rsync -a`
restore mtime, and a retrained file of the same shape has the same size), but every write to a file,
and a rename onto it (a new inode), gives it a new ctime, which no user call can set back.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from gpt2_platform.adapter import ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME
from gpt2_platform.checkpoint import CONFIG_NAME, WEIGHTS_INDEX_NAME

logger = logging.getLogger(__name__)

TOKENIZER_NAMES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
)
CACHE_NAME = "file-sha256.json"
MAX_CACHE_ENTRIES = 2000
_CHUNK_BYTES = 8 * 2**20


def cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "gpt2-platform" / CACHE_NAME


def model_files(directory: Path, with_tokenizer: bool) -> list[Path]:
    """The files of a model directory that change its completions: config, weights (whole or sharded, every
    safetensors file there, so none the loader may pick is left out) and, if asked, the tokenizer's."""
    names = [CONFIG_NAME, WEIGHTS_INDEX_NAME, *(p.name for p in directory.glob("*.safetensors"))]
    if with_tokenizer:
        names += TOKENIZER_NAMES
    return [directory / name for name in sorted(set(names)) if (directory / name).is_file()]


def adapter_files(directory: Path) -> list[Path]:
    """A peft adapter directory's files that change the merged weights."""
    return [directory / name for name in (ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME) if (directory / name).is_file()]


def tokenizer_files(directory: Path) -> list[Path]:
    return [directory / name for name in TOKENIZER_NAMES if (directory / name).is_file()]


def _stat_key(path: Path) -> str:
    stat = path.stat()  # follows symlinks: a hub snapshot's files link into its blob store
    return f"{stat.st_dev}:{stat.st_ino}:{stat.st_size}:{stat.st_mtime_ns}:{stat.st_ctime_ns}"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK_BYTES):
            digest.update(chunk)  # hashlib releases the GIL on large updates: shards hash in parallel
    return digest.hexdigest()


def _read_cache(path: Path) -> dict[str, dict[str, str]]:
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # none yet, or damaged: hashes are recomputed, nothing else depends on it
    return cache if isinstance(cache, dict) else {}


def _write_cache(path: Path, cache: dict[str, dict[str, str]]) -> None:
    entries = sorted(cache.items(), key=lambda item: item[1].get("used", ""), reverse=True)[:MAX_CACHE_ENTRIES]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # A unique temporary name and one rename: two jobs writing at once lose at most an entry, never the file.
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", delete=False) as handle:
            json.dump(dict(entries), handle)
        os.replace(handle.name, path)
    except OSError as error:
        logger.info("could not save the file hash cache %s (%s); hashes are computed again next time", path, error)


def file_hashes(paths: list[Path], base: Path) -> dict[str, str]:
    """{path relative to `base`: SHA-256 hex} of each file, from the cache where a file is unchanged."""
    cache_file = cache_path()
    cache = _read_cache(cache_file)
    keys = {path: _stat_key(path) for path in paths}
    hashes: dict[Path, str] = {}
    stale: list[Path] = []
    for path in paths:
        entry = cache.get(str(path.resolve()))
        if isinstance(entry, dict) and entry.get("key") == keys[path] and isinstance(entry.get("sha256"), str):
            hashes[path] = entry["sha256"]
        else:
            stale.append(path)
    if stale:
        started = time.perf_counter()
        with ThreadPoolExecutor(max_workers=min(len(stale), os.cpu_count() or 1)) as pool:
            hashes.update(zip(stale, pool.map(_sha256, stale), strict=True))
        size_gb = sum(path.stat().st_size for path in stale) / 1e9
        logger.info("hashed %d model file(s), %.2f GB, in %.1f s", len(stale), size_gb, time.perf_counter() - started)
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    for path in paths:
        cache[str(path.resolve())] = {"key": keys[path], "sha256": hashes[path], "used": now}
    _write_cache(cache_file, cache)
    return {str(path.relative_to(base)): hashes[path] for path in paths}


def combined(hashes: dict[str, str]) -> str:
    """One SHA-256 over a set of file hashes (name and hash of each), for a summary line."""
    text = "".join(f"{name}\0{digest}\n" for name, digest in sorted(hashes.items()))
    return hashlib.sha256(text.encode()).hexdigest()


def model_identity(model_dir: Path, tokenizer: str | None, adapter_dir: Path | None = None) -> dict[str, Any]:
    """The model by content, not by path: hashes of its config, weights and tokenizer files (py), and of the
    LoRA adapter merged into it, if any.

    A tokenizer given by name ('byte', a hub name) is recorded by that name; one in a directory by its files.
    """
    files = model_files(model_dir, with_tokenizer=tokenizer is None)
    identity: dict[str, Any] = {"model_files": file_hashes(files, model_dir)}
    if adapter_dir is not None:  # only then, so outputs written before adapters existed still resume
        identity["adapter_files"] = file_hashes(adapter_files(adapter_dir), adapter_dir)
    if tokenizer is not None:
        tokenizer_dir = Path(tokenizer).expanduser()
        if tokenizer_dir.is_dir():
            hashes = file_hashes(tokenizer_files(tokenizer_dir), tokenizer_dir)
            identity["tokenizer_files"] = hashes
        else:
            identity["tokenizer"] = tokenizer
    return identity


def identity_sha256(identity: dict[str, Any]) -> str:
    """One hash over a model_identity's file hashes (as an output's _manifest.json lists them): in a job's
    summary and in every row, the same value means the same weights, config and tokenizer."""
    tokenizer = {f"tokenizer/{name}": digest for name, digest in identity.get("tokenizer_files", {}).items()}
    adapter = {f"adapter/{name}": digest for name, digest in identity.get("adapter_files", {}).items()}
    return combined({**identity["model_files"], **tokenizer, **adapter})
