"""The engine in a child process (engine/process.py): the same tokens as in process, events per step,
cancel, validation in the parent, a child that dies or whose parent dies, and Serve with `engine_process`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

import test_serve
from gpt2_platform import checkpoint
from gpt2_platform.engine.engine import Engine, EngineConfig, EngineDeadError, Event, GenerationParams
from gpt2_platform.engine.process import EngineProcess, EngineStartError
from gpt2_platform.engine.sampling import SamplingParams
from gpt2_platform.tokenizer import load_tokenizer
from test_serve import _free_port, complete, sse_events, wait_until

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


def run_to_end(engine: Engine | EngineProcess, prompts: list[list[int]], params: GenerationParams) -> list[list[Event]]:
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
def engine_process(model_dir: Path, batches: list[int]) -> Iterator[EngineProcess]:
    engine = EngineProcess(str(model_dir), str(model_dir), CONFIG).start()

    def deliver(batch: list[tuple[Callable[[Event], None], Event]]) -> None:
        batches.append(len(batch))
        for on_event, event in batch:
            on_event(event)

    engine.deliver_in_batches(deliver)
    yield engine
    engine.shutdown()


def test_greedy_tokens_and_text_equal_an_in_process_engine(engine_process, model_dir):
    tokenizer = load_tokenizer(str(model_dir))
    local = Engine(checkpoint.load_pretrained(str(model_dir)), tokenizer, CONFIG).start(warmup=False)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    try:
        expected = run_to_end(local, prompts, greedy(40))
    finally:
        local.shutdown()
    got = run_to_end(engine_process, prompts, greedy(40))
    for ours, theirs in zip(got, expected, strict=True):
        assert [t for e in ours for t in e.token_ids] == [t for e in theirs for t in e.token_ids]
        assert "".join(e.text for e in ours) == "".join(e.text for e in theirs)
        assert ours[-1].finish_reason == "length" and ours[-1].completion_tokens == 40
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
    assert len(batches) >= 30 and max(batches) == 1, f"not one message per step: {batches}"
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


def test_a_bad_request_is_refused_in_the_parent(engine_process, monkeypatch):
    sent = []
    monkeypatch.setattr(engine_process, "_send", sent.append)
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


def test_a_killed_child_fails_pending_requests_and_health(model_dir):
    engine = EngineProcess(str(model_dir), str(model_dir), EngineConfig(max_batch_size=2, dtype="fp32"), warmup=False)
    engine.start()
    try:
        recorder = Recorder()
        ids = [engine.submit(list(b"keep going"), greedy(240), recorder) for _ in range(4)]
        assert wait_until(lambda: recorder.events, timeout_s=30), "no event before the kill"
        os.kill(engine.pid, signal.SIGKILL)
        recorder.wait(len(ids), timeout_s=10)
        last = [recorder.events[i][-1] for i in ids]
        assert all(e.finish_reason == "error" and "exit code -9" in e.error for e in last), last
        with pytest.raises(EngineDeadError, match="exit code -9"):
            engine.check_health()
        with pytest.raises(EngineDeadError):
            engine.submit([1], greedy(2), recorder)
    finally:
        engine.shutdown()


def test_shutdown_stops_the_child_and_a_bad_model_is_a_start_error(model_dir, tmp_path):
    engine = EngineProcess(str(model_dir), str(model_dir), CONFIG, warmup=False).start()
    pid = engine.pid
    engine.check_health()
    engine.shutdown()
    assert not pid_alive(pid)
    with pytest.raises(EngineDeadError):
        engine.check_health()
    with pytest.raises(EngineStartError, match="could not start its engine"):
        EngineProcess(str(tmp_path / "missing"), str(model_dir), CONFIG, warmup=False).start()


PARENT_SCRIPT = """
import sys, time
from gpt2_platform.engine.engine import EngineConfig
from gpt2_platform.engine.process import EngineProcess

if __name__ == "__main__":
    engine = EngineProcess(sys.argv[1], sys.argv[1], EngineConfig(max_batch_size=1, dtype="fp32"), warmup=False)
    print(engine.start().pid, flush=True)
    time.sleep(600)
"""


def test_the_child_exits_when_its_parent_is_killed(model_dir, tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(PARENT_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    parent = subprocess.Popen([sys.executable, str(script), str(model_dir)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        child_pid = int(parent.stdout.readline())
        assert pid_alive(child_pid)
        parent.kill()  # SIGKILL: no atexit, no shutdown(); only the closed pipe tells the child
        parent.wait(timeout=10)
        assert wait_until(lambda: not pid_alive(child_pid), timeout_s=20), "the engine process outlived its parent"
    finally:
        parent.kill()
        parent.wait(timeout=10)


# ---- in the Serve app -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def base_url(ray_cluster, model_dir: Path) -> Iterator[str]:
    from ray import serve

    from gpt2_platform.serve.app import gpt2_deployment

    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        args = {"model": str(model_dir), "engine": {"dtype": "fp32", "max_batch_size": 4}}
        serve.run(gpt2_deployment(args, ray_actor_options={"num_cpus": 1}), name="engine-process", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()


# TODO: Serve no longer runs the engine in a child process (args.engine_process is retired); this
# comes back against the engine deployment that Serve is being split into.
@pytest.mark.skip(reason="args.engine_process is retired; returns with the engine deployment")
def test_serve_with_engine_process_completes_and_streams(base_url):
    request = {"prompt": "carol has 4 pens.", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=base_url, timeout=60) as client:
        assert client.get("/health").json()["status"] == "ok"
        expected = complete(client, **request)["choices"][0]["text"]
        assert len(expected) == 24
        with client.stream("POST", "/v1/completions", json={**request, "stream": True}) as response:
            assert response.status_code == 200
            events = sse_events(response)
        # The engine's counters come from the child (at most 0.1 s old).
        assert wait_until(lambda: client.get("/v1/engine/stats").json()["generated_tokens"] >= 48, timeout_s=5)
    chunks = [e for e in events[:-1] if e["choices"]]
    assert events[-1] == "[DONE]" and len(chunks) > 1
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected
