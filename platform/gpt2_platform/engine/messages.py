"""Typed messages at the engine's edge, the same on every transport (the engine process's pipe, the token
link): a request is a `SubmitRequest`, one engine step's output for many sequences one `StepOutput`, which
`StepSink` makes of the engine's token records.

A `StepOutput` is columnar (parallel lists of keys and tokens, sparse finish and log-probability entries by
row): two lists of ints pickle in a fraction of the time a tuple per sequence takes
(tools/probes/step_output_pickle.py). On the wire it is a plain tuple: pickling a class instance costs
microseconds a message, more than the data of a small step.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from gpt2_platform.engine.admission import Admission
from gpt2_platform.engine.requests import EngineDeadError, GenerationParams, TokenLogprob, TokenRecord

if TYPE_CHECKING:
    from gpt2_platform.engine.engine import Engine

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


_SUBMITTING, _CANCELLED = 0, -1  # a key's engine id before Engine.submit returned it (the engine's start at 1)


class StepSink:
    """The token sink (engine/requests.py, TokenSink) of the sequences one sender submits to an engine by its
    own keys: cancels by key from any thread, and each iteration's records sent on as one StepOutput (`send`).
    The engine process's sinks (to its parent, to each token link) and the in-process core (engine/local.py)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.pending: list[TokenRecord] = []
        self.engine_ids: dict[int, int] = {}  # key -> the engine's id, until the sequence ends
        self._with_logprobs: set[int] = set()  # keys whose records carry log-probabilities
        self._finished: dict[int, Finish] = {}  # row of pending -> the end of the sequence it ends
        self._last_with_logprobs = False  # a last record this step carried log-probabilities
        self._lock = threading.Lock()

    def submit(self, request: SubmitRequest) -> None:
        """Run `request` in the engine, its records here: ValueError or EngineDeadError where the engine refuses."""
        key = request.key
        with self._lock:
            self.engine_ids[key] = _SUBMITTING  # its records may come, and end it, before Engine.submit returns
        if request.params.logprobs is not None:
            self._with_logprobs.add(key)
        try:
            engine_id = self.engine.submit(request, self)
        except BaseException:
            with self._lock:
                self.engine_ids.pop(key, None)
            self._with_logprobs.discard(key)
            raise
        with self._lock:
            state = self.engine_ids.get(key)  # None: it ended already
            if state == _SUBMITTING:
                self.engine_ids[key] = engine_id
            elif state == _CANCELLED:
                del self.engine_ids[key]
        if state == _CANCELLED:
            self.engine.cancel(engine_id)

    def run(self, request: SubmitRequest) -> None:
        """Submit `request`, or end it at once: refused under its admission (engine/admission.py), or refused
        by the engine (its sender validated it)."""
        admission = request.admission
        refused = None if admission is None else self.engine.refusal(admission)
        if refused is not None:
            self.end(request.key, "refused", refused.text())
            return
        try:
            self.submit(request)
        except (ValueError, EngineDeadError, OSError) as error:
            self.end(request.key, "error", f"engine refused: {error}")

    def cancel(self, key: int) -> None:
        with self._lock:
            engine_id = self.engine_ids.get(key)
            if engine_id == _SUBMITTING:
                self.engine_ids[key] = _CANCELLED
        if engine_id is not None and engine_id > 0:
            self.engine.cancel(engine_id)

    def cancel_all(self) -> None:
        with self._lock:
            engine_ids, self.engine_ids = list(self.engine_ids.values()), {}
        for engine_id in engine_ids:
            if engine_id > 0:
                self.engine.cancel(engine_id)

    def add(self, record: TokenRecord, num_generated: int) -> None:
        key = record[0]
        self._finished[len(self.pending)] = (record[2], record[3], num_generated)
        self.pending.append(record)
        if key in self._with_logprobs:
            self._with_logprobs.discard(key)
            self._last_with_logprobs = True
        with self._lock:
            self.engine_ids.pop(key, None)
        self.ended(key, record, num_generated)

    def ended(self, key: int, record: TokenRecord, num_generated: int) -> None:
        """The sequence under `key` had its last record, on the engine's thread."""

    def end(self, key: int, reason: str, error: str | None) -> None:
        """Send the end of a sequence that never reached the engine."""
        self.send_output(StepOutput.ended(key, reason, error))

    def send(self) -> bool:
        """Send the iteration's records on as one StepOutput; False if their receiver is gone."""
        if not self.pending:
            return True
        records, self.pending = self.pending, []
        finished, self._finished = self._finished, {}
        with_logprobs, self._last_with_logprobs = self._last_with_logprobs or bool(self._with_logprobs), False
        return self.send_output(StepOutput.of_records(records, finished, with_logprobs))

    def send_output(self, output: StepOutput) -> bool:
        raise NotImplementedError
