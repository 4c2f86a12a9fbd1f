"""The token link: an engine's tokens straight to the process that serves their HTTP responses.

Serve finds the engines and keeps them running; the work goes over this link. An ingress sends each
sequence to the engine it has fewest sequences on, and gets its tokens back in one message per engine
step: a Ray call per sequence costs the engine's replica milliseconds of host time, and a Ray object per
token more than the step that made it.

The ingress listens (`Inlet`); an engine connects to it (`Outlet`) when Serve routes it one of the
ingress's calls, on a TCP socket authenticated by a key the ingress hands out in that call (which Ray's
own authentication covers), so no other process can inject or read tokens. Messages, engine/messages.py's,
are pickled, so only the two authenticated ends ever unpickle them.
"""

from __future__ import annotations

import logging
import secrets
import socket
import threading
from collections.abc import Callable
from multiprocessing.connection import Client, Connection, Listener, answer_challenge, deliver_challenge
from typing import TYPE_CHECKING

from gpt2_platform.engine.messages import Address, Cancel, StepOutput, StepSink, SubmitRequest
from gpt2_platform.engine.requests import TokenRecord

if TYPE_CHECKING:
    from gpt2_platform.engine.engine import Engine

logger = logging.getLogger(__name__)


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
        self.authkey = secrets.token_bytes(32)
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
    """The engine's end of one ingress's link: the token sink of the sequences on it, each step's records sent
    as one `StepOutput`. A link that fails (its ingress is gone) is closed, and its sequences cancelled."""

    def __init__(
        self,
        address: Address,
        authkey: bytes,
        engine: Engine,
    ) -> None:
        super().__init__(engine)
        self.address = address
        host, port = address  # Client takes only a tuple, whatever sequence the caller passed
        self.conn = Client((host, port), family="AF_INET", authkey=authkey)
        # Small messages, one per step: Nagle's delay would hold each for the previous one's ACK.
        _no_delay(self.conn)
        self._send_lock = threading.Lock()  # the engine's thread sends steps, the reader refusals
        self._on_end: dict[int, Callable[[TokenRecord, int], None]] = {}  # keys whose end someone else awaits
        self.closed = False
        self._reader = threading.Thread(target=self._read, name="gpt2-outlet-reader", daemon=True)
        self._reader.start()

    def submit(self, request: SubmitRequest, on_end: Callable[[TokenRecord, int], None] | None = None) -> None:
        """`on_end` gets the sequence's last record too (on the engine's thread), for a sender other than the
        ingress to hear of its end."""
        if on_end is not None:
            self._on_end[request.key] = on_end
        try:
            super().submit(request)
        except BaseException:
            self._on_end.pop(request.key, None)
            raise

    def ended(self, key: int, record: TokenRecord, num_generated: int) -> None:
        on_end = self._on_end.pop(key, None) if self._on_end else None
        if on_end is not None:
            on_end(record, num_generated)

    def send_output(self, output: StepOutput) -> bool:
        if self.closed:
            return False
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
                if type(message) is SubmitRequest:  # on this thread, straight into the engine
                    self.run(message)
                elif type(message) is Cancel:
                    self.cancel(message.key)
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
        self.cancel_all()


def _no_delay(conn: Connection) -> None:
    sock = socket.socket(fileno=conn.fileno())
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    finally:
        sock.detach()  # the fd stays the connection's
