"""The engine deployment as an ingress replica sees it: the engine interface (engine/protocol.py), over Serve
and token links.

Each engine that Serve routes one of this replica's `connect` calls to (every few seconds, so engines Serve
adds are found) opens a token link to it (engine/link.py); a sequence goes over the link to the engine this
replica has fewest sequences on, and its tokens come back on it, turned into text by the output processor
every client runs (engine/output.py), on the replica's event loop. Before any link is up (a new replica's
first requests), a sequence goes as one Serve call (GPT2Engine.generate), which also brings a link up.

Failures: a link that drops (the engine's process died) or a call that fails (its replica died)
ends the sequences it carried with an "error" event at once. Its error says what happened, not what
to do: the server that turns it into a 503 adds "retry the request" (serve/app.py). From then on `check_health` raises
(the server answers 503 with Retry-After) until an engine answers a ping again, so new requests
are refused promptly instead of waiting in Serve's queue for a replica that is still starting.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import ray
from ray.serve.handle import DeploymentHandle, DeploymentResponse
from transformers import PreTrainedTokenizerBase

from gpt2_platform.engine.admission import Admission
from gpt2_platform.engine.detokenize import ByteTable
from gpt2_platform.engine.link import Inlet, Link
from gpt2_platform.engine.messages import DELTA, LinkTarget, StepOutput, SubmitRequest
from gpt2_platform.engine.output import OutputProcessor, TextStream
from gpt2_platform.engine.requests import EngineDeadError, Event, GenerationParams, validate_request

logger = logging.getLogger(__name__)

# How long a sequence whose call has returned may wait for its last tokens on the link (the two
# travel separately), and how often a replica that saw the engine fail asks whether it is back.
_LINK_GRACE_S = 5.0
_PING_INTERVAL_S = 0.5
_PING_TIMEOUT_S = 2.0

# How often this replica asks Serve to route it a `connect` call: an engine that Serve adds (autoscaling,
# a replacement) is found within about this long (Serve picks one of two engines per call at random).
_CONNECT_INTERVAL_S = 2.0


class _Remote(TextStream):
    """A sequence's stream, with where it went: its Serve call or its link, and, for a link, what went over it
    (sent again to another engine if its engine is lost before the first token, when nothing of it has
    reached the client)."""

    __slots__ = ("response", "link", "sent")

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.response: DeploymentResponse | None = None
        self.link: Link | None = None
        self.sent: SubmitRequest | None = None


class RemoteEngine(OutputProcessor):
    def __init__(
        self,
        handle: DeploymentHandle,
        tokenizer: PreTrainedTokenizerBase,
        max_seq_len: int,
        vocab_size: int,
        admission: Callable[[], Admission],
    ) -> None:
        """`admission()`: what an engine is asked to take a new request under (engine/admission.py; the
        server's live limits decide it)."""
        super().__init__(tokenizer, ByteTable.of(tokenizer), tokenizer.eos_token_id)
        self.handle = handle
        self.max_seq_len, self.vocab_size, self.admission = max_seq_len, vocab_size, admission
        self._sequences: dict[int, _Remote] = self.streams  # type: ignore[assignment]  # open() makes _Remotes
        self._unlinked: set[int] = set()  # sequences sent as a Serve call, until tokens come on a link
        self._loop: asyncio.AbstractEventLoop | None = None
        self._down: str | None = None  # why the engine is thought unavailable; None: serving
        self._pinging = False
        self._links: list[Link] = []  # engines that have connected, and are still connected
        self._turn = 0  # where the next pick among equally loaded links starts
        self._connecting: asyncio.Task | None = None
        self.inlet = Inlet(ray.util.get_node_ip_address(), self._from_link, self._link_lost, self._link_up)
        try:  # Serve builds a replica on its event loop: bring links up now, not at the first request
            self._start_connecting(asyncio.get_running_loop())
        except RuntimeError:  # no loop running here: the first submit starts it
            pass

    def _start_connecting(self, loop: asyncio.AbstractEventLoop) -> asyncio.AbstractEventLoop:
        """Ask Serve to connect engines to this replica from now on (once), on `loop`; returns the loop this
        replica's sequences run on (the first one given).

        Started when the replica is built, so its first requests find a link: a sequence sent before any
        link is up goes as a Serve call, which costs the engine's replica milliseconds of host time.
        """
        self._loop = self._loop or loop
        if self._connecting is None:
            self._connecting = self._loop.create_task(self._keep_connecting())
        return self._loop

    # ---- the engine interface ----------------------------------------------------------------
    def check_health(self) -> None:
        if self._down is not None:
            raise EngineDeadError(f"the engine is unavailable ({self._down}); it is being restarted")
        if not self.inlet.alive():
            raise EngineDeadError("this replica's token link stopped")

    def validate(self, prompt_ids: list[int], params: GenerationParams) -> None:
        validate_request(prompt_ids, params, self.max_seq_len, self.vocab_size)

    def submit(
        self,
        prompt_ids: list[int],
        params: GenerationParams,
        on_event: Callable[[Event], None],
        incremental_text: bool = True,
        request_size: int = 1,
    ) -> int:
        """Send one sequence to an engine; `on_event` gets its events on this event loop.

        `request_size`: the sequences of one request are submitted together, the first with their
        number and the rest with 0. The engine refuses the request at its first sequence unless it
        is idle or has room for all of them; the rest are never refused, so a request runs whole or
        not at all, and one larger than the whole bound still runs on an idle engine."""
        loop = self._start_connecting(asyncio.get_running_loop())
        self.check_health()
        self.validate(prompt_ids, params)
        key, sequence, engine_params = self.open(prompt_ids, params, on_event, incremental_text, stream_type=_Remote)
        assert isinstance(sequence, _Remote)
        admission = dataclasses.replace(self.admission(), size=request_size) if request_size else None
        request = SubmitRequest(key, list(prompt_ids), engine_params, DELTA, admission)
        link = self._least_loaded_link()
        if link is not None and link.submit(request):
            sequence.link, sequence.sent = link, request
            link.keys.add(key)
            return key
        # No link yet: through Serve, the tokens to this replica's link all the same.
        target = LinkTarget(self.inlet.address, self.inlet.authkey, key)
        sequence.response = self.handle.generate.remote(request._replace(link=target))
        self._unlinked.add(key)
        loop.create_task(self._watch(key, sequence))
        return key

    def _least_loaded_link(self) -> Link | None:
        """The link with fewest of this replica's sequences; ties taken in turn, so that light load (one
        request at a time) spreads over every engine instead of always going to the first linked."""
        if not self._links:
            return None
        self._turn = (self._turn + 1) % len(self._links)
        rotated = self._links[self._turn :] + self._links[: self._turn]
        return min(rotated, key=lambda link: len(link.keys))

    def stats(self) -> dict[str, Any]:
        """What this replica has in flight, and over how many token links; the engines' own counters come
        from `engine_stats`."""
        return {"in_flight": len(self._sequences), "links": len(self._links)}

    async def engine_stats(self) -> dict[str, Any]:
        return await self.handle.stats.remote()

    def shutdown(self) -> None:
        if self._connecting is not None:
            self._connecting.cancel()
        self.inlet.close()

    # ---- tokens in ---------------------------------------------------------------------------
    def _from_link(self, link: Link, output: StepOutput) -> None:
        """On the link's reader thread: hop to the event loop once per message (one per engine step)."""
        loop = self._loop
        assert loop is not None  # a message carries tokens of sequences submitted here, and submit set the loop
        loop.call_soon_threadsafe(self._take, link, output)

    def _take(self, link: Link, output: StepOutput) -> None:
        """On the event loop: a link's step, its sequences sent as Serve calls now known to be on it."""
        if self._unlinked:
            for key in self._unlinked.intersection(output.keys):
                self._unlinked.discard(key)
                sequence = self._sequences.get(key)
                if sequence is not None and sequence.link is None:
                    sequence.link = link
                    link.keys.add(key)
        self.take(output)

    def _ended(self, key: int, stream: TextStream, stopped_here: bool) -> None:
        assert isinstance(stream, _Remote)
        if stream.link is not None:
            stream.link.keys.discard(key)
        self._unlinked.discard(key)
        super()._ended(key, stream, stopped_here)

    def _stop(self, key: int, stream: TextStream) -> None:
        """Tell the engine a sequence is over here: on its link (within a step) and by cancelling its call."""
        assert isinstance(stream, _Remote)
        self._unlinked.discard(key)
        if stream.link is not None:
            stream.link.keys.discard(key)
            stream.link.cancel(key)
        if stream.response is not None:
            stream.response.cancel()

    # ---- links ---------------------------------------------------------------------------------
    def _link_up(self, link: Link) -> None:
        """On the link's reader thread, once the engine's connection is authenticated."""
        loop = self._loop
        if loop is not None:
            loop.call_soon_threadsafe(self._links.append, link)
        else:  # no request yet, so no event loop known: nothing else touches the list meanwhile
            self._links.append(link)

    async def _keep_connecting(self) -> None:
        """Ask Serve, now and every few seconds, to have an engine connect to this replica."""
        while True:
            try:
                await self.handle.connect.remote(self.inlet.address, self.inlet.authkey)
            except Exception as error:  # no engine running right now; the next round asks again
                logger.debug("connect call failed: %r", error)
            await asyncio.sleep(_CONNECT_INTERVAL_S)

    # ---- failures ----------------------------------------------------------------------------
    async def _watch(self, key: int, sequence: _Remote) -> None:
        """Wait for the sequence's call; a refusal or a failure ends it here."""
        assert sequence.response is not None
        try:
            result = await sequence.response
        except asyncio.CancelledError:
            return
        except Exception as error:  # the replica died, or Serve could not reach one
            if self._sequences.get(key) is not sequence:
                return  # finished (or cancelled) already; the call's end is only its echo
            if not self._links:
                self._engine_failed(f"{type(error).__name__}: {error}".splitlines()[0])
            result = {"error": f"the engine failed ({type(error).__name__})"}
        if self._sequences.get(key) is not sequence:
            return
        if "refused" in result:
            self.end(key, "refused", f"the engine is busy ({result['refused']})")
        elif result.get("error") and result.get("finish_reason") in (None, "error"):
            self.end(key, "error", result["error"])
        else:  # it ended; its last tokens may still be on their way over the link
            asyncio.get_running_loop().call_later(_LINK_GRACE_S, self._expire, key, sequence)

    def _expire(self, key: int, sequence: _Remote) -> None:
        if self._sequences.get(key) is sequence:
            logger.error("sequence %d ended in the engine but its last tokens never arrived", key)
            self.end(key, "error", "the engine's output for this sequence was lost")

    def _link_lost(self, link: Link) -> None:
        """On the reader thread, when an engine's connection ends: its sequences fail (on the loop)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._fail_link, link)

    def _fail_link(self, link: Link) -> None:
        if link in self._links:
            self._links.remove(link)
        lost = [(key, sequence) for key in list(link.keys) if (sequence := self._sequences.get(key)) is not None]
        failed = [(key, sequence) for key, sequence in lost if not self._send_again(key, sequence)]
        if failed and not self._links:  # with another engine still linked, new requests go there
            self._engine_failed("its process exited")
        for key, _ in failed:
            self.end(key, "error", "the engine's process exited")

    def _send_again(self, key: int, sequence: _Remote) -> bool:
        """Move a sequence whose engine was lost before its first token to another linked engine, never
        refused (it was admitted once): a request that met a dying engine, or a node lost, in that window
        still succeeds. One with tokens already out is not: they may have reached the client."""
        link = self._least_loaded_link()
        if link is None or sequence.sent is None or sequence.output.generated:
            return False
        if not link.submit(sequence.sent._replace(admission=None)):
            return False
        sequence.link = link
        link.keys.add(key)
        logger.info("sequence %d sent again to another engine: its engine was lost before its first token", key)
        return True

    def _engine_failed(self, why: str) -> None:
        if self._down is None:
            logger.error("engine failed (%s): refusing requests until an engine answers again", why)
            self._down = why
        if not self._pinging and self._loop is not None:
            self._pinging = True
            self._loop.create_task(self._ping_until_back())

    async def _ping_until_back(self) -> None:
        try:
            while True:
                await asyncio.sleep(_PING_INTERVAL_S)
                try:
                    await asyncio.wait_for(self.handle.ping.remote(), _PING_TIMEOUT_S)
                except Exception as error:  # timed out, or no engine yet
                    logger.debug("engine not back yet: %r", error)
                    continue
                logger.info("an engine answers again after %s", self._down)
                self._down = None
                return
        finally:
            self._pinging = False
