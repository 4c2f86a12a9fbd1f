"""Typed messages at the engine's edge: what goes to an engine, and what one engine step sends back.

The same types travel on every transport: the engine process's pipe (engine/process.py and
engine/process_server.py) and the token link between an ingress and an engine (engine/link.py).
A request is a `SubmitRequest`; one engine step's output for many sequences is one `StepOutput`.

A `StepOutput` is columnar (parallel lists of keys and tokens, with sparse finish and log-probability
entries by row): the link sends one per engine step for hundreds of sequences, and two lists of ints
pickle and unpickle in a fraction of the time a tuple per sequence takes (tools/probes/step_output_pickle.py).
On the wire it is a plain tuple (`StepOutput.wire`): pickling a class instance costs microseconds a
message, more than the data of a small step.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

from gpt2_platform.engine.admission import Admission
from gpt2_platform.engine.requests import GenerationParams, TokenLogprob, TokenRecord

Address = tuple[str, int]
"""An ingress's token link listener: (host, port)."""

OutputKind = Literal["delta", "final"]
"""What a request's consumer gets: "delta", each step's new tokens as they come; "final", one output at
the end with every token (the engine spends no Python on such a sequence per token)."""
DELTA: OutputKind = "delta"
FINAL_ONLY: OutputKind = "final"


class LinkTarget(NamedTuple):
    """Where a sequence's tokens go instead of back on the pipe: an ingress's token link (engine/link.py)."""

    address: Address
    authkey: bytes
    key: int
    """The ingress's own key for the sequence: its tokens come back under it."""


class SubmitRequest(NamedTuple):
    """One sequence for an engine: the same on the pipe and on the token link."""

    key: int
    """The sender's id for the sequence: its outputs and a `Cancel` name it."""
    prompt_ids: list[int]
    params: GenerationParams
    """Sampling, stop and log-probability parameters; the sampling seed resolved by the sender."""
    output_kind: OutputKind = DELTA
    admission: Admission | None = None
    """Refuse the sequence (a "refused" finish) unless the engine takes it under this (engine/admission.py);
    None: never refused (the rest of a request whose first sequence was admitted)."""
    link: LinkTarget | None = None
    """Pipe only: send the tokens to this ingress, and back on the pipe only the end (no tokens)."""


class Cancel(NamedTuple):
    """Stop the sequence the sender submitted under `key`; its slot is free within a step."""

    key: int


class Connect(NamedTuple):
    """Pipe only: open a token link to the ingress at `address` (nothing if one is open already)."""

    address: Address
    authkey: bytes


class Shutdown(NamedTuple):
    """Pipe only: stop the engine and the engine process."""


# ---- what the engine process tells its parent, besides step outputs ----------------------------------
class Ready(NamedTuple):
    """The engine is built and warm."""

    max_seq_len: int
    vocab_size: int
    transformers_imported: bool
    """Whether the child had to load the tokenizer itself (not plain byte-level BPE)."""
    stats: dict[str, Any]


class StartFailed(NamedTuple):
    """The engine could not be built or warmed."""

    traceback: str


class Stats(NamedTuple):
    """The engine's counters, sent at most every 0.1 s while they change."""

    stats: dict[str, Any]


class Dead(NamedTuple):
    """The engine's loop failed; the process is about to exit."""

    error: str


Finish = tuple[str, str | None, int | None]
"""A sequence's end: (finish reason, error or None, its generated token count, or None where the
receiver counts its tokens itself)."""
RowLogprobs = tuple[TokenLogprob | None, list[TokenLogprob | None] | None]
"""A row's log-probabilities: its token's (None with no token), and with echo the prompt's, sent once."""


class StepOutput(NamedTuple):
    """One engine step's output for many sequences, in columns: row i is sequence keys[i]'s token.

    A sequence has one row per token it got this step (a final-only one all of them at its end, in
    order) and a row with token -1 where it ended with none (aborted, failed, refused).
    """

    keys: list[int]
    tokens: list[int]
    """The row's token, or -1 for none."""
    finished: dict[int, Finish] | None = None
    """Row -> how its sequence ended, for the last row of each sequence that ended; None when none did."""
    logprobs: dict[int, RowLogprobs] | None = None
    """Row -> its log-probabilities, for sequences that asked for them; None when none did."""

    def wire(self) -> tuple:
        """As it is sent: a plain tuple (`StepOutput.of_wire` reads it back)."""
        return tuple(self)

    @classmethod
    def of_wire(cls, fields: tuple) -> StepOutput:
        return tuple.__new__(cls, fields)  # not _make: no check of what only the other end of a link sends

    @classmethod
    def ended(cls, key: int, reason: str, error: str | None, completion_tokens: int | None = 0) -> StepOutput:
        """One sequence that ended with no token: refused, failed or aborted."""
        return cls([key], [-1], {0: (reason, error, completion_tokens)})

    @classmethod
    def of_records(cls, records: list[tuple], finished: dict[int, Finish] | None, with_logprobs: bool) -> StepOutput:
        """From a token sink's records (engine/requests.py: TokenRecord), whose ends the sink noted by row
        as they came (`finished`); `with_logprobs`: some record may carry log-probabilities (a fifth item)."""
        logprobs = None
        if with_logprobs:
            logprobs = {row: record[4] for row, record in enumerate(records) if len(record) > 4} or None
        # tuple.__new__: the generated __new__ costs a Python call, and this runs once per step
        keys, tokens = [record[0] for record in records], [record[1] for record in records]
        return tuple.__new__(cls, (keys, tokens, finished or None, logprobs))


class StepSink:
    """A token sink (engine/requests.py, TokenSink) whose iteration's records leave as one StepOutput (`output`):
    the engine process's sinks (to its parent, to a token link) and the in-process core's (engine/local.py)."""

    def __init__(self) -> None:
        self.pending: list[TokenRecord] = []
        self.with_logprobs: set[int] = set()
        """Keys whose records carry log-probabilities: only with one is a step's output searched for them."""
        self._finished: dict[int, Finish] = {}  # row of pending -> the end of the sequence it ends
        self._last_with_logprobs = False  # a last record this step carried log-probabilities

    def add(self, record: TokenRecord, num_generated: int) -> None:
        key = record[0]
        self._finished[len(self.pending)] = (record[2], record[3], num_generated)
        self.pending.append(record)
        if key in self.with_logprobs:
            self.with_logprobs.discard(key)
            self._last_with_logprobs = True
        self.ended(key, record, num_generated)

    def ended(self, key: int, record: TokenRecord, num_generated: int) -> None:
        """The sequence under `key` had its last record, on the engine's thread."""

    def output(self) -> StepOutput | None:
        """The records since the last call as one StepOutput; None if there were none."""
        if not self.pending:
            return None
        records, self.pending = self.pending, []
        finished, self._finished = self._finished, {}
        with_logprobs, self._last_with_logprobs = self._last_with_logprobs or bool(self.with_logprobs), False
        return StepOutput.of_records(records, finished, with_logprobs)
