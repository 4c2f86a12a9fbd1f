"""gpt2_platform.train.data: text / JSONL / Parquet files -> packed token blocks on a real local Ray."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest
import ray.data

from gpt2_platform import demo_data
from gpt2_platform.train.config import DataConfig
from gpt2_platform.train.data import TOKENS_COLUMN, DataError, Datasets, build_datasets, find_files

pytestmark = pytest.mark.slow

VOCAB_SIZE = 257  # the byte tokenizer: ids 0..255 are the UTF-8 bytes, 256 is <|endoftext|>
EOS = 256
BLOCK_SIZE = 32
WIDTH = BLOCK_SIZE + 1
BATCH_DOCS = 256  # TokenizeAndPack's map_batches batch size


@pytest.fixture(autouse=True, scope="module")
def one_parquet_footer_reader() -> Iterator[None]:
    """Ray Data reads Parquet footers on a pool of RAY_DATA_PARQUET_FOOTER_NUM_ACTORS actors (32) that each
    read starts, though it gives one actor every 10 files: these reads have at most 3. The other 31 processes
    cost each read seconds on a 2-CPU machine and change nothing it returns. (Read in the driver, by
    read_parquet.)"""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAY_DATA_PARQUET_FOOTER_NUM_ACTORS", "1")
        yield


def build(paths: list[Path | str], min_train_blocks: int = 1, vocab_size: int = VOCAB_SIZE, **fields) -> Datasets:
    fields = {"block_size": BLOCK_SIZE, "val_fraction": 0.0, **fields}
    config = DataConfig(paths=[str(p) for p in paths], **fields)
    return build_datasets(config, vocab_size=vocab_size, min_train_blocks=min_train_blocks)


def rows(dataset) -> np.ndarray:
    """A dataset's blocks as one (num_blocks, block_size + 1) array, in the dataset's order."""
    return np.stack([row[TOKENS_COLUMN] for row in dataset.take_all()])


def all_blocks(datasets: Datasets) -> np.ndarray:
    parts = [rows(datasets.train)] + ([rows(datasets.val)] if datasets.val is not None else [])
    return np.concatenate(parts)


def sorted_blocks(blocks: np.ndarray) -> list[bytes]:
    """An order-free fingerprint of a set of blocks."""
    return sorted(block.astype(np.int32).tobytes() for block in blocks)


def check_packing(blocks: np.ndarray, documents: list[str], num_files: int) -> None:
    """Blocks of block_size + 1 byte ids: the documents' EOS-terminated stream, less each batch's tail."""
    assert blocks.ndim == 2 and blocks.shape[1] == WIDTH
    assert blocks.min() >= 0 and blocks.max() < VOCAB_SIZE
    encoded = [doc.encode() for doc in documents]
    stream_length = sum(len(doc) + 1 for doc in encoded)
    # TokenizeAndPack packs each map_batches batch on its own and drops its tail (under one block).
    # Ray Data also ends a batch where a read task's rows end, so n documents give up to
    # 2 * ceil(n / 256) batches (a bundle of >= 256 rows ends in one short batch), plus one per file.
    max_batches = 2 * math.ceil(len(documents) / BATCH_DOCS) + num_files
    dropped = stream_length - blocks.size
    assert 0 <= dropped < max_batches * WIDTH
    # One EOS per document: all of them but those in the dropped tails.
    max_eos_per_tail = WIDTH // (min(map(len, encoded)) + 1) + 1
    assert len(documents) - max_batches * max_eos_per_tail <= np.count_nonzero(blocks == EOS) <= len(documents)
    # EOS sits between documents: what follows one starts a document, what precedes one ends a
    # document, and between two EOS of one block lies one whole document.
    whole = set(encoded)
    starts = {doc[:k] for doc in encoded for k in range(WIDTH + 1)}
    ends = {doc[len(doc) - k :] for doc in encoded for k in range(min(len(doc), WIDTH) + 1)}
    for block in blocks:
        eos = [-1, *np.flatnonzero(block == EOS), WIDTH]
        for i, (left, right) in enumerate(pairwise(eos)):
            piece = bytes(block[left + 1 : right].astype(np.uint8))
            if 0 < i < len(eos) - 2:
                assert piece in whole
            elif i > 0:
                assert piece in starts
            elif len(eos) > 2:
                assert piece in ends


@pytest.mark.parametrize(
    ("fmt", "column"), [("jsonl", "text"), ("parquet", "text"), ("jsonl", "body"), ("parquet", "body")]
)
def test_jsonl_and_parquet_records_pack_into_blocks(ray_cluster, tmp_path: Path, fmt: str, column: str) -> None:
    if fmt == "jsonl":
        path = demo_data.write_jsonl(tmp_path / "stories.jsonl", num_stories=600, seed=1, key=column)
    else:
        path = demo_data.write_parquet(tmp_path / "stories.parquet", num_stories=600, seed=1, column=column)
    datasets = build([path], text_column=column)
    assert datasets.train.columns() == [TOKENS_COLUMN]
    assert datasets.val is None and datasets.num_val_blocks == 0
    blocks = all_blocks(datasets)
    assert len(blocks) == datasets.num_train_blocks
    check_packing(blocks, demo_data.stories(600, seed=1), num_files=1)


def test_a_text_file_is_one_document_packed_exactly(ray_cluster, tmp_path: Path) -> None:
    path = demo_data.write_text(tmp_path / "stories.txt", num_stories=200)
    blocks = all_blocks(build([path]))
    # One document (the whole file, line breaks kept) in one batch: the blocks are the stream's
    # first len // width slices, the short tail dropped.
    stream = np.array([*path.read_bytes(), EOS], dtype=np.int32)
    num_blocks = len(stream) // WIDTH
    assert sorted_blocks(blocks) == sorted_blocks(stream[: num_blocks * WIDTH].reshape(num_blocks, WIDTH))


def test_text_files_in_a_directory_are_documents_separated_by_eos(ray_cluster, tmp_path: Path) -> None:
    directory = tmp_path / "notes"
    documents = [f"note {i:02d}: {'hi ' * (i % 3)}bye\n" for i in range(24)]
    for i, text in enumerate(documents):
        sub = directory / "nested" if i % 2 else directory
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"note-{i:02d}.txt").write_text(text)
    (directory / ".DS_Store").write_bytes(b"\x00\x01")  # hidden files are skipped, not read as data
    assert len(find_files([str(directory)])) == len(documents)
    check_packing(all_blocks(build([directory])), documents, num_files=len(documents))


def test_a_mixed_list_of_text_jsonl_and_parquet_files(ray_cluster, tmp_path: Path) -> None:
    # BUG (train/data.py, read_documents): Ray Data reads JSONL into pandas blocks, text and Parquet into
    # Arrow blocks; when one map_batches batch of TokenizeAndPack spans both kinds, Ray's batcher fails
    # (AssertionError: (BlockType.PANDAS, BlockType.ARROW)). With under 256 documents in all, every file
    # lands in one batch, so JSONL + text or JSONL + Parquet always fails (larger files fail whenever a
    # batch straddles two sources). Fix (tried): map every source to an Arrow `text` column before the
    # union: part.map_batches(lambda t: pa.table({"text": t.column("text")}), batch_format="pyarrow",
    # batch_size=None).
    text = demo_data.write_text(tmp_path / "a.txt", num_stories=40, seed=4)
    jsonl = demo_data.write_jsonl(tmp_path / "b.jsonl", num_stories=60, seed=5)
    parquet = demo_data.write_parquet(tmp_path / "c.parquet", num_stories=60, seed=6)
    documents = [text.read_text(), *demo_data.stories(60, seed=5), *demo_data.stories(60, seed=6)]
    # Each source is far larger than the dropped tails, so the count check fails if one is missing.
    check_packing(all_blocks(build([text, jsonl, parquet])), documents, num_files=3)


def test_a_directory_and_a_glob_read_the_same_files(ray_cluster, tmp_path: Path) -> None:
    for i in range(3):
        demo_data.write_jsonl(tmp_path / "shards" / f"sub{i}" / f"part-{i}.jsonl", num_stories=100, seed=10 + i)
    by_directory = build([tmp_path / "shards"])
    by_glob = build([f"{tmp_path}/shards/**/part-*.jsonl"])
    documents = [doc for i in range(3) for doc in demo_data.stories(100, seed=10 + i)]
    assert find_files([str(tmp_path / "shards")]) == find_files([f"{tmp_path}/shards/**/part-*.jsonl"])
    check_packing(all_blocks(by_directory), documents, num_files=3)
    check_packing(all_blocks(by_glob), documents, num_files=3)
    assert len(find_files([f"{tmp_path}/shards/sub[01]/*.jsonl"])) == 2


@pytest.fixture(scope="module")
def split_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return demo_data.write_jsonl(tmp_path_factory.mktemp("split") / "stories.jsonl", num_stories=600)


@pytest.mark.parametrize("val_fraction", [0.1, 0.25])
def test_val_fraction_sets_the_split_sizes(ray_cluster, split_corpus: Path, val_fraction: float) -> None:
    whole = build([split_corpus])
    split = build([split_corpus], val_fraction=val_fraction)
    total = whole.num_train_blocks
    assert split.num_val_blocks == round(total * val_fraction) > 0
    assert split.num_train_blocks == total - split.num_val_blocks
    train, val = rows(split.train), rows(split.val)
    assert (len(train), len(val)) == (split.num_train_blocks, split.num_val_blocks)
    # Train and validation partition the same blocks: nothing lost, nothing in both.
    assert sorted_blocks(np.concatenate([train, val])) == sorted_blocks(rows(whole.train))


def test_val_fraction_zero_gives_no_validation_set(ray_cluster, split_corpus: Path) -> None:
    datasets = build([split_corpus], val_fraction=0.0)
    assert datasets.val is None and datasets.num_val_blocks == 0
    assert datasets.train.count() == datasets.num_train_blocks > 0


def test_the_split_is_deterministic_for_a_seed(ray_cluster, split_corpus: Path) -> None:
    # Fails now and then on the unfixed package (often right after Ray's workers start): the blocks
    # themselves change between builds; see test_a_rebuilt_split_never_trains_on_validation_text.
    first = build([split_corpus], val_fraction=0.1, seed=7)
    again = build([split_corpus], val_fraction=0.1, seed=7)
    other = build([split_corpus], val_fraction=0.1, seed=8)
    assert np.array_equal(rows(first.train), rows(again.train)), "same seed, same train blocks in the same order"
    assert sorted_blocks(rows(first.val)) == sorted_blocks(rows(again.val))
    assert sorted_blocks(rows(first.val)) != sorted_blocks(rows(other.val)), "another seed holds out other blocks"


def whole_documents(blocks: np.ndarray) -> set[bytes]:
    """The documents that lie whole between two EOS of one block."""
    found = set()
    for block in blocks:
        eos = np.flatnonzero(block == EOS)
        for left, right in pairwise(eos):
            found.add(bytes(block[left + 1 : right].astype(np.uint8)))
    return found


def test_a_rebuilt_split_never_trains_on_validation_text(ray_cluster, tmp_path: Path, monkeypatch) -> None:
    # A resumed run rebuilds the split, maybe on a resized cluster. Ray Data cuts a small file into
    # 2 x (cluster CPUs) read blocks, or more when target_min_block_size allows: shrinking that
    # minimum cuts the file as a bigger cluster would.
    # BUG (train/data.py, read_documents + build_datasets): blocks are packed per map_batches batch,
    # whose edges follow Ray's read blocks (cluster size) and their arrival order (task timing), and
    # the split then shuffles whole blocks. Rebuilt, the blocks differ and the same seed holds out
    # other text: documents validated on before the resume are trained on after it. Seen with no
    # setting changed too: a 1000-document file gave different blocks and splits on 1-, 4- and
    # 16-CPU clusters, and twice in a row on one 4-CPU cluster. Fix (tried; this file then passes):
    # read one block per file (override_num_blocks=len(files) in each ray.data.read_*) and set
    # DataContext execution_options.preserve_order = True, so batches no longer depend on the cluster
    # or timing. Or split documents rather than blocks (by a seeded hash), then pack each side.
    rng = random.Random(0)
    path = tmp_path / "numbered.jsonl"  # numbered, so no two documents are equal
    path.write_text("".join(json.dumps({"text": f"{i}: {demo_data.story(rng)}"}) + "\n" for i in range(600)))
    fields = {"val_fraction": 0.1, "seed": 7, "block_size": 128}  # blocks that hold whole documents
    held_out = whole_documents(rows(build([path], **fields).val))
    assert held_out
    monkeypatch.setattr(ray.data.DataContext.get_current(), "target_min_block_size", 2 * 1024)
    trained = whole_documents(rows(build([path], **fields).train))
    leaked = held_out & trained
    assert not leaked, f"{len(leaked)} of {len(held_out)} validation documents are trained on after the rebuild"


# ---- errors: a DataError that names the file or column and what to set -------------------------------


def _empty_directory(tmp_path: Path) -> list[str]:
    (tmp_path / "empty").mkdir()
    return [str(tmp_path / "empty")]


def _empty_files(tmp_path: Path) -> list[str]:
    for name in ("a.txt", "b.jsonl"):
        (tmp_path / name).touch()
    return [str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl")]


def _unknown_extension(tmp_path: Path) -> list[str]:
    (tmp_path / "stories.csv").write_text("text\nalice has 3 apples.\n")
    return [str(tmp_path / "stories.csv")]


@pytest.mark.parametrize(
    ("make_paths", "expected"),
    [
        (lambda tmp: [str(tmp / "missing.txt")], ["missing.txt", "does not exist", "data.paths"]),
        (lambda tmp: [f"{tmp}/nowhere/*.jsonl"], ["nowhere/*.jsonl", "matches no files", "data.paths"]),
        (_empty_directory, ["empty", "holds no files", "data.paths"]),
        (_empty_files, ["a.txt", "b.jsonl", "empty", "data.paths"]),
        (_unknown_extension, ["stories.csv", "cannot tell the format", "data.format"]),
    ],
    ids=["missing-path", "empty-glob", "empty-directory", "all-files-empty", "unknown-extension"],
)
def test_unusable_paths_are_named_with_the_field_to_fix(ray_cluster, tmp_path: Path, make_paths, expected) -> None:
    # BUG (train/data.py, find_files): the missing-path, empty-glob, empty-directory and all-empty
    # messages say what is wrong but not what to change; they should name data.paths as the others
    # name data.format / data.text_column / data.block_size.
    with pytest.raises(DataError) as error:
        build(make_paths(tmp_path))
    for part in expected:
        assert part in str(error.value)


def test_parquet_without_the_text_column_lists_its_columns(ray_cluster, tmp_path: Path) -> None:
    path = demo_data.write_parquet(tmp_path / "stories.parquet", num_stories=10)
    with pytest.raises(
        DataError, match=r"stories\.parquet has no column 'body' \(columns: text, id\); set data.text_column"
    ):
        build([path], text_column="body")


def test_jsonl_whose_first_record_lacks_the_key_is_named(ray_cluster, tmp_path: Path) -> None:
    path = demo_data.write_jsonl(tmp_path / "stories.jsonl", num_stories=10, key="content")
    with pytest.raises(
        DataError, match=r"stories\.jsonl: first record has no key 'text' \(has: content, id\); set data.text_column"
    ):
        build([path])


def test_a_json_array_file_is_a_data_error_naming_the_file(ray_cluster, tmp_path: Path) -> None:
    # BUG (train/data.py, _check_column): .json maps to JSONL, and a pretty-printed JSON array's first
    # line "[" makes json.loads raise a bare JSONDecodeError ("Expecting value: line 1 column 2"), with no
    # file name or hint. Catch json.JSONDecodeError there and raise a DataError naming the file and
    # saying that one JSON object per line is expected.
    path = tmp_path / "stories.json"
    path.write_text('[\n  {"text": "alice has 3 apples."}\n]\n')
    with pytest.raises(DataError, match=r"stories\.json"):
        build([path])


def test_too_few_blocks_for_one_optimizer_step(ray_cluster, tmp_path: Path) -> None:
    path = demo_data.write_jsonl(tmp_path / "stories.jsonl", num_stories=20)
    with pytest.raises(DataError, match=r"fewer than the 1000 one optimizer step needs; add data or lower"):
        build([path], min_train_blocks=1000)


def test_too_few_tokens_for_one_block(ray_cluster, tmp_path: Path) -> None:
    path = tmp_path / "short.txt"
    path.write_text("too short")  # 9 bytes + EOS < 33
    with pytest.raises(DataError, match=r"fewer than block_size \+ 1 = 33 tokens; add text or lower data.block_size"):
        build([path])


def test_a_tokenizer_larger_than_the_model_vocabulary(ray_cluster, corpus: Path) -> None:
    with pytest.raises(DataError, match=r"tokenizer 'byte' has 257 tokens but the model's vocabulary is 100"):
        build([corpus], vocab_size=100)


@pytest.mark.parametrize(
    ("data", "offset", "reason"),
    [
        (b"plain text " * 10 + b"\xff rest", 110, "invalid start byte"),
        # A two-byte character whose continuation is missing; the check reads in chunks, so a character
        # cut by a chunk boundary must still decode, and an error past one must count the earlier chunks.
        ("caf\u00e9 ".encode() * 7 + b"\xc3(", 42, "invalid continuation byte"),
        ("na\u00efve".encode()[:3], 2, "unexpected end of data"),
    ],
    ids=["random-byte", "broken-sequence", "truncated-at-the-end"],
)
@pytest.mark.parametrize("suffix", [".txt", ".jsonl"])
def test_text_that_is_not_utf8_is_refused_naming_file_and_offset(
    tmp_path: Path, data: bytes, offset: int, reason: str, suffix: str
) -> None:
    from gpt2_platform.train import data as data_lib

    path = tmp_path / f"bytes{suffix}"
    # For JSONL the bad bytes sit inside a valid first record's string.
    path.write_bytes(b'{"text": "ok"}\n' + data if suffix == ".jsonl" else data)
    expected = offset + (15 if suffix == ".jsonl" else 0)
    for chunk_bytes in (5, 1 << 20):
        with pytest.raises(DataError, match=f"bytes{suffix} is not UTF-8 text: {reason} at byte offset {expected} "):
            data_lib._check_utf8(path, chunk_bytes)
    with pytest.raises(DataError, match=f"bytes{suffix} is not UTF-8 text: {reason} at byte offset {expected} "):
        data_lib.files_by_format(DataConfig(paths=[str(path)]))


def test_utf8_text_with_many_chunk_boundaries_passes(tmp_path: Path) -> None:
    from gpt2_platform.train import data as data_lib

    path = tmp_path / "multibyte.txt"
    path.write_text("\u00e9\u4e2d\U0001f600 " * 1000, encoding="utf-8")
    for chunk_bytes in (1, 2, 3, 5, 1 << 20):
        data_lib._check_utf8(path, chunk_bytes)


def _token_blocks(rows: int, width: int = 5) -> ray.data.Dataset:
    """Rows i of `width` tokens, all equal to i: a micro-batch's rows say which blocks it holds."""
    return ray.data.from_items([{TOKENS_COLUMN: np.full(width, i, np.int32)} for i in range(rows)]).materialize()


def _blocks_of(batches, count: int) -> list[list[int]]:
    import torch

    taken = [next(batches) for _ in range(count)]
    batches.close()
    for inputs, targets in taken:
        assert inputs.dtype == torch.long and torch.equal(inputs[:, 1:], targets[:, :-1])
    return [inputs[:, 0].tolist() for inputs, _ in taken]


def test_micro_batches_read_ahead_are_the_inline_ones_across_epochs_and_after_a_resume_skip(ray_cluster) -> None:
    """The reader thread changes when blocks are read, never which or in what order: each epoch shuffled by its
    own seed, every block once an epoch, and a resume's skip landing mid-epoch on the same micro-batch."""
    import torch

    from gpt2_platform.train.loop import micro_batches

    dataset, size, per_epoch, skip = _token_blocks(48), 4, 12, 17  # 17: the second epoch's sixth micro-batch
    read = {
        (prefetch, start): _blocks_of(
            micro_batches(dataset.streaming_split(1)[0], size, torch.device("cpu"), 3, start, per_epoch, prefetch),
            3 * per_epoch - start,
        )
        for prefetch in (0, 3)  # 3: the reader waits on a full queue, and runs into the next epoch
        for start in (0, skip)
    }
    whole = read[0, 0]
    assert read[3, 0] == whole
    assert read[0, skip] == read[3, skip] == whole[skip:]
    epochs = [sum(whole[i : i + per_epoch], []) for i in range(0, len(whole), per_epoch)]
    assert all(sorted(epoch) == list(range(48)) for epoch in epochs)
    assert epochs[0] != epochs[1] != epochs[2]  # a new shuffle each epoch


def test_a_failure_reading_ahead_is_raised_in_the_steps_thread(ray_cluster) -> None:
    import torch

    from gpt2_platform.train.loop import micro_batches

    def broken(batch: dict) -> dict:
        if (batch[TOKENS_COLUMN][:, 0] == 9).any():
            raise ValueError("block 9 is unreadable")
        return batch

    dataset = _token_blocks(16).map_batches(broken, batch_size=4)
    batches = micro_batches(dataset.streaming_split(1)[0], 4, torch.device("cpu"), 0, 0, 4, prefetch=8)
    with pytest.raises(RuntimeError, match="reading the training data failed") as failure:
        for _ in range(8):
            next(batches)
    assert "block 9 is unreadable" in str(failure.value.__cause__)
