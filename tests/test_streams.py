"""How one request's output reaches its HTTP response (serve/streams.py), over a real in-process engine.

`Choices` takes any engine of the interface (engine/protocol.py); the ingress gives it the engine
deployment (tested over HTTP in test_serve), and here the in-process engine's client (engine/local.py)
stands in for it.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import torch

from gpt2_platform.engine.config import EngineConfig
from gpt2_platform.engine.engine import Engine
from gpt2_platform.engine.local import LocalEngine
from gpt2_platform.engine.protocol import GenerationEngine
from gpt2_platform.engine.requests import GenerationParams
from gpt2_platform.engine.sampling import SamplingParams
from gpt2_platform.model import GPT2, preset
from gpt2_platform.serve.metrics import ServeMetrics
from gpt2_platform.serve.streams import Choices, Job
from gpt2_platform.tokenizer import byte_tokenizer

PROMPT = list(b"once upon a time")


@pytest.fixture(scope="module")
def engine(ray_cluster):
    torch.manual_seed(0)
    engine = Engine(GPT2(preset("tiny")).eval(), byte_tokenizer(), EngineConfig(max_batch_size=4, dtype="fp32"))
    yield engine.start(warmup=False)
    engine.shutdown()


@pytest.fixture(scope="module")
def metrics(ray_cluster):
    return ServeMetrics("test-streams")


def greedy(max_tokens: int) -> GenerationParams:
    return GenerationParams(max_tokens=max_tokens, ignore_eos=True, sampling=SamplingParams(temperature=0.0))


async def _updates(engine: Engine, metrics: ServeMetrics, jobs: list[Job], interval_s: float, limit: int | None = None):
    loop = asyncio.get_running_loop()

    def run_callbacks(batch: list) -> None:  # on the loop: one hop per engine step, as a server makes it
        for on_event, event in batch:
            on_event(event)

    client = LocalEngine(engine)
    client.deliver_in_batches(lambda batch: loop.call_soon_threadsafe(run_callbacks, batch))
    choices = Choices(client, jobs, metrics)
    assert await choices.started() is None
    batches = []
    async with contextlib.aclosing(choices.updates(interval_s)) as updates:
        async for batch in updates:
            batches.append(batch)
            if limit is not None and len(batches) >= limit:
                break
    return batches


def test_the_in_process_engines_client_meets_the_engine_interface(engine):
    assert isinstance(LocalEngine(engine), GenerationEngine)


def test_a_stop_string_cuts_the_text_and_ends_the_sequence_in_the_engine(engine, metrics):
    (whole,) = engine.generate([PROMPT], greedy(40))
    stop = whole.text[10:13]  # some three characters it writes, cut where they first appear
    params = GenerationParams(max_tokens=40, ignore_eos=True, stop=(stop,), sampling=SamplingParams(temperature=0))
    (expected,) = engine.generate([PROMPT], params)
    assert expected.text == whole.text[: whole.text.index(stop)] and expected.finish_reason == "stop"
    batches = asyncio.run(_updates(engine, metrics, [Job(PROMPT, params)], interval_s=0.0))
    updates = [update for batch in batches for update in batch]
    assert "".join(u.text for u in updates) == expected.text
    assert updates[-1].end is not None and updates[-1].end.finish_reason == "stop"
    assert asyncio.run(_wait_idle(engine)), "the engine ran on past the stop string"


def test_a_long_interval_packs_every_token_between_the_first_and_the_end(engine, metrics):
    (expected,) = engine.generate([PROMPT], greedy(48))
    batches = asyncio.run(_updates(engine, metrics, [Job(PROMPT, greedy(48))], interval_s=60.0))
    # The first token goes out at once (time to first token), the end at once; nothing between them waits
    # for the interval to pass, and no token is lost or repeated.
    assert len(batches) == 2, [len(b) for b in batches]
    updates = [update for batch in batches for update in batch]
    assert "".join(u.text for u in updates) == expected.text
    assert updates[-1].end is not None and updates[-1].end.finish_reason == "length"
    assert updates[-1].end.completion_tokens == 48


def test_no_interval_sends_tokens_as_they_come_and_choices_end_apart(engine, metrics):
    jobs = [Job(PROMPT, greedy(8)), Job(PROMPT, greedy(40))]
    batches = asyncio.run(_updates(engine, metrics, jobs, interval_s=0.0))
    assert len(batches) > 2
    ends = {u.index: u.end for batch in batches for u in batch if u.end is not None}
    assert sorted(ends) == [0, 1] and ends[0].completion_tokens == 8 and ends[1].completion_tokens == 40
    expected = engine.generate([PROMPT, PROMPT], [greedy(8), greedy(40)])
    for index in (0, 1):
        assert "".join(u.text for b in batches for u in b if u.index == index) == expected[index].text


def test_closing_the_updates_early_frees_the_slots(engine, metrics):
    before = engine.stats()["generated_tokens"]
    asyncio.run(_updates(engine, metrics, [Job(PROMPT, greedy(200)) for _ in range(3)], interval_s=0.0, limit=1))
    deadline = asyncio.run(_wait_idle(engine))
    assert deadline, engine.stats()
    assert engine.stats()["generated_tokens"] - before < 3 * 200 / 2, "the sequences ran on after the close"


async def _wait_idle(engine: Engine) -> bool:
    for _ in range(100):
        stats = engine.stats()
        if stats["running"] == 0 and stats["waiting"] == 0:
            return True
        await asyncio.sleep(0.05)
    return False
