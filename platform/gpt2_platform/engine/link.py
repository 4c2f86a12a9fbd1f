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

Messages are pickled lists, so only the two authenticated ends ever unpickle them. A token record is
`(key, token, finish_reason, error)`: `token` is -1 when there is none (an abort or a failure),
and `finish_reason` is None while the sequence goes on.
"""

from __future__ import annotations

import logging
import secrets
import socket
import threading
from collections.abc import Callable
from multiprocessing.connection import Client, Connection, Listener, answer_challenge, deliver_challenge

from gpt2_platform.engine.admission import Admission
from gpt2_platform.engine.requests import GenerationParams, TokenRecord

logger = logging.getLogger(__name__)

Record = TokenRecord
"""(key, token or -1, finish reason or None, error or None)"""

Address = tuple[str, int]


def new_authkey() -> bytes:
    return secrets.token_bytes(32)


class Inlet:
    """The ingress's end: accepts engines' connections and hands each message to `on_message` from
    a reader thread (the receiver hops to its event loop itself); `on_lost` when a connection ends."""

    def __init__(
        self,
        host: str,
        on_message: Callable[[Link, list[Record]], None],
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
                self.on_message(link, conn.recv())
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

    def submit(self, key: int, prompt_ids: list[int], params: GenerationParams, admission: Admission | None) -> bool:
        """Send a sequence to this engine; False if the link is gone. `admission`: as GPT2Engine.generate's."""
        return self._send(("submit", key, prompt_ids, params, admission))

    def cancel(self, key: int) -> None:
        self._send(("cancel", key))

    def _send(self, message: tuple) -> bool:
        if self.closed:
            return False
        try:
            with self._lock:
                self.conn.send(message)
            return True
        except OSError:
            self.closed = True  # the reader sees the end too and fails what is left
            return False


class Outlet:
    """The engine's end of one ingress's link: records gathered during a step, sent as one message.

    The engine's token sink (engine/requests.py: TokenSink): `send` runs on the engine's thread once
    per step. A link that fails (its ingress is gone) is closed, and `on_cancel` gets the engine id of
    each of its sequences, so the engine frees their slots.
    """

    def __init__(
        self,
        address: Address,
        authkey: bytes,
        on_cancel: Callable[[int], None],
        on_submit: Callable[[Outlet, int, list[int], GenerationParams, int | None], None] | None = None,
    ) -> None:
        self.address = address
        self.conn = Client(tuple(address), family="AF_INET", authkey=authkey)
        # Small messages, one per step: Nagle's delay would hold each for the previous one's ACK.
        _no_delay(self.conn)
        self.on_cancel, self.on_submit = on_cancel, on_submit
        self._send_lock = threading.Lock()  # the engine's thread sends steps, the reader refusals
        # key -> the engine's request id (None for the moment it is being submitted), for cancels
        self.engine_ids: dict[int, int | None] = {}
        self.pending: list[Record] = []
        self.closed = False
        self._reader = threading.Thread(target=self._read, name="gpt2-outlet-reader", daemon=True)
        self._reader.start()

    def add(self, record: Record) -> None:
        self.pending.append(record)
        if record[2] is not None:
            self.engine_ids.pop(record[0], None)

    def send(self) -> bool:
        """Send what the step gathered; False if the link is gone (its sequences are cancelled)."""
        if not self.pending or self.closed:
            self.pending.clear()
            return not self.closed
        records, self.pending = self.pending, []
        return self.send_now(records)

    def send_now(self, records: list[Record]) -> bool:
        try:
            with self._send_lock:
                self.conn.send(records)
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
                command, key, *args = self.conn.recv()
                if command == "submit" and self.on_submit is not None:
                    self.on_submit(self, key, *args)
                elif command == "cancel" and self.engine_ids.get(key) is not None:
                    self.on_cancel(self.engine_ids.pop(key))
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


def _no_delay(conn: Connection) -> None:
    sock = socket.socket(fileno=conn.fileno())
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    finally:
        sock.detach()  # the fd stays the connection's
