"""Scoring with the engine: the log-likelihood of token ids from one prefill each, generating nothing.

A scored request is an echoed prompt with max_tokens 0 (engine/requests.py `scoring_only`): the engine
returns each prompt token's log-probability under the model, given the tokens before it, and the first
token none. The prompt may be one token longer than the context (its last token is only a target), so a
training block of block_size + 1 tokens is scored whole, exactly as the training loss scores it.

Task score of the batch job (`score_rows`) and jobs/evaluate.py (`batch/evaluate.py`) both come here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from gpt2_platform.batch.rows import RowError
from gpt2_platform.engine.engine import GenerationParams

SCORE_PARAMS = GenerationParams(max_tokens=0, echo=True, logprobs=0)
"""An engine request that scores its prompt: every token's log-probability after the first, no alternatives."""

SCORE_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("text", pa.string()),
        ("log_likelihood", pa.float64()),
        ("scored_tokens", pa.int64()),
        ("perplexity", pa.float64()),
        ("prompt_tokens", pa.int64()),
        ("error", pa.string()),
        ("model", pa.string()),
        ("model_sha256", pa.string()),
        ("run_id", pa.string()),
    ]
)
CONTINUATION_COLUMN = "continuation"


def score_schema(continuation: bool) -> pa.Schema:
    """Task score's output columns; with a continuation column its text is kept beside the context's."""
    if not continuation:
        return SCORE_SCHEMA
    return SCORE_SCHEMA.insert(SCORE_SCHEMA.get_field_index("text") + 1, pa.field(CONTINUATION_COLUMN, pa.string()))


@dataclass
class ScoreRequest:
    """A validated row: the ids the engine scores, and how many of them, from the end, count."""

    token_ids: list[int]
    num_scored: int


def build_score_request(
    text: object,
    text_ids: list[int] | None,
    continuation: object,
    continuation_ids: list[int] | None,
    with_continuation: bool,
    max_seq_len: int,
) -> ScoreRequest:
    """Check a row against the context and build its request; RowError if it cannot be scored.

    Text and continuation are tokenized apart and their ids concatenated (as lm-evaluation-harness does), so
    the continuation's tokens are exactly those of the continuation alone. Without a continuation, every token
    of the text after the first is scored: the first has nothing to be predicted from.
    """
    if text is None:
        raise RowError("null_text", "the text is null")
    if not isinstance(text, str) or not text or not text_ids:
        raise RowError("empty_text", "the text is empty")
    if with_continuation:
        if continuation is None:
            raise RowError("null_continuation", "the continuation is null")
        if not isinstance(continuation, str) or not continuation or not continuation_ids:
            raise RowError("empty_continuation", "the continuation is empty; there is nothing to score")
        ids, num_scored, what = [*text_ids, *continuation_ids], len(continuation_ids), "text and continuation"
    else:
        if len(text_ids) < 2:
            raise RowError(
                "text_too_short",
                "the text is one token, which is only context: nothing is scored (a text needs two tokens, or "
                "put it in a continuation column after a context)",
            )
        ids, num_scored, what = list(text_ids), len(text_ids) - 1, "text"
    if len(ids) > max_seq_len + 1:
        raise RowError(
            "text_too_long",
            f"the {what} is {len(ids)} tokens, over the {max_seq_len + 1} a scored row may hold (the context of "
            f"{max_seq_len} tokens, plus a last token that is only scored); split the text",
        )
    return ScoreRequest(ids, num_scored)


def log_likelihood(prompt_logprobs: list | None, num_scored: int) -> float:
    """The sum of the last `num_scored` tokens' log-probabilities (nats) from a completion's prompt_logprobs
    (which SCORE_PARAMS asks for)."""
    assert prompt_logprobs is not None and 0 < num_scored < len(prompt_logprobs) and prompt_logprobs[0] is None
    return math.fsum(entry[0] for entry in prompt_logprobs[-num_scored:])


def perplexity(total_log_likelihood: float, num_tokens: int) -> float:
    """exp of the mean negative log-likelihood per token (inf where that overflows)."""
    mean = -total_log_likelihood / num_tokens
    return math.exp(mean) if mean < 700 else math.inf


def token_byte_lengths(tokenizer) -> np.ndarray:
    """UTF-8 bytes of the text each token id stands for; special tokens (end-of-text) stand for none.

    Byte-level BPE (GPT-2's, the offline byte tokenizer) maps every token to a fixed byte string, so the
    bytes of a run of tokens are the sum of theirs.
    """
    from gpt2_platform.engine.detokenize import ByteTable

    table = ByteTable.of(tokenizer)
    if table is None:
        raise ValueError(
            f"tokenizer {type(tokenizer).__name__} is not byte-level BPE, so its tokens' bytes are unknown; "
            "bits per byte need a byte-level tokenizer (GPT-2's or 'byte')"
        )
    lengths = np.array([len(token) for token in table.token_bytes], dtype=np.int64)
    lengths[[i for i in tokenizer.all_special_ids if i < len(lengths)]] = 0
    return lengths


def score_rows(worker, batch: pa.Table, ids: list[str]) -> pa.Table:
    """Task score: input rows -> output rows (`score_schema`), one per id, error rows for bad ones.

    `worker` is the batch job's actor (worker.GenerateBatch): its spec, tokenizer (and lock) and engine.
    """
    spec, columns = worker.spec, worker.spec.input
    with_continuation = columns.continuation_column is not None
    texts = batch.column(columns.prompt_column).to_pylist()
    continuations = batch.column(columns.continuation_column).to_pylist() if with_continuation else [None] * len(texts)
    with worker.tokenizer_lock:  # a fast tokenizer is not safe to call from two threads at once
        text_ids = _tokenize(worker.tokenizer, texts)
        continuation_ids = _tokenize(worker.tokenizer, continuations)

    requests: list[ScoreRequest | None] = []
    errors: list[str | None] = []
    for text, ids_of_text, continuation, ids_of_continuation in zip(
        texts, text_ids, continuations, continuation_ids, strict=True
    ):
        try:
            row_request = build_score_request(
                text, ids_of_text, continuation, ids_of_continuation, with_continuation, worker.max_seq_len
            )
            worker.engine.validate(row_request.token_ids, SCORE_PARAMS)
            requests.append(row_request)
            errors.append(None)
        except RowError as refused:
            requests.append(None)
            errors.append(str(refused))
        except ValueError as invalid:  # what the engine refuses (e.g. a token outside the vocabulary)
            requests.append(None)
            errors.append(str(RowError("invalid_request", str(invalid))))

    valid = [r for r in requests if r is not None]
    completions = iter(worker.engine.generate([r.token_ids for r in valid], SCORE_PARAMS))
    schema = score_schema(with_continuation)
    rows: dict[str, list] = {name: [] for name in schema.names}
    for row_id, text, continuation, request, error in zip(ids, texts, continuations, requests, errors, strict=True):
        completion = next(completions) if request is not None else None
        if completion is not None and completion.error:
            error = f"scoring_failed: {completion.error}"
        total: float | None = None  # set where the row was scored
        num_scored = 0
        if request is not None and completion is not None and error is None:
            num_scored = request.num_scored
            total = log_likelihood(completion.prompt_logprobs, num_scored)
        rows["id"].append(row_id)
        rows["text"].append(text)
        if with_continuation:
            rows[CONTINUATION_COLUMN].append(continuation)
        rows["log_likelihood"].append(total)
        rows["scored_tokens"].append(num_scored)
        rows["perplexity"].append(None if total is None else perplexity(total, num_scored))
        rows["prompt_tokens"].append(None if request is None else len(request.token_ids))
        rows["error"].append(error)
        rows["model"].append(spec.model)
        rows["model_sha256"].append(spec.model_sha256)
        rows["run_id"].append(spec.run_id)
    return pa.table(rows, schema=schema)


def _tokenize(tokenizer, texts: list) -> list[list[int] | None]:
    """Each text's ids (None for what is not text), in one call to the tokenizer."""
    present = [i for i, text in enumerate(texts) if isinstance(text, str) and text]
    ids: list[list[int] | None] = [None] * len(texts)
    if present:
        encoded = tokenizer([texts[i] for i in present], add_special_tokens=False)["input_ids"]
        for i, token_ids in zip(present, encoded, strict=True):
            ids[i] = token_ids
    return ids
