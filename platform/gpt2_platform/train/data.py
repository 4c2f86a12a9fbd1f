"""Training data: text / JSONL / Parquet files -> tokenized, packed blocks with Ray Data.

Each document is tokenized and followed by EOS; documents are concatenated
and cut into blocks of `block_size + 1` tokens (inputs and shifted targets).
Files are checked on the driver before any Ray work starts, so a wrong path
or column fails in seconds with a message that says what to fix.
"""

from __future__ import annotations

import codecs
import glob
import json
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import ray
import ray.data

from gpt2_platform.tokenizer import load_tokenizer
from gpt2_platform.train.config import DataConfig

logger = logging.getLogger(__name__)

FORMATS_BY_SUFFIX = {
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".jsonl": "jsonl",
    ".json": "jsonl",
    ".parquet": "parquet",
}
TOKENS_COLUMN = "tokens"


class DataError(ValueError):
    """The training data cannot be used as configured; the message says why and what to do."""


def find_files(paths: list[str]) -> list[Path]:
    """Expand paths, directories and globs into a sorted list of files."""
    if not paths:
        raise DataError(
            "data.paths is empty; set it to files, directories or globs, e.g. --set data.paths=[corpus.txt]"
        )
    files: list[Path] = []
    for spec in paths:
        expanded = os.path.expanduser(spec)
        if glob.has_magic(expanded):
            matches = [Path(p) for p in sorted(glob.glob(expanded, recursive=True)) if Path(p).is_file()]
            if not matches:
                raise DataError(f"data path {spec!r} matches no files; fix data.paths")
        elif Path(expanded).is_dir():
            matches = sorted(p for p in Path(expanded).rglob("*") if p.is_file() and not p.name.startswith("."))
            if not matches:
                raise DataError(f"data directory {spec!r} holds no files; fix data.paths")
        elif Path(expanded).is_file():
            matches = [Path(expanded)]
        else:
            raise DataError(f"data path {spec!r} does not exist; fix data.paths")
        files.extend(matches)
    files = sorted(set(p.resolve() for p in files))
    if all(p.stat().st_size == 0 for p in files):
        raise DataError(f"data files are all empty: {', '.join(map(str, files[:5]))}; point data.paths at text")
    return files


def file_format(path: Path, configured: str) -> str:
    if configured != "auto":
        return configured
    fmt = FORMATS_BY_SUFFIX.get(path.suffix.lower())
    if fmt is None:
        raise DataError(
            f"cannot tell the format of {path} from its extension; use .txt/.jsonl/.parquet or set data.format"
        )
    return fmt


def _check_column(path: Path, fmt: str, column: str) -> None:
    if fmt == "parquet":
        names = pq.read_schema(path).names
        if column not in names:
            raise DataError(f"{path} has no column {column!r} (columns: {', '.join(names)}); set data.text_column")
    elif fmt == "jsonl":
        with path.open() as f:
            for line in f:
                if line.strip():
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as error:
                        raise DataError(
                            f"{path}: first line is not a JSON object ({error}); JSONL needs one object per line"
                        ) from error
                    if not isinstance(record, dict) or column not in record:
                        keys = ", ".join(record) if isinstance(record, dict) else type(record).__name__
                        raise DataError(
                            f"{path}: first record has no key {column!r} (has: {keys}); set data.text_column"
                        )
                    return


def _check_utf8(path: Path, chunk_bytes: int = 1 << 20) -> None:
    """Text and JSONL must be UTF-8: bytes that are not would train as replacement characters, unnoticed."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0  # bytes of the file handed to the decoder so far
    with path.open("rb") as f:
        while True:
            chunk = f.read(chunk_bytes)
            pending = len(decoder.getstate()[0])  # the start of a character cut by the last chunk
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as error:
                at = offset - pending + error.start
                raise DataError(
                    f"{path} is not UTF-8 text: {error.reason} at byte offset {at} "
                    f"(byte 0x{error.object[error.start]:02x}); convert it to UTF-8 (e.g. iconv -f latin1 -t utf-8) "
                    "or remove it from data.paths"
                ) from error
            if not chunk:
                return
            offset += len(chunk)


def files_by_format(config: DataConfig) -> dict[str, list[str]]:
    """The non-empty data files grouped by format, each checked for the text column (no Ray needed)."""
    by_format: dict[str, list[str]] = {}
    for path in find_files(config.paths):
        fmt = file_format(path, config.format)
        if path.stat().st_size:
            if fmt in ("text", "jsonl"):
                _check_utf8(path)
            _check_column(path, fmt, config.text_column)
            by_format.setdefault(fmt, []).append(str(path))
    return by_format


def read_documents(config: DataConfig) -> ray.data.Dataset:
    """One row per document with a `text` column, from every configured file.

    Each file is read as one block, so that packing, and therefore the seeded
    train/validation split, comes out the same on any cluster size (a resumed
    run must not train on what it validated on before).
    """
    by_format = files_by_format(config)
    parts = []
    column = config.text_column
    if "text" in by_format:
        # A plain text file is one document: read whole, so line breaks survive.
        ds = ray.data.read_binary_files(by_format["text"], override_num_blocks=len(by_format["text"]))
        parts.append(ds.map_batches(_decode_bytes, batch_format="pyarrow"))
    if "jsonl" in by_format:
        ds = ray.data.read_json(by_format["jsonl"], lines=True, override_num_blocks=len(by_format["jsonl"]))
        parts.append(
            ds.select_columns([column]).rename_columns({column: "text"})
            if column != "text"
            else ds.select_columns(["text"])
        )
    if "parquet" in by_format:
        ds = ray.data.read_parquet(
            by_format["parquet"], columns=[column], override_num_blocks=len(by_format["parquet"])
        )
        parts.append(ds.rename_columns({column: "text"}) if column != "text" else ds)
    parts = [p.map_batches(_as_arrow, batch_format="pyarrow", batch_size=None) for p in parts]
    return parts[0].union(*parts[1:]) if len(parts) > 1 else parts[0]


def _as_arrow(batch):
    import pyarrow as pa

    return pa.table({"text": batch.column("text")})


def _decode_bytes(batch):
    import pyarrow as pa

    texts = [b.decode("utf-8", errors="replace") for b in batch.column("bytes").to_pylist()]
    return pa.table({"text": pa.array(texts, type=pa.string())})


@lru_cache(maxsize=4)
def _cached_tokenizer(name: str):
    tokenizer = load_tokenizer(name)
    # Whole documents are tokenized before packing; the model's limit applies to blocks, not here.
    tokenizer.model_max_length = int(1e12)
    return tokenizer


class TokenizeAndPack:
    """map_batches function: documents -> blocks of `block_size + 1` token ids."""

    def __init__(self, tokenizer: str, block_size: int) -> None:
        self.tokenizer = tokenizer
        self.block_size = block_size

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        tokenizer = _cached_tokenizer(self.tokenizer)
        texts = [t for t in batch["text"] if isinstance(t, str) and t]
        width = self.block_size + 1
        if not texts:
            return {TOKENS_COLUMN: np.zeros((0, width), dtype=np.int32)}
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
        eos = tokenizer.eos_token_id
        stream = np.fromiter((tok for doc in ids for tok in (*doc, eos)), dtype=np.int32)
        n_blocks = len(stream) // width
        # The tail shorter than a block is dropped; batches are large, so little is lost.
        return {TOKENS_COLUMN: stream[: n_blocks * width].reshape(n_blocks, width)}


@contextmanager
def _data_context(preserve_order: bool | None = None, progress_bars: bool | None = None) -> Iterator[None]:
    """Settings for the Datasets created inside (a Dataset keeps the DataContext it was made with)."""
    context = ray.data.DataContext.get_current()
    before = (context.execution_options.preserve_order, context.enable_progress_bars)
    if preserve_order is not None:
        context.execution_options.preserve_order = preserve_order
    if progress_bars is not None:
        context.enable_progress_bars = progress_bars
    try:
        yield
    finally:
        context.execution_options.preserve_order, context.enable_progress_bars = before


@dataclass
class Datasets:
    train: ray.data.Dataset
    val: ray.data.Dataset | None
    num_train_blocks: int
    num_val_blocks: int


def build_datasets(config: DataConfig, vocab_size: int, min_train_blocks: int) -> Datasets:
    """Read, tokenize, pack, and split into materialized train / validation datasets."""
    tokenizer = load_tokenizer(config.tokenizer)
    if len(tokenizer) > vocab_size:
        raise DataError(
            f"tokenizer {config.tokenizer!r} has {len(tokenizer)} tokens but the model's vocabulary is {vocab_size}; "
            "use a matching tokenizer or model"
        )
    with _data_context(preserve_order=True):
        docs = read_documents(config)
        blocks = docs.map_batches(
            TokenizeAndPack(config.tokenizer, config.block_size), batch_size=256, batch_format="numpy"
        ).materialize()
    total = blocks.count()
    if total == 0:
        raise DataError(
            f"the data holds fewer than block_size + 1 = {config.block_size + 1} tokens; "
            "add text or lower data.block_size"
        )
    num_val = int(round(total * config.val_fraction))
    if config.val_fraction > 0:
        num_val = max(num_val, 1)
    if total - num_val < min_train_blocks:
        raise DataError(
            f"the data makes {total} blocks of {config.block_size} tokens ({num_val} held out for validation), "
            f"fewer than the {min_train_blocks} one optimizer step needs; add data or lower the batch or block size"
        )
    with _data_context(preserve_order=True, progress_bars=False):
        # A Dataset keeps the DataContext it was made with: the same split for a seed on any
        # cluster, and no progress bar per epoch of streaming (rank 0's metrics show progress).
        if num_val:
            train, val = blocks.train_test_split(test_size=num_val, shuffle=True, seed=config.seed)
            train, val = train.materialize(), val.materialize()
        else:
            train, val = blocks.random_shuffle(seed=config.seed).materialize(), None
    logger.info("data: %d train blocks, %d validation blocks of %d tokens", total - num_val, num_val, config.block_size)
    return Datasets(train=train, val=val, num_train_blocks=total - num_val, num_val_blocks=num_val)
