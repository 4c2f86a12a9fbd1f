"""A synthetic corpus with structure a small model can learn, for the demo and tests.

Short stories from a little grammar: who has how many of what, who gives
whom some, and the sum that follows. The frame is fixed, the names and
counts vary, so a tiny model's loss falls fast and far (the sums take
longer): a visible signal that training works, with no download.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

NAMES = ["alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi", "ivan", "judy"]
THINGS = ["apples", "books", "coins", "pens", "shells", "stones", "cards", "keys"]


def story(rng: random.Random) -> str:
    giver, taker = rng.sample(NAMES, 2)
    thing = rng.choice(THINGS)
    has, gives = rng.randint(1, 9), rng.randint(1, 9)
    return f"{taker} has {has} {thing}. {giver} gives {taker} {gives} {thing}. now {taker} has {has + gives} {thing}."


def stories(num: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [story(rng) for _ in range(num)]


def write_text(path: str | Path, num_stories: int = 20000, seed: int = 0) -> Path:
    """One story per line in a plain text file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(stories(num_stories, seed)) + "\n")
    return path


def write_jsonl(path: str | Path, num_stories: int = 1000, seed: int = 0, key: str = "text") -> Path:
    """One story per JSON record under `key`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({key: s, "id": i}) + "\n" for i, s in enumerate(stories(num_stories, seed))))
    return path


def write_parquet(path: str | Path, num_stories: int = 1000, seed: int = 0, column: str = "text") -> Path:
    """One story per row in the column `column`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({column: stories(num_stories, seed), "id": list(range(num_stories))}), path)
    return path
