"""A user moderation callable for the tests, named in configs as 'helpers_moderation:policy'.

Deterministic whatever the model writes: it blocks completions by length, and it raises on one word,
to show that a failing callable blocks (fails closed) instead of crashing the replica or the job.
"""

from __future__ import annotations

MAX_COMPLETION_CHARS = 8
EXPLODING_WORD = "explode"
NOT_A_FUNCTION = 42


def policy(text: str, kind: str) -> str | None:
    if EXPLODING_WORD in text:
        raise RuntimeError("the test policy failed")
    if kind == "completion" and len(text) > MAX_COMPLETION_CHARS:
        return f"completion over {MAX_COMPLETION_CHARS} characters"
    return None
