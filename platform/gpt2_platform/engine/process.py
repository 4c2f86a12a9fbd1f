"""The engine in a child process of its own: its own GIL (and CUDA context), away from the HTTP work.

In one process, the engine's loop thread and Serve's streaming machinery (an executor
thread, two event loops) take turns on one GIL, and at high concurrency the host, not the
GPU, sets the pace. `EngineProcess` stands in for the parts of `Engine` a server uses:
the parent validates and submits; the child (a fresh interpreter) owns the model and
sends one message per engine step with all of that step's events; a reader thread in the
parent hands each message to the `deliver_in_batches` function in one call, so a server
still wakes its event loop once per step.

The child exits when its parent does (the pipe closes, or its parent pid changes), and
if it dies, every pending request finishes with an error event and `check_health` raises; the
parent hears of it at once (the pipe's EOF), so an owner that passed `on_exit` can act then (a Serve
replica exits, to be replaced, rather than wait for its health checks to fail).
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from gpt2_platform import gc_pauses
from gpt2_platform.engine.admission import Admission
from gpt2_platform.engine.config import SAMPLING_MODES
from gpt2_platform.engine.link import Address, Outlet
from gpt2_platform.engine.requests import (
    Deliver,
    EngineConfig,
    EngineDeadError,
    Event,
    GenerationParams,
    validate_request,
)

if TYPE_CHECKING:
    # Only the child builds an engine: the parent (a Serve replica) never loads torch for it.
    from gpt2_platform.engine.engine import Engine

logger = logging.getLogger(__name__)

# How often the child checks on its parent and on its engine, and at most how often it sends stats.
_POLL_S = 0.1


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
    """An `Engine` in a spawned child process, driven through a pipe; the parent only validates and routes events."""

    def __init__(
        self,
        model: str,
        tokenizer: str,
        config: EngineConfig,
        warmup: bool = True,
        modes: tuple[str, ...] = SAMPLING_MODES,
        on_exit: Callable[[str], None] | None = None,
    ) -> None:
        """`on_exit(why)`: called once, on the reader thread, when the child exits or its engine fails
        after start (never for `shutdown`), once the pending requests have had their error events."""
        self.spec = EngineSpec(model, tokenizer, config, warmup, tuple(modes))
        self._on_exit = on_exit
        self.config = config
        self.max_seq_len: int | None = None  # known once the child has built its engine
        self.vocab_size: int | None = None
        self.child_imported_transformers: bool | None = None  # whether the child needed the tokenizer itself
        self._ids = itertools.count(1)
        # Requests submitted and not yet finished, and those of them that have had an event (so are
        # in a slot); the lock keeps a cancel from slipping between a request's events.
        self._pending: dict[int, Callable[[Event], None]] = {}
        self._started: set[int] = set()
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._deliver: Deliver | None = None
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
            info = self._wait_until_ready()
        except BaseException:  # the child serves nothing yet: nothing to wait for
            self._process.kill()
            _wait(self._process, 10)
            self._conn.close()
            raise
        self.max_seq_len, self.vocab_size = info["max_seq_len"], info["vocab_size"]
        self.child_imported_transformers = info["transformers_imported"]
        self._stats = info["stats"]
        self._reader = threading.Thread(target=self._read, name="gpt2-engine-reader", daemon=True)
        self._reader.start()
        logger.info(
            "engine process %d ready (max_seq_len %d; %s)",
            self._process.pid,
            self.max_seq_len,
            "it imported transformers for its tokenizer"
            if self.child_imported_transformers
            else "its tokenizer a byte table",
        )
        return self

    def _send_tokenizer(self) -> None:
        """Load the tokenizer here, while the child imports torch, and send the child what its engine needs
        of it: a `TableTokenizer` for plain byte-level BPE (GPT-2's), so the child never imports
        transformers; None for any other, which the child then loads itself."""
        from gpt2_platform.engine.detokenize import TableTokenizer
        from gpt2_platform.tokenizer import load_tokenizer

        assert self._conn is not None
        try:
            tokenizer = TableTokenizer.of(load_tokenizer(self.spec.tokenizer))
        except ValueError as error:  # load_tokenizer's: it says what was wrong and what to pass instead
            raise EngineStartError(f"the engine process could not start its engine: {error}") from error
        try:
            self._conn.send(tokenizer)
        except OSError:
            pass  # the child is gone: waiting for it to be ready says how

    def _wait_until_ready(self) -> dict[str, Any]:
        assert self._conn is not None and self._process is not None
        while not self._conn.poll(1.0):
            if self._process.poll() is not None:
                raise EngineStartError(f"the engine process exited with code {self._process.returncode} while starting")
        try:
            kind, payload = self._conn.recv()
        except EOFError:
            _wait(self._process, 5)
            raise EngineStartError(
                f"the engine process exited with code {self._process.returncode} while starting"
            ) from None
        if kind == "failed":
            raise EngineStartError(f"the engine process could not start its engine:\n{payload}")
        assert kind == "ready", kind
        return payload

    def shutdown(self) -> None:
        """Stop the child's engine and the child; requests still pending finish with an error event."""
        if self._process is None or self._stopping:
            return
        self._stopping = True
        try:
            self._send(("shutdown",))
        except (OSError, EngineDeadError):
            pass  # already gone
        self._stop_process()
        if self._reader is not None:
            self._reader.join(timeout=5)
        self._fail_pending("engine shut down")

    def _stop_process(self) -> None:
        assert self._process is not None
        if not _wait(self._process, 30):
            logger.warning("engine process %d did not stop in 30 s; killing it", self._process.pid)
            self._process.kill()
            _wait(self._process, 10)
        if self._conn is not None:
            self._conn.close()

    def check_health(self) -> None:
        """Raise EngineDeadError if the child died or its engine loop failed."""
        if self._error is not None:
            raise EngineDeadError(self._error)
        if self._process is None or self._process.poll() is not None:
            raise EngineDeadError("engine process is not running")

    def deliver_in_batches(self, deliver: Deliver) -> None:
        """As `Engine.deliver_in_batches`: each engine step's events in one call, from the reader thread."""
        self._deliver = deliver

    # ---- submitting --------------------------------------------------------------------------
    def validate(self, prompt_ids: list[int], params: GenerationParams) -> None:
        """Raise ValueError for a request the engine cannot take (checked here: it never reaches the child)."""
        assert self.max_seq_len is not None and self.vocab_size is not None, "start() the engine process first"
        validate_request(prompt_ids, params, self.max_seq_len, self.vocab_size)

    def submit(
        self,
        prompt_ids: list[int],
        params: GenerationParams,
        on_event: Callable[[Event], None],
        incremental_text: bool = True,
        tokens_only: bool = False,
        request_size: int = 1,
        outlet: tuple[Address, bytes, int] | None = None,
    ) -> int:
        """Queue a request in the child; `on_event` is called from the reader thread (or through `deliver`).

        With `outlet` (an ingress's token link address, its key and the ingress's own key for the
        sequence) the child sends the sequence's tokens straight to that ingress (engine/link.py), and
        `on_event` here gets only its last event, without text: this process then carries no per-token work.
        `request_size` is ignored, as by `Engine.submit`.
        """
        self.check_health()
        self.validate(prompt_ids, params)
        request_id = next(self._ids)
        with self._lock:
            self._pending[request_id] = on_event  # before sending: its first event may come back at once
        try:
            message = ("submit", request_id, list(prompt_ids), params, incremental_text, tokens_only, outlet)
            self._send(message)
        except BaseException:
            self._forget(request_id)
            raise
        if self._error is not None and self._forget(request_id) is not None:
            raise EngineDeadError(self._error)  # the reader failed the pending requests before this one joined
        return request_id

    def connect(self, address: Address, authkey: bytes) -> None:
        """Have the child open a token link to the ingress at `address` (if it has none), for the ingress
        to send it sequences directly (engine/link.py)."""
        self._send(("connect", tuple(address), authkey))

    def cancel(self, request_id: int) -> None:
        """Stop a request; its slot is free after the child's current step.

        A request that has had no event yet finishes with an "abort" event at once: the child may
        drop it from its waiting line without a word, and it must not count as in flight meanwhile.
        """
        with self._lock:
            if request_id not in self._pending:
                return
            on_event = None if request_id in self._started else self._pending.pop(request_id)
        if on_event is not None:
            self._hand_over([(on_event, Event(request_id, [], "", finish_reason="abort"))])
        try:
            self._send(("cancel", request_id))
        except EngineDeadError:
            pass  # the reader fails every pending request

    def _forget(self, request_id: int) -> Callable[[Event], None] | None:
        with self._lock:
            self._started.discard(request_id)
            return self._pending.pop(request_id, None)

    def stats(self) -> dict[str, Any]:
        """The child's counters as of its last report (at most 0.1 s old while it works).

        running + waiting counts what this process submitted and has not seen finish, so an
        admission check sees a request the moment it is submitted, as with an in-process engine,
        plus the sequences ingresses sent the child over their token links (as of its last report).
        """
        in_flight = len(self._pending) + self._stats.get("link_sequences", 0)
        running = min(self._stats.get("running", 0), in_flight)
        return {**self._stats, "running": running, "waiting": in_flight - running}

    def _send(self, message: tuple) -> None:
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
                kind, payload = self._conn.recv()
                if kind == "events":
                    self._dispatch(payload)
                elif kind == "stats":
                    self._stats = payload
                elif kind == "dead":
                    self._error = payload
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

    def _dispatch(self, packed: list[tuple]) -> None:
        batch: list[tuple[Callable[[Event], None], Event]] = []
        with self._lock:
            for fields in packed:
                event = Event(*fields)
                request_id = event.request_id
                if event.finished:
                    self._started.discard(request_id)
                    on_event = self._pending.pop(request_id, None)
                else:
                    self._started.add(request_id)
                    on_event = self._pending.get(request_id)
                if on_event is not None:  # None: cancelled before it started, or failed
                    batch.append((on_event, event))
        self._hand_over(batch)

    def _hand_over(self, batch: list[tuple[Callable[[Event], None], Event]]) -> None:
        if not batch:
            return
        if self._deliver is not None:
            self._deliver(batch)
            return
        for on_event, event in batch:
            on_event(event)

    def _fail_pending(self, error: str) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
            self._started.clear()
        batch = [(on_event, Event(i, [], "", finish_reason="error", error=error)) for i, on_event in pending.items()]
        try:
            self._hand_over(batch)
        except Exception:  # a consumer's callback must not hide the failure from the others
            logger.exception("could not deliver the engine failure")


# ---- the child -----------------------------------------------------------------------------------
class _RequestTag:
    """The child's `on_event` for a request of the parent's: never called (events go out in batches), it
    names the parent's id."""

    __slots__ = ("request_id",)

    def __init__(self, request_id: int) -> None:
        self.request_id = request_id

    def __call__(self, event: Event) -> None:
        raise AssertionError("the engine process delivers events in batches")


def _pack(request_id: int, event: Event) -> tuple:
    """An event as a tuple in Event's field order, under the parent's request id (tuples pickle faster)."""
    return (
        request_id,
        event.token_ids,
        event.text,
        event.finish_reason,
        event.prompt_tokens,
        event.completion_tokens,
        event.seed,
        event.error,
        event.logprobs,
        event.prompt_logprobs,
    )


class _Outlets:
    """The child's token links, one per ingress, and the sequences ingresses send on them.

    A sequence that comes over a link goes from the link's reader thread straight into the engine: it
    never passes through the parent, whose Serve replica would spend more host time per sequence than
    the engine does.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._by_address: dict[tuple, Outlet] = {}
        self._lock = threading.Lock()

    def get(self, address: Address, authkey: bytes) -> Outlet:
        address = tuple(address)
        with self._lock:
            outlet = self._by_address.get(address)
            if outlet is None or outlet.closed:
                outlet = self._by_address[address] = Outlet(address, authkey, self.engine.cancel, self.submit)
        return outlet

    def submit(
        self, outlet: Outlet, key: int, prompt_ids: list[int], params: GenerationParams, admission: Admission | None
    ) -> None:
        """On the link's reader thread: run the sequence, or refuse it on the link at once (engine/admission.py;
        None: never refused)."""
        refusal = self.engine.refusal(admission) if admission is not None else None
        if refusal is not None:
            outlet.send_now([(key, -1, "refused", refusal.text())])
            return
        try:
            _submit_to_outlet(self.engine, outlet, key, prompt_ids, params, None)
        except (ValueError, EngineDeadError) as error:  # the ingress validated; this is the engine refusing
            outlet.send_now([(key, -1, "error", f"engine refused: {error}")])

    def in_flight(self) -> int:
        """Sequences that came over links and have not finished."""
        with self._lock:
            return sum(len(outlet.engine_ids) for outlet in self._by_address.values() if not outlet.closed)


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
    "from gpt2_platform.engine.process import _child_entry\n"
    "_child_entry(conn)\n"
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


def _child_entry(conn: Connection) -> None:
    """The child's main: the rest of what the parent sent, then the engine."""
    parent_pid, spec = conn.recv()
    _set_title(spec)
    _child_main(conn, parent_pid, spec)
    # No interpreter shutdown, as multiprocessing's children have none: tearing down torch, Triton and
    # CUDA only costs time, and Triton's bindings print leak reports into the replica's log.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _set_title(spec: EngineSpec) -> None:
    """Show the process in `ps` and `top` as the engine of its model, not as `python -c <the entry code>`."""
    try:
        from setproctitle import setproctitle
    except ImportError:  # optional: the command line still ends in ENGINE_PROCESS_NAME
        return
    setproctitle(f"{ENGINE_PROCESS_NAME} {spec.model}")


def _child_main(conn: Connection, parent_pid: int, spec: EngineSpec) -> None:
    """Build and warm the engine, report ready, then serve the parent's commands until it says stop or dies."""
    from gpt2_platform.worker_process import process_age_s

    age = process_age_s()
    # Ctrl-C in a terminal reaches the whole process group: the parent decides when this process stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if not logging.getLogger().handlers:  # a fresh interpreter: the parent's logging setup did not come along
        logging.basicConfig(
            level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s [engine process] %(message)s"
        )
    send_lock = threading.Lock()
    finished: deque[int] = deque()  # parent ids the engine finished, for the command thread to forget

    def send(message: tuple) -> None:
        with send_lock:
            conn.send(message)

    def deliver(batch: list[tuple[Callable[[Event], None], Event]]) -> None:
        """On the engine thread, once per loop iteration: all of its events for the parent in one message.
        (The tokens of sequences that came with a token link went to their ingress, engine/link.py.)"""
        packed = []
        for tag, event in batch:
            packed.append(_pack(tag.request_id, event))
            if event.finished:
                finished.append(tag.request_id)
        if packed:
            send(("events", packed))

    try:
        # A replica's start-up is mostly this process's: say where it went, from the process's creation on,
        # the imports timed apart.
        imports = [time.perf_counter()]
        import torch  # noqa: F401

        imports.append(time.perf_counter())
        from gpt2_platform import checkpoint
        from gpt2_platform.engine.engine import Engine
        from gpt2_platform.tokenizer import load_tokenizer

        imports.append(time.perf_counter())
        model = checkpoint.load_pretrained(spec.model)
        loaded = time.perf_counter()
        tokenizer = conn.recv()  # from the parent (EngineProcess._send_tokenizer), loaded meanwhile
        waited = time.perf_counter()
        from_parent = tokenizer is not None
        if not from_parent:  # not plain byte-level BPE: the engine needs the tokenizer itself
            tokenizer = load_tokenizer(spec.tokenizer)
        tokenized = time.perf_counter()
        engine = Engine(model, tokenizer, spec.config)
        built = time.perf_counter()
        engine.deliver_in_batches(deliver)
        engine.start(spec.warmup, spec.modes)
        logger.info(
            "engine ready %.1f s after this process started (interpreter %.1f s; imports %.1f s: torch %.1f, "
            "ours %.1f; model %.1f s; tokenizer: waited for the parent's %.1f s%s; engine %.1f s, warm-up %.1f s)",
            (age or 0.0) + time.perf_counter() - imports[0],
            age or 0.0,
            imports[-1] - imports[0],
            imports[1] - imports[0],
            imports[2] - imports[1],
            loaded - imports[2],
            waited - loaded,
            "" if from_parent else f", not byte-level BPE so loaded here {tokenized - waited:.1f} s",
            built - tokenized,
            time.perf_counter() - built,
        )
        # What this process holds by now (torch, the model, the graphs) lives as long as it does: out of
        # the collector's sight, a full collection no longer walks it while the engine's thread waits.
        gc_pauses.settle()
    except BaseException:
        send(("failed", traceback.format_exc()))
        return
    try:
        info = {
            "max_seq_len": engine.max_seq_len,
            "vocab_size": engine.runner.model.config.vocab_size,
            "transformers_imported": "transformers" in sys.modules,
        }
        send(("ready", {**info, "stats": engine.stats()}))
        _serve_commands(conn, parent_pid, engine, send, finished, _Outlets(engine), gc_pauses.GcPauses())
    except (EOFError, OSError):
        pass  # the parent is gone
    finally:
        engine.shutdown()
        conn.close()


def _serve_commands(
    conn: Connection,
    parent_pid: int,
    engine: Engine,
    send: Callable[[tuple], None],
    finished: deque[int],
    outlets: _Outlets,
    pauses: gc_pauses.GcPauses,
) -> None:
    engine_ids: dict[int, int] = {}  # parent's request id -> the engine's, for cancel
    last_stats, last_stats_at = None, 0.0
    while os.getppid() == parent_pid:
        if conn.poll(_POLL_S):
            command, *args = conn.recv()
            if command == "shutdown":
                return
            if command == "submit":
                _submit(engine, engine_ids, outlets, send, *args)
            elif command == "connect":
                try:
                    outlets.get(*args)
                except OSError as error:  # the ingress went away meanwhile; it asks again if it is back
                    logger.warning("could not open a token link to %s: %r", args[0], error)
            elif command == "cancel" and args[0] in engine_ids:
                engine.cancel(engine_ids.pop(args[0]))  # one is enough; a waiting request never finishes
        while finished:
            engine_ids.pop(finished.popleft(), None)
        try:
            engine.check_health()
        except EngineDeadError as error:
            send(("dead", str(error)))
            return
        if time.monotonic() - last_stats_at >= _POLL_S:
            stats = {**engine.stats(), "link_sequences": outlets.in_flight(), **pauses.stats()}
            last_stats_at = time.monotonic()
            if stats != last_stats:
                send(("stats", stats))
                last_stats = stats


def _submit_to_outlet(
    engine: Engine,
    outlet: Outlet,
    key: int,
    prompt_ids: list[int],
    params: GenerationParams,
    on_event: Callable[[Event], None] | None,
) -> int:
    """A sequence whose tokens go to `outlet` under `key`, known to the outlet by its engine id (for the
    ingress's cancels) from before the engine can finish it: its last record removes the key."""
    outlet.engine_ids[key] = None
    try:
        engine_id = engine.submit(prompt_ids, params, on_event, tokens_only=True, sink=outlet, sink_key=key)
    except BaseException:
        outlet.engine_ids.pop(key, None)  # refused: nothing in flight for this key
        raise
    if key in outlet.engine_ids:  # not finished already
        outlet.engine_ids[key] = engine_id
    return engine_id


def _submit(
    engine: Engine,
    engine_ids: dict[int, int],
    outlets: _Outlets,
    send: Callable[[tuple], None],
    request_id: int,
    prompt_ids: list[int],
    params: GenerationParams,
    incremental_text: bool,
    tokens_only: bool,
    outlet_spec: tuple[Address, bytes, int] | None,
) -> None:
    try:
        tag = _RequestTag(request_id)
        if outlet_spec is None:
            engine_ids[request_id] = engine.submit(prompt_ids, params, tag, incremental_text, tokens_only)
        else:
            address, authkey, key = outlet_spec
            outlet = outlets.get(address, authkey)
            engine_ids[request_id] = _submit_to_outlet(engine, outlet, key, prompt_ids, params, tag)
    except (ValueError, EngineDeadError, OSError) as error:  # the parent validated; this is the engine refusing
        send(("events", [(request_id, [], "", "error", len(prompt_ids), 0, 0, f"engine refused: {error}")]))
