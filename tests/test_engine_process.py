"""The engine in a child process (engine/process.py): the same tokens as in process, events per step,
cancel, validation in the parent, a child that dies or whose parent dies, and the token link to an ingress.

The child makes no text: its client (engine/local.py) makes it in this process (helpers_engine_process.py).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import test_serve
from gpt2_platform import checkpoint
from gpt2_platform.engine.admission import Admission
from gpt2_platform.engine.engine import Engine, EngineConfig, EngineDeadError, Event, GenerationParams
from gpt2_platform.engine.link import Inlet, Link
from gpt2_platform.engine.local import EngineClient, LocalEngine
from gpt2_platform.engine.messages import FINAL_ONLY, LinkTarget, StepOutput, SubmitRequest
from gpt2_platform.engine.process import EngineProcess, EngineStartError
from gpt2_platform.engine.sampling import SamplingParams
from gpt2_platform.tokenizer import load_tokenizer
from helpers_engine_process import OWN_KEYS, CoreRows, process_client
from test_serve import wait_until

model_dir = test_serve.model_dir  # the fixture: a tiny model trained to write ASCII, with the byte tokenizer

CONFIG = EngineConfig(max_batch_size=4, max_seq_len=128, dtype="fp32")
PROMPTS = ["alice has 3 apples.", "bob", "the quick brown fox jumps over the lazy dog and", "now carol has 12"]


def greedy(max_tokens: int) -> GenerationParams:
    return GenerationParams(max_tokens=max_tokens, ignore_eos=True, sampling=SamplingParams(temperature=0.0))


class Recorder:
    """Events of many requests by id, with a wait for their last ones."""

    def __init__(self) -> None:
        self.events: dict[int, list[Event]] = {}
        self.finished = threading.Semaphore(0)

    def __call__(self, event: Event) -> None:
        self.events.setdefault(event.request_id, []).append(event)
        if event.finished:
            self.finished.release()

    def wait(self, count: int, timeout_s: float = 30) -> None:
        for _ in range(count):
            assert self.finished.acquire(timeout=timeout_s), "a request did not finish"


def run_to_end(engine: EngineClient, prompts: list[list[int]], params: GenerationParams) -> list[list[Event]]:
    recorder = Recorder()
    ids = [engine.submit(prompt, params, recorder) for prompt in prompts]
    recorder.wait(len(ids))
    return [recorder.events[i] for i in ids]


def pid_alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie waiting for a reaper counts as gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status


@pytest.fixture(scope="module")
def batches() -> list[int]:
    """The number of events in each message the module's engine process delivered."""
    return []


@pytest.fixture(scope="module")
def engine_process(model_dir: Path, batches: list[int]) -> Iterator[EngineClient]:
    engine = process_client(str(model_dir), str(model_dir), CONFIG)

    def deliver(batch: list[tuple[Callable[[Event], None], Event]]) -> None:
        batches.append(len(batch))
        for on_event, event in batch:
            on_event(event)

    engine.deliver_in_batches(deliver)
    yield engine
    engine.shutdown()


def test_the_child_gets_a_byte_level_tokenizer_from_its_parent_and_never_imports_transformers(engine_process):
    """transformers' import was seconds of a replica's start; the parent loads the tokenizer meanwhile."""
    assert engine_process.core.child_imported_transformers is False


def word_level_tokenizer(directory: Path, eos: bool) -> Path:
    """A tokenizer that is not byte-level (words joined by spaces), saved as transformers saves one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "alice", "has", "apples", "<|endoftext|>"]
    backend = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece()
    special = {"eos_token": "<|endoftext|>"} if eos else {}
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", **special).save_pretrained(directory)
    return directory


def test_a_tokenizer_that_is_not_byte_level_is_loaded_by_the_child_and_a_bad_one_fails_at_once(model_dir, tmp_path):
    words = word_level_tokenizer(tmp_path / "words", eos=True)
    engine = process_client(str(model_dir), str(words), CONFIG, warmup=False)
    try:
        assert engine.core.child_imported_transformers is True
        [events] = run_to_end(engine, [[1, 2]], greedy(6))
        ids = [token for event in events for token in event.token_ids]
        assert len(ids) == 6 and all(token < 5 for token in ids)  # only the tokenizer's ids are sampled
        assert "".join(event.text for event in events) == load_tokenizer(str(words)).decode(ids)
    finally:
        engine.shutdown()
    no_eos = word_level_tokenizer(tmp_path / "no-eos", eos=False)
    started = time.monotonic()
    with pytest.raises(EngineStartError, match="has no EOS token"):
        EngineProcess(str(model_dir), str(no_eos), CONFIG, warmup=False).start()
    assert time.monotonic() - started < 20  # the child is not waited on: it had nothing to finish


def test_greedy_tokens_and_text_equal_an_in_process_engine(engine_process, model_dir):
    tokenizer = load_tokenizer(str(model_dir))
    local = Engine(checkpoint.load_pretrained(str(model_dir)), tokenizer, CONFIG).start(warmup=False)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    try:
        expected = run_to_end(LocalEngine(local), prompts, greedy(40))
    finally:
        local.shutdown()
    got = run_to_end(engine_process, prompts, greedy(40))
    for ours, theirs in zip(got, expected, strict=True):
        assert [t for e in ours for t in e.token_ids] == [t for e in theirs for t in e.token_ids]
        assert "".join(e.text for e in ours) == "".join(e.text for e in theirs)
        assert ours[-1].finish_reason == "length" and ours[-1].completion_tokens == 40
        assert all(e.logprobs is None for e in ours)
    # Log-probabilities cross the process boundary with their tokens.
    (with_logprobs,) = run_to_end(engine_process, prompts[:1], dataclasses.replace(greedy(6), logprobs=3))
    tokens = [t for e in with_logprobs for t in e.token_ids]
    logprobs = [lp for e in with_logprobs for lp in e.logprobs]
    assert len(logprobs) == len(tokens) == 6
    assert all(lp <= 0 and len(top) == 3 and top[0][0] == t for t, (lp, top) in zip(tokens, logprobs, strict=True))
    # The child reports its counters at most every 0.1 s.
    assert wait_until(lambda: engine_process.stats()["prompt_tokens"] >= sum(map(len, prompts)), timeout_s=2)


def test_streamed_events_come_one_step_at_a_time_and_in_order(engine_process, batches):
    batches.clear()
    arrivals: list[tuple[float, Event]] = []
    done = threading.Event()

    def on_event(event: Event) -> None:
        arrivals.append((time.perf_counter(), event))
        if event.finished:
            done.set()

    engine_process.submit(list(b"carol has 4 pens."), greedy(60), on_event)
    assert done.wait(30)
    events = [event for _, event in arrivals]
    assert [len(e.token_ids) for e in events] == [1] * 60, "one event per token"
    assert [e.finished for e in events] == [False] * 59 + [True]
    # The prefill's token comes with the first decode step's: that step starts on the device from the
    # prefill's output before the host has read it.
    assert batches[0] == 2 and len(batches) == 59 and max(batches[1:]) == 1, f"not one message per step: {batches}"
    assert arrivals[-1][0] > arrivals[0][0]


def test_cancel_frees_a_running_slot_and_ends_a_waiting_request_at_once(engine_process):
    recorder, all_started = Recorder(), threading.Event()

    def on_event(event: Event) -> None:
        recorder(event)
        if len(recorder.events) == 4:
            all_started.set()

    # Each long request takes ~0.2 s on CPU: the checks below must come well within that.
    long_ids = [engine_process.submit(list(b"a long story"), greedy(110), on_event) for _ in range(4)]
    assert all_started.wait(30), "the 4 slots did not fill"
    short_id, dropped_id = (engine_process.submit(list(b"short"), greedy(3), recorder) for _ in range(2))
    engine_process.cancel(dropped_id)  # waiting: no slot to free, it ends here and now
    assert [(e.finish_reason, e.token_ids) for e in recorder.events[dropped_id]] == [("abort", [])]
    assert engine_process.stats()["running"] + engine_process.stats()["waiting"] == 5
    engine_process.cancel(long_ids[0])
    recorder.wait(3)
    assert recorder.events[long_ids[0]][-1].finish_reason == "abort"
    assert recorder.events[short_id][-1].finish_reason == "length"
    assert not any(recorder.events[i][-1].finished for i in long_ids[1:]), (
        "the waiting request should have taken the cancelled one's slot, not waited for the others"
    )
    for request_id in long_ids[1:]:
        engine_process.cancel(request_id)
    recorder.wait(3)
    assert engine_process.stats()["running"] == engine_process.stats()["waiting"] == 0


def test_a_final_only_request_gets_one_event_with_every_token_and_a_refusal_comes_as_an_end(engine_process):
    """output_kind "final": one event at the end, the deltas' tokens in order (quiet in the engine, or gathered
    here where it asked for log-probabilities); an admission the engine cannot meet ends it "refused"."""
    [deltas] = run_to_end(engine_process, [list(b"bob")], greedy(12))
    for params in (greedy(12), dataclasses.replace(greedy(12), logprobs=2)):
        recorder = Recorder()
        engine_process.submit(list(b"bob"), params, recorder, output_kind=FINAL_ONLY)
        recorder.wait(1)
        [[final]] = recorder.events.values()
        assert final.token_ids == [t for e in deltas for t in e.token_ids] and final.finish_reason == "length"
        assert final.completion_tokens == 12 and final.prompt_tokens == 3
        assert (final.logprobs is None) == (params.logprobs is None)
        assert params.logprobs is None or len(final.logprobs) == 12
    # Busy: 4 slots full of long sequences, and no queue allowed.
    recorder = Recorder()
    long_ids = [engine_process.submit(list(b"a long story"), greedy(110), recorder) for _ in range(4)]
    assert wait_until(lambda: len(recorder.events) == 4, timeout_s=30)
    rows = CoreRows(engine_process)
    try:
        admission = Admission(max_waiting=0, max_wait_s=0.0)
        engine_process.core.submit(SubmitRequest(OWN_KEYS, list(b"x"), greedy(2), admission=admission))
        assert wait_until(lambda: rows.ended(OWN_KEYS), timeout_s=30)
    finally:
        rows.close()
    [(token, (reason, error, _), _)] = rows.rows[OWN_KEYS]
    assert token == -1 and reason == "refused" and "retry after" in error
    for request_id in long_ids:
        engine_process.cancel(request_id)
    recorder.wait(4)


def test_a_bad_request_is_refused_in_the_parent(engine_process, monkeypatch):
    sent = []
    monkeypatch.setattr(engine_process.core, "_send", sent.append)
    cases = [
        ([], greedy(4), "empty"),
        ([1, 300], greedy(4), "vocabulary"),
        ([1] * 100, greedy(40), "context of 128"),
        ([1], GenerationParams(max_tokens=0), "max_tokens"),
    ]
    for prompt, params, message in cases:
        with pytest.raises(ValueError, match=message):
            engine_process.submit(prompt, params, lambda event: None)
    assert sent == [] and engine_process.stats()["running"] == 0


def test_the_process_is_titled_as_the_engine_of_its_model(engine_process, model_dir):
    """`ps` shows what it is, not `python -c import sys ...` (bench/processes.py reads the first word)."""
    words = Path(f"/proc/{engine_process.core.pid}/cmdline").read_bytes().split(b"\0")
    assert [word.decode() for word in words if word] == [f"gpt2-engine {model_dir}"]


def test_a_killed_child_fails_pending_requests_and_health(model_dir):
    exits: list[tuple[float, str]] = []
    engine = process_client(
        str(model_dir),
        str(model_dir),
        EngineConfig(max_batch_size=2, dtype="fp32"),
        warmup=False,
        on_exit=lambda why: exits.append((time.monotonic(), why)),
    )
    try:
        recorder = Recorder()
        ids = [engine.submit(list(b"keep going"), greedy(240), recorder) for _ in range(4)]
        assert wait_until(lambda: recorder.events, timeout_s=30), "no event before the kill"
        killed = time.monotonic()
        os.kill(engine.core.pid, signal.SIGKILL)
        recorder.wait(len(ids), timeout_s=10)
        last = [recorder.events[i][-1] for i in ids]
        assert all(e.finish_reason == "error" and "exit code -9" in e.error for e in last), last
        # The owner hears once, at once (the pipe's EOF), after the pending requests had their errors.
        assert wait_until(lambda: exits, timeout_s=5)
        [(heard, why)] = exits
        assert heard - killed < 2 and "exit code -9" in why
        with pytest.raises(EngineDeadError, match="exit code -9"):
            engine.check_health()
        with pytest.raises(EngineDeadError):
            engine.submit([1], greedy(2), recorder)
    finally:
        engine.shutdown()


def test_shutdown_stops_the_child_and_a_bad_model_is_a_start_error(model_dir, tmp_path, capfd):
    exits: list[str] = []
    engine = EngineProcess(str(model_dir), str(model_dir), CONFIG, warmup=False, on_exit=exits.append).start()
    pid = engine.pid
    engine.check_health()
    engine.shutdown()
    assert not pid_alive(pid)
    assert exits == []  # asked to stop: not an exit its owner must act on
    # It exits at once and cleanly, without an interpreter shutdown's leak reports (Triton's bindings
    # printed dozens of lines into the replica's log).
    assert engine._process.returncode == 0
    assert "leaked" not in capfd.readouterr().err
    with pytest.raises(EngineDeadError):
        engine.check_health()
    with pytest.raises(EngineStartError, match="could not start its engine"):
        EngineProcess(str(tmp_path / "missing"), str(model_dir), CONFIG, warmup=False).start()


PARENT_SCRIPT = """
import os, sys, time
from gpt2_platform.engine.engine import EngineConfig
from gpt2_platform.engine.process import EngineProcess

with open(sys.argv[2], "a") as ran:  # each process that runs this module, as a Ray worker's script would be
    ran.write(f"{os.getpid()}\\n")

if __name__ == "__main__":
    engine = EngineProcess(sys.argv[1], sys.argv[1], EngineConfig(max_batch_size=1, dtype="fp32"), warmup=False)
    print(engine.start().pid, flush=True)
    time.sleep(600)
"""


def test_the_child_exits_when_its_parent_is_killed_and_never_runs_its_parents_script(model_dir, tmp_path):
    """A Serve replica's main module is Ray's worker script: the engine process must not run it again (a
    spawned child would, as `__mp_main__`, and import all of Ray before its own start)."""
    script, ran = tmp_path / "parent.py", tmp_path / "ran"
    script.write_text(PARENT_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    parent = subprocess.Popen(
        [sys.executable, str(script), str(model_dir), str(ran)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        child_pid = int(parent.stdout.readline())
        assert pid_alive(child_pid)
        assert ran.read_text().split() == [str(parent.pid)]
        parent.kill()  # SIGKILL: no atexit, no shutdown(); only the closed pipe tells the child
        parent.wait(timeout=10)
        assert wait_until(lambda: not pid_alive(child_pid), timeout_s=20), "the engine process outlived its parent"
    finally:
        parent.kill()
        parent.wait(timeout=10)


# ---- the token link: tokens straight to an ingress, cancels straight back ------------------------------
class Ingress:
    """An ingress's end of the link as RemoteEngine holds it, gathering what each message brings."""

    def __init__(self) -> None:
        self.records: list[tuple] = []
        self.messages = 0
        self.lost = threading.Event()
        self.links: list[Link] = []
        self.inlet = Inlet("127.0.0.1", self._on_message, lambda link: self.lost.set())

    def _on_message(self, link: Link, output: StepOutput) -> None:
        """Each row of a step's output as a record: (key, token or -1, finish reason or None, error or None)."""
        if link not in self.links:
            self.links.append(link)
        self.messages += 1
        finished = output.finished or {}
        for row, (key, token) in enumerate(zip(output.keys, output.tokens, strict=True)):
            reason, error, _ = finished.get(row, (None, None, None))
            self.records.append((key, token, reason, error))

    def outlet(self, key: int) -> LinkTarget:
        return LinkTarget(self.inlet.address, self.inlet.authkey, key)


def test_tokens_go_over_the_link_one_message_per_step_and_the_parent_hears_only_the_end(engine_process, model_dir):
    ingress = Ingress()
    prompts = [list(b"alice has 3 apples."), list(b"bob")]
    rows = CoreRows(engine_process)
    try:
        for key, prompt in enumerate(prompts, start=1):
            engine_process.core.submit(SubmitRequest(OWN_KEYS + key, prompt, greedy(30), link=ingress.outlet(key)))
        assert wait_until(lambda: rows.ended(OWN_KEYS + 1) and rows.ended(OWN_KEYS + 2), timeout_s=30)
    finally:
        rows.close()
    assert wait_until(lambda: sum(1 for r in ingress.records if r[2] is not None) == 2, timeout_s=5)
    # The parent got each sequence's end with its count and no tokens; the ingress got the tokens.
    ends = [rows.rows[OWN_KEYS + key] for key in (1, 2)]
    assert all(len(end) == 1 and end[0][0] == -1 and end[0][1][0] == "length" for end in ends), ends
    assert sorted(end[0][1][2] for end in ends) == [30, 30]
    tokens = {key: [r[1] for r in ingress.records if r[0] == key] for key in (1, 2)}
    expected = run_to_end(
        LocalEngine(
            Engine(
                checkpoint.load_pretrained(str(model_dir)),
                load_tokenizer(str(model_dir)),
                EngineConfig(max_batch_size=4, dtype="fp32"),
            ).start(warmup=False)
        ),
        prompts,
        greedy(30),
    )
    for key, events in zip((1, 2), expected, strict=True):
        assert tokens[key] == [t for e in events for t in e.token_ids]
    # Both sequences' tokens of a step travel together: far fewer messages than tokens.
    assert ingress.messages < len(ingress.records) * 0.75, (ingress.messages, len(ingress.records))
    assert len(ingress.links) == 1  # one connection per engine and ingress, however many sequences
    ingress.inlet.close()


def test_a_cancel_on_the_link_frees_the_slot_and_a_wrong_key_is_refused(engine_process):
    ingress = Ingress()
    rows = CoreRows(engine_process)
    try:
        engine_process.core.submit(SubmitRequest(OWN_KEYS, list(b"a long story"), greedy(110), link=ingress.outlet(7)))
        # Cancel as soon as tokens come: polled every 0.1 s, the whole sequence (110 steps of a tiny model) once
        # finished before the cancel was sent.
        assert wait_until(lambda: ingress.records, timeout_s=30, interval_s=0.001)
        ingress.links[0].cancel(7)
        assert wait_until(lambda: rows.ended(OWN_KEYS), timeout_s=10)
    finally:
        rows.close()
    assert rows.rows[OWN_KEYS][-1][1][0] == "abort"
    assert len(ingress.records) < 110
    # A client that does not hold the ingress's key cannot feed it tokens.
    from multiprocessing.connection import AuthenticationError, Client

    with pytest.raises((AuthenticationError, EOFError, ConnectionError)):
        Client(ingress.inlet.address, family="AF_INET", authkey=b"not the key")
    ingress.inlet.close()
