"""The engine process's side of its pipe: build and warm the engine, then serve the parent's commands.

The parent's side is engine/process.py (`EngineProcess`), which starts this module's `child_entry` in a
fresh interpreter. Sequences that ingresses send over their token links (engine/link.py) come straight
in here, on each link's reader thread, without passing through the parent.
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from gpt2_platform import gc_pauses
from gpt2_platform.engine.link import Outlet
from gpt2_platform.engine.messages import (
    DELTA,
    Address,
    Cancel,
    Connect,
    Dead,
    Ready,
    Shutdown,
    StartFailed,
    Stats,
    StepOutput,
    StepSink,
    SubmitRequest,
)
from gpt2_platform.engine.process import ENGINE_PROCESS_NAME, EngineSpec
from gpt2_platform.engine.requests import EngineDeadError

if TYPE_CHECKING:
    from gpt2_platform.engine.engine import Engine

logger = logging.getLogger(__name__)

# How often the child checks on its parent and on its engine, and at most how often it sends stats.
_POLL_S = 0.1


class _ParentSink(StepSink):
    """The token sink of the sequences the parent sends on the pipe, under the parent's keys; a sequence that
    names a link has its tokens go there, and only its end comes back here."""

    def __init__(self, engine: Engine, send: Callable[[tuple], None], outlets: _Outlets) -> None:
        super().__init__(engine)
        self._send, self._outlets = send, outlets
        self._linked: dict[int, tuple[Outlet, int]] = {}  # parent's key -> the link and its key there

    def send_output(self, output: StepOutput) -> bool:
        self._send(output.wire())
        return True

    def end(self, key: int, reason: str, error: str | None, num_generated: int = 0) -> None:
        self._linked.pop(key, None)
        self._send(StepOutput.ended(key, reason, error, num_generated).wire())

    def submit(self, request: SubmitRequest) -> None:
        link = request.link
        if link is None:
            super().submit(request)
            return
        key, outlet = request.key, self._outlets.get(link.address, link.authkey)
        self._linked[key] = (outlet, link.key)
        try:  # the parent hears of its end at once
            outlet.submit(
                request._replace(key=link.key, output_kind=DELTA),
                lambda record, num_generated: self.end(key, record[2], record[3], num_generated),
            )
        except BaseException:
            self._linked.pop(key, None)
            raise

    def cancel(self, key: int) -> None:
        linked = self._linked.pop(key, None)
        if linked is None:
            super().cancel(key)
        else:
            linked[0].cancel(linked[1])


class _Outlets:
    """The child's token links, one per ingress. A sequence that comes over one goes from its reader thread
    straight into the engine, not through the parent's Serve replica, which would spend more host time on it."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._by_address: dict[Address, Outlet] = {}
        self._lock = threading.Lock()

    def get(self, address: Address, authkey: bytes) -> Outlet:
        host, port = address  # a tuple, to key the dict, whatever sequence the caller passed
        address = (host, port)
        with self._lock:
            outlet = self._by_address.get(address)
            if outlet is None or outlet.closed:
                outlet = self._by_address[address] = Outlet(address, authkey, self.engine)
        return outlet

    def in_flight(self) -> int:
        """Sequences that came over links and have not finished."""
        with self._lock:
            return sum(len(outlet.engine_ids) for outlet in self._by_address.values() if not outlet.closed)


def child_entry(conn: Connection) -> None:
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

    def send(message: tuple) -> None:
        with send_lock:
            conn.send(message)

    try:
        engine = _build_engine(conn, spec, age)
    except BaseException:
        send(StartFailed(traceback.format_exc()))
        return
    try:
        vocab_size = engine.runner.model.config.vocab_size
        send(Ready(engine.max_seq_len, vocab_size, "transformers" in sys.modules, engine.stats()))
        _serve_commands(conn, parent_pid, engine, send)
    except (EOFError, OSError):
        pass  # the parent is gone
    finally:
        engine.shutdown()
        conn.close()


def _build_engine(conn: Connection, spec: EngineSpec, age: float | None) -> Engine:
    """Load the model, take the tokenizer the parent sent (or load it), build and warm the engine, and log
    where the time went, from the process's creation on: a replica's start-up is mostly this process's."""
    marks = [("", time.perf_counter())]

    def mark(phase: str) -> None:
        marks.append((phase, time.perf_counter()))

    import torch  # noqa: F401

    mark("torch import")
    from gpt2_platform import checkpoint
    from gpt2_platform.engine.engine import Engine
    from gpt2_platform.tokenizer import load_tokenizer

    mark("our imports")
    model = checkpoint.load_pretrained(spec.model)
    mark("model")
    tokenizer = conn.recv()  # from the parent (EngineProcess._send_tokenizer), loaded meanwhile
    mark("waiting for the parent's tokenizer")
    if tokenizer is None:  # not plain byte-level BPE: the engine needs the tokenizer itself
        tokenizer = load_tokenizer(spec.tokenizer)
        mark("tokenizer, not byte-level BPE so loaded here")
    engine = Engine(model, tokenizer, spec.config)
    mark("engine")
    engine.start(spec.warmup, spec.modes)
    mark("warm-up")
    phases = ", ".join(f"{phase} {end - start:.1f} s" for (_, start), (phase, end) in itertools.pairwise(marks))
    total_s = (age or 0.0) + marks[-1][1] - marks[0][1]
    logger.info("engine ready %.1f s after this process started (interpreter %.1f s, %s)", total_s, age or 0.0, phases)
    # What this process holds by now (torch, the model, the graphs) lives as long as it does: out of
    # the collector's sight, a full collection no longer walks it while the engine's thread waits.
    gc_pauses.settle()
    return engine


def _serve_commands(conn: Connection, parent_pid: int, engine: Engine, send: Callable[[tuple], None]) -> None:
    outlets, pauses = _Outlets(engine), gc_pauses.GcPauses()
    parent = _ParentSink(engine, send, outlets)
    last_stats, last_stats_at = None, 0.0
    while os.getppid() == parent_pid:
        if conn.poll(_POLL_S):
            message = conn.recv()
            kind = type(message)
            if kind is Shutdown:
                return
            if kind is SubmitRequest:
                parent.run(message)
            elif kind is Connect:
                try:
                    outlets.get(message.address, message.authkey)
                except OSError as error:  # the ingress went away meanwhile; it asks again if it is back
                    logger.warning("could not open a token link to %s: %r", message.address, error)
            elif kind is Cancel:
                parent.cancel(message.key)
        try:
            engine.check_health()
        except EngineDeadError as error:
            send(Dead(str(error)))
            return
        if time.monotonic() - last_stats_at >= _POLL_S:
            stats = {**engine.stats(), "link_sequences": outlets.in_flight(), **pauses.stats()}
            last_stats_at = time.monotonic()
            if stats != last_stats:
                send(Stats(stats))
                last_stats = stats
