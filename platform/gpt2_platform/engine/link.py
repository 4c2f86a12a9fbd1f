"""The token link: an engine's tokens straight to the process that serves their HTTP responses.

A Serve app here is several ingress replicas (HTTP, JSON, text) in front of one engine per GPU.
Serve finds the engines and keeps them running; the work itself goes over this link. An ingress
sends each sequence to the engine it has fewest sequences on, and gets its tokens back in one
message per engine step carrying every token that step made for that ingress's sequences. A Ray
call per sequence costs the engine's replica milliseconds of host time, and a Ray object per token,
or per SSE chunk, more than the step that made the token.

The ingress listens (`Inlet`); an engine connects to it (`Outlet`) when Serve routes it one of the
ingress's calls (GPT2Engine.connect, or a sequence sent through Serve before any link is up), on a
TCP socket authenticated by a key the ingress hands out in that call (which Ray's own
authentication covers), so no other process can inject or read tokens. Submits and cancels go from
the ingress straight to the engine's process on the same connection, without a Ray call.

Messages are pickled, so only the two authenticated ends ever unpickle them. They are engine/messages.py's:
a `SubmitRequest` or a `Cancel` from the ingress, and one `StepOutput` per engine step back from the engine.
"""

from __future__ import annotations

import logging
import secrets
import socket
import threading
from collections.abc import Callable
from multiprocessing.connection import Client, Connection, Listener, answer_challenge, deliver_challenge

from gpt2_platform.engine.messages import Address, Cancel, StepOutput, StepSink, SubmitRequest
from gpt2_platform.engine.requests import TokenRecord

logger = logging.getLogger(__name__)

__all__ = ["Address", "Inlet", "Link", "Outlet", "new_authkey"]


def new_authkey() -> bytes:
    return secrets.token_bytes(32)


class Inlet:
    """The ingress's end: accepts engines' connections and hands each message to `on_message` from
    a reader thread (the receiver hops to its event loop itself); `on_lost` when a connection ends."""

    def __init__(
        self,
        host: str,
        on_message: Callable[[Link, StepOutput], None],
        on_lost: Callable[[Link], None],
        on_connect: Callable[[Link], None] = lambda link: None,
    ) -> None:
        self.authkey = new_authkey()
        self.on_message, self.on_lost, self.on_connect = on_message, on_lost, on_connect
        # No authkey on the listener itself: it would authenticate inside accept(), so one client that
        # connects and says nothing would stall every engine's connection behind it.
        self._listener = Listener((host, 0), family="AF_INET")
        self.address: Address = self._listener.address
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="gpt2-inlet", daemon=True)
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        self._closed = True
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn = self._listener.accept()
            except OSError:
                if self._closed:
                    return
                logger.exception("the token link's listener failed")
                return
            threading.Thread(target=self._serve, args=(conn,), name="gpt2-inlet-reader", daemon=True).start()

    def _serve(self, conn: Connection) -> None:
        try:
            deliver_challenge(conn, self.authkey)
            answer_challenge(conn, self.authkey)
        except Exception as error:  # a wrong key, or not our protocol at all
            logger.warning("refused a token link connection: %r", error)
            conn.close()
            return
        _no_delay(conn)
        link = Link(conn)
        self.on_connect(link)
        try:
            while True:
                self.on_message(link, StepOutput.of_wire(conn.recv()))
        except (EOFError, OSError):
            pass
        except Exception:
            logger.exception("the token link from an engine failed")
        link.closed = True
        conn.close()
        self.on_lost(link)


class Link:
    """One engine's connection as the ingress holds it: its sequences, and the way to send it work."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.keys: set[int] = set()  # this ingress's sequences that the engine on this link runs
        self.closed = False
        self._lock = threading.Lock()

    def submit(self, request: SubmitRequest) -> bool:
        """Send a sequence to this engine; False if the link is gone."""
        return self._send(request)

    def cancel(self, key: int) -> None:
        self._send(Cancel(key))

    def _send(self, message: SubmitRequest | Cancel) -> bool:
        if self.closed:
            return False
        try:
            with self._lock:
                self.conn.send(message)
            return True
        except OSError:
            self.closed = True  # the reader sees the end too and fails what is left
            return False


class Outlet(StepSink):
    """The engine's end of one ingress's link: the engine's token sink for the sequences on it, each step's
    records sent as one `StepOutput`. A link that fails (its ingress is gone) is closed, and `on_cancel`
    gets the engine id of each of its sequences, so the engine frees their slots.
    """

    def __init__(
        self,
        address: Address,
        authkey: bytes,
        on_cancel: Callable[[int], None],
        on_submit: Callable[[Outlet, SubmitRequest], None] | None = None,
    ) -> None:
        super().__init__()
        self.address = address
        host, port = address  # Client takes only a tuple, whatever sequence the caller passed
        self.conn = Client((host, port), family="AF_INET", authkey=authkey)
        # Small messages, one per step: Nagle's delay would hold each for the previous one's ACK.
        _no_delay(self.conn)
        self.on_cancel, self.on_submit = on_cancel, on_submit
        self._send_lock = threading.Lock()  # the engine's thread sends steps, the reader refusals
        # key -> the engine's request id (None for the moment it is being submitted), for cancels
        self.engine_ids: dict[int, int | None] = {}
        self._on_end: dict[int, Callable[[TokenRecord, int], None]] = {}  # keys whose end someone else awaits
        self.closed = False
        self._reader = threading.Thread(target=self._read, name="gpt2-outlet-reader", daemon=True)
        self._reader.start()

    def expect(self, key: int, logprobs: bool, on_end: Callable[[TokenRecord, int], None] | None = None) -> None:
        """Note a sequence about to be submitted under `key` (its engine id follows, for cancels); `on_end`
        gets its last record too (on the engine's thread), for a sender other than the ingress to hear of it."""
        self.engine_ids[key] = None
        if logprobs:
            self.with_logprobs.add(key)
        if on_end is not None:
            self._on_end[key] = on_end

    def forget(self, key: int) -> None:
        """A sequence `expect`ed and then refused: nothing is in flight under `key`."""
        self.engine_ids.pop(key, None)
        self.with_logprobs.discard(key)
        self._on_end.pop(key, None)

    def ended(self, key: int, record: TokenRecord, num_generated: int) -> None:
        self.engine_ids.pop(key, None)
        on_end = self._on_end.pop(key, None) if self._on_end else None
        if on_end is not None:
            on_end(record, num_generated)

    def send(self) -> bool:
        """Send what the step gathered; False if the link is gone (its sequences are cancelled)."""
        output = self.output()
        if self.closed:
            return False
        return output is None or self.send_now(output)

    def send_now(self, output: StepOutput) -> bool:
        try:
            with self._send_lock:
                self.conn.send(output.wire())
            return True
        except OSError as error:
            logger.warning("token link to %s lost: %r", self.address, error)
            self._drop_all()
            return False

    def close(self) -> None:
        self.closed = True
        self.conn.close()

    def _read(self) -> None:
        try:
            while True:
                message = self.conn.recv()
                if type(message) is SubmitRequest and self.on_submit is not None:
                    self.on_submit(self, message)
                # One pop: the engine's thread may drop the key (its sequence ended) between a lookup and a
                # delete, and a KeyError here would end the ingress's whole link.
                elif type(message) is Cancel and (engine_id := self.engine_ids.pop(message.key, None)) is not None:
                    self.on_cancel(engine_id)
        except (EOFError, OSError):
            pass
        except Exception:
            logger.exception("token link from %s sent something unexpected", self.address)
        self._drop_all()

    def _drop_all(self) -> None:
        """The ingress is gone: close the link and free the slots of what it was sent (once)."""
        if self.closed:
            return
        self.closed = True
        for engine_id in list(self.engine_ids.values()):
            if engine_id is not None:
                self.on_cancel(engine_id)
        self.engine_ids.clear()
        self.with_logprobs.clear()


def _no_delay(conn: Connection) -> None:
    sock = socket.socket(fileno=conn.fileno())
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    finally:
        sock.detach()  # the fd stays the connection's
