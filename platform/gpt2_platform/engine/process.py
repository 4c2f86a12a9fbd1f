"""The engine in a child process of its own: its own GIL (and CUDA context), away from the HTTP work.

`EngineProcess` is the parent's side, a core as engine/local.py's client drives one: it validates and sends
`SubmitRequest`s, and a reader thread hands each `StepOutput` the child (engine/process_server.py) sends to
`on_output`. The child exits when its parent does. If it dies, every pending sequence ends with an error
and `check_health` raises; the parent hears of it at once (the pipe's EOF), so an owner can act then
(`on_exit`: a Serve replica exits, to be replaced, rather than wait for its health checks to fail).
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from gpt2_platform.engine.config import SAMPLING_MODES
from gpt2_platform.engine.messages import (
    Address,
    Cancel,
    Connect,
    Dead,
    Ready,
    Shutdown,
    StartFailed,
    Stats,
    StepOutput,
    SubmitRequest,
)
from gpt2_platform.engine.requests import EngineConfig, EngineDeadError, GenerationParams, validate_request

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


class EngineStartError(RuntimeError):
    """The engine process could not build or warm its engine; the message holds the child's traceback."""


@dataclass(frozen=True)
class EngineSpec:
    """What the child needs to build its engine: all picklable, nothing loaded yet."""

    model: str
    """Model directory or hub name, as `checkpoint.load_pretrained` takes it."""
    tokenizer: str
    """Tokenizer directory, hub name or 'byte', as `load_tokenizer` takes it."""
    config: EngineConfig
    warmup: bool = True
    """Warm every shape (capture the CUDA graphs) before the child reports ready."""
    modes: tuple[str, ...] = SAMPLING_MODES
    """The sampling modes to warm."""


class EngineProcess:
    """An `Engine` in a spawned child process, driven through a pipe: a core as engine/local.py's client takes."""

    def __init__(
        self,
        model: str,
        tokenizer: str,
        config: EngineConfig,
        warmup: bool = True,
        modes: tuple[str, ...] = SAMPLING_MODES,
        on_output: Callable[[StepOutput], None] | None = None,
        on_exit: Callable[[str], None] | None = None,
    ) -> None:
        """`on_output`: each step's output, on the reader thread. `on_exit(why)`: called once, there, when the
        child exits or its engine fails after start (never for `shutdown`), after the pending sequences' ends."""
        self.spec = EngineSpec(model, tokenizer, config, warmup, tuple(modes))
        self.on_output, self._on_exit = on_output, on_exit
        self.max_seq_len: int | None = None  # known once the child has built its engine
        self.vocab_size: int | None = None
        self.tokenizer: PreTrainedTokenizerBase | None = None  # loaded here at start, for a client's text
        self.child_imported_transformers: bool | None = None  # whether the child needed the tokenizer itself
        self._pending: set[int] = set()  # keys submitted, not yet ended or cancelled
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._stats: dict[str, Any] = {}
        self._error: str | None = None
        self._stopping = False
        self._process: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._reader: threading.Thread | None = None

    @property
    def pid(self) -> int | None:
        """The child's process id (None before start)."""
        return None if self._process is None else self._process.pid

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> EngineProcess:
        """Start the child and wait until its engine is built and warm; EngineStartError if it fails."""
        self._process, self._conn = _start_child(self.spec)
        try:
            self._send_tokenizer()
            ready = self._wait_until_ready()
        except BaseException:  # the child serves nothing yet: nothing to wait for
            self._process.kill()
            _wait(self._process, 10)
            self._conn.close()
            raise
        self.max_seq_len, self.vocab_size = ready.max_seq_len, ready.vocab_size
        self.child_imported_transformers = ready.transformers_imported
        self._stats = ready.stats
        self._reader = threading.Thread(target=self._read, name="gpt2-engine-reader", daemon=True)
        self._reader.start()
        how = "imported transformers for its tokenizer" if self.child_imported_transformers else "a byte table"
        logger.info("engine process %d ready (max_seq_len %d; %s)", self._process.pid, self.max_seq_len, how)
        return self

    def _send_tokenizer(self) -> None:
        """Load the tokenizer here, while the child imports torch, and send the child what its engine needs
        of it: a `TableTokenizer` for plain byte-level BPE (GPT-2's), so the child never imports
        transformers; None for any other, which the child then loads itself."""
        from gpt2_platform.engine.detokenize import TableTokenizer
        from gpt2_platform.tokenizer import load_tokenizer

        assert self._conn is not None
        try:
            self.tokenizer = load_tokenizer(self.spec.tokenizer)
        except ValueError as error:  # load_tokenizer's: it says what was wrong and what to pass instead
            raise EngineStartError(f"the engine process could not start its engine: {error}") from error
        try:
            self._conn.send(TableTokenizer.of(self.tokenizer))
        except OSError:
            pass  # the child is gone: waiting for it to be ready says how

    def _wait_until_ready(self) -> Ready:
        assert self._conn is not None and self._process is not None
        while not self._conn.poll(1.0):
            if self._process.poll() is not None:
                raise EngineStartError(f"the engine process exited with code {self._process.returncode} while starting")
        try:
            message = self._conn.recv()
        except EOFError:
            _wait(self._process, 5)
            message = None
        if message is None:
            raise EngineStartError(f"the engine process exited with code {self._process.returncode} while starting")
        if type(message) is StartFailed:
            raise EngineStartError(f"the engine process could not start its engine:\n{message.traceback}")
        assert type(message) is Ready, message
        return message

    def shutdown(self) -> None:
        """Stop the child's engine and the child; sequences still pending end with an error."""
        if self._process is None or self._stopping:
            return
        self._stopping = True
        try:
            self._send(Shutdown())
        except (OSError, EngineDeadError):
            pass  # already gone
        if not _wait(self._process, 30):
            logger.warning("engine process %d did not stop in 30 s; killing it", self._process.pid)
            self._process.kill()
            _wait(self._process, 10)
        if self._conn is not None:
            self._conn.close()
        if self._reader is not None:
            self._reader.join(timeout=5)
        self._fail_pending("engine shut down")

    def check_health(self) -> None:
        """Raise EngineDeadError if the child died or its engine loop failed."""
        if self._error is not None:
            raise EngineDeadError(self._error)
        if self._process is None or self._process.poll() is not None:
            raise EngineDeadError("engine process is not running")

    # ---- submitting --------------------------------------------------------------------------
    def validate(self, prompt_ids: list[int], params: GenerationParams) -> None:
        """Raise ValueError for a request the engine cannot take (checked here: it never reaches the child)."""
        assert self.max_seq_len is not None and self.vocab_size is not None, "start() the engine process first"
        validate_request(prompt_ids, params, self.max_seq_len, self.vocab_size)

    def submit(self, request: SubmitRequest) -> None:
        """Queue a sequence in the child, under the caller's key. With `link` the child sends its tokens straight
        to that ingress (engine/link.py), and only its end comes back here; with `admission` the child may
        refuse it (a "refused" end, its error the refusal's text: engine/admission.py)."""
        self.check_health()
        self.validate(request.prompt_ids, request.params)
        key = request.key
        with self._lock:
            self._pending.add(key)  # before sending: its end may come back at once
        try:
            self._send(request)
        except BaseException:
            self._pending.discard(key)
            raise
        if self._error is not None and key in self._pending:  # the reader failed the others before this one joined
            self._pending.discard(key)
            raise EngineDeadError(self._error)

    def connect(self, address: Address, authkey: bytes) -> None:
        """Have the child open a token link to the ingress at `address` (if it has none), for the ingress
        to send it sequences directly (engine/link.py)."""
        host, port = address  # a tuple, whatever sequence the caller passed
        self._send(Connect((host, port), authkey))

    def cancel(self, key: int) -> None:
        """Stop a sequence; its slot is free after the child's current step. It no longer counts as in flight,
        and has no end from here if the child dies: its client ended it already."""
        self._pending.discard(key)
        try:
            self._send(Cancel(key))
        except EngineDeadError:
            pass  # nothing left to stop

    def stats(self) -> dict[str, Any]:
        """The child's counters as of its last report (at most 0.1 s old while it works), but running + waiting:
        the sequences submitted here and not ended, from the moment they are, plus those of links."""
        in_flight = len(self._pending) + self._stats.get("link_sequences", 0)
        running = min(self._stats.get("running", 0), in_flight)
        return {**self._stats, "running": running, "waiting": in_flight - running}

    def _send(self, message: SubmitRequest | Cancel | Connect | Shutdown) -> None:
        assert self._conn is not None, "start() the engine process first"
        try:
            with self._send_lock:
                self._conn.send(message)
        except (OSError, ValueError) as error:  # a closed pipe: the child is gone
            raise EngineDeadError(self._error or f"engine process is gone ({error!r})") from error

    # ---- the reader thread -------------------------------------------------------------------
    def _read(self) -> None:
        assert self._conn is not None and self._process is not None
        try:
            while True:
                message = self._conn.recv()
                kind = type(message)
                if kind is tuple:  # a StepOutput, sent as a plain tuple
                    self._take(StepOutput.of_wire(message))
                elif kind is Stats:
                    self._stats = message.stats
                elif kind is Dead:
                    self._error = message.error
                    break
        except (EOFError, OSError):
            pass
        if self._stopping:
            return
        _wait(self._process, 5)
        self._error = self._error or f"engine process exited unexpectedly (exit code {self._process.returncode})"
        if self._on_exit is None:  # an owner that asked to hear of it says what it does about it
            logger.error("%s; failing %d pending requests", self._error, len(self._pending))
        self._fail_pending(f"engine failed: {self._error}")
        if self._on_exit is not None:
            self._on_exit(self._error)

    def _take(self, output: StepOutput) -> None:
        if output.finished is not None:
            keys, pending = output.keys, self._pending
            for row in output.finished:
                pending.discard(keys[row])
        if self.on_output is not None:
            self.on_output(output)

    def _fail_pending(self, error: str) -> None:
        """End every pending sequence with `error`, as the child would have."""
        with self._lock:
            keys, self._pending = list(self._pending), set()
        if not keys or self.on_output is None:
            return
        try:
            self.on_output(
                StepOutput(keys, [-1] * len(keys), {row: ("error", error, None) for row in range(len(keys))})
            )
        except Exception:  # a consumer's callback must not hide the failure from the others
            logger.exception("could not deliver the engine failure")


ENGINE_PROCESS_NAME = "gpt2-engine"
"""The engine process's last command-line argument, and the first word of its title: what tells it apart
from other Python processes."""

# The child's first lines, before it can import anything of ours: the parent's import path comes over the
# connection first, as multiprocessing's spawn would pass it.
_CHILD_ENTRY = (
    "import sys\n"
    "from multiprocessing.connection import Connection\n"
    "conn = Connection(int(sys.argv[1]))\n"
    "sys.path[:] = conn.recv()\n"
    "from gpt2_platform.engine.process_server import child_entry\n"
    "child_entry(conn)\n"
)


def _start_child(spec: EngineSpec) -> tuple[subprocess.Popen, Connection]:
    """A fresh interpreter for the engine, and the parent's end of a duplex connection to it.

    Not multiprocessing's `spawn`: a spawned child first runs its parent's main module again (as
    `__mp_main__`), and a Serve replica's main module is Ray's worker script, so every engine process
    imported all of Ray, which it never uses, before its own imports. Nor `fork`: the parent has Ray's
    threads, and the child must start CUDA fresh.
    """
    parent_end, child_end = socket.socketpair()
    try:
        process = subprocess.Popen(
            # The last argument names the process for whoever reads command lines (bench/processes.py).
            [sys.executable, "-c", _CHILD_ENTRY, str(child_end.fileno()), ENGINE_PROCESS_NAME],
            pass_fds=(child_end.fileno(),),
            stdin=subprocess.DEVNULL,
        )
    except BaseException:
        parent_end.close()
        raise
    finally:
        child_end.close()  # the child has its own copy: EOF on the parent's end means the child is gone
    conn = Connection(parent_end.detach())
    try:
        conn.send(list(sys.path))
        conn.send((os.getpid(), spec))
    except OSError:
        pass  # the child died at once: waiting for it to be ready says how
    return process, conn


def _wait(process: subprocess.Popen, timeout_s: float) -> bool:
    """Wait up to `timeout_s` for `process` to exit; whether it has (its returncode is then set)."""
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return False
    return True
