"""The inference engine on CPU: exact greedy parity with transformers, continuous batching, seeds, stops."""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import threading
import time
from collections.abc import AsyncIterator

import pytest
import torch

from gpt2_platform import checkpoint, demo_data
from gpt2_platform.engine.engine import Engine, EngineConfig, EngineDeadError, GenerationParams
from gpt2_platform.engine.local import LocalEngine
from gpt2_platform.engine.messages import FINAL_ONLY, SubmitRequest
from gpt2_platform.engine.requests import Event
from gpt2_platform.engine.sampling import SamplingParams
from gpt2_platform.model import GPT2, preset
from gpt2_platform.tokenizer import byte_tokenizer
from gpt2_platform.train.config import OptimConfig
from gpt2_platform.train.step import TrainStep, build_optimizer, resolve_precision

PROMPTS = ["alice has 3 apples.", "bob", "the quick brown fox jumps over the lazy dog and", "now carol has 12"]


@pytest.fixture(scope="module")
def model() -> GPT2:
    """A tiny GPT-2 trained for a few seconds on the demo stories, so that it writes ASCII text."""
    torch.manual_seed(0)
    model = GPT2(preset("tiny"))
    device = torch.device("cpu")
    step = TrainStep(
        model, build_optimizer(model, OptimConfig(lr=5e-3), device), resolve_precision("fp32", device), device, 1.0
    )
    text = " ".join(demo_data.stories(400)).encode()
    tokens = torch.tensor(list(text[: 64 * 65 * 4]), dtype=torch.long).view(-1, 65)
    for i in range(60):
        batch = tokens[(i * 16) % len(tokens) :][:16]
        step([(batch[:, :-1], batch[:, 1:])], lr=5e-3)
    return model.eval()


@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer()


@pytest.fixture
def engine(model, tokenizer):
    engine = Engine(model, tokenizer, EngineConfig(max_batch_size=4, max_seq_len=128, dtype="fp32")).start()
    yield engine
    engine.shutdown()


def greedy(max_tokens: int, **kwargs) -> GenerationParams:
    return GenerationParams(max_tokens=max_tokens, ignore_eos=True, sampling=SamplingParams(temperature=0.0), **kwargs)


def test_greedy_output_equals_transformers_generate_for_prompts_of_different_lengths(
    engine, model, tokenizer, tmp_path
):
    from transformers import AutoModelForCausalLM

    checkpoint.save_pretrained(model, tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    ours = engine.generate(prompts, greedy(40))
    for prompt, completion in zip(prompts, ours, strict=True):
        with torch.no_grad():
            reference = hf.generate(
                torch.tensor([prompt]), max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0
            )[0, len(prompt) :].tolist()
        assert completion.token_ids == reference
        assert completion.finish_reason == "length" and completion.completion_tokens == 40
    assert engine.stats()["max_batch_size_seen"] == len(PROMPTS), "the prompts should have been decoded together"


def test_a_request_that_joins_a_running_batch_gets_the_tokens_it_gets_alone(engine, tokenizer):
    late = tokenizer("bob gives")["input_ids"]
    (alone,) = engine.generate([late], greedy(20))

    started = threading.Event()
    events = []

    def on_event(event):
        events.append(event)
        if len(events) == 5:
            started.set()

    LocalEngine(engine).submit(tokenizer(PROMPTS[2])["input_ids"], greedy(60), on_event)
    assert started.wait(30)
    steps_before = engine.stats()["steps"]
    (joined,) = engine.generate([late], greedy(20))
    assert joined.token_ids == alone.token_ids
    assert not events[-1].finished, "the long request was still running when the late one finished"
    assert engine.stats()["steps"] - steps_before < 40, "the late request did not wait for the batch to drain"
    assert engine.stats()["batch_sizes"].get(2, 0) > 0


def test_the_same_seed_gives_the_same_text_alone_and_in_a_batch(engine, tokenizer):
    sampled = GenerationParams(
        max_tokens=30, ignore_eos=True, sampling=SamplingParams(temperature=1.0, top_p=0.9, seed=7)
    )
    prompt = tokenizer("alice has")["input_ids"]
    (alone,) = engine.generate([prompt], sampled)
    others = [tokenizer(p)["input_ids"] for p in PROMPTS[:3]]
    other_params = [
        GenerationParams(max_tokens=30, sampling=SamplingParams(temperature=1.0, seed=s)) for s in (1, 2, 3)
    ]
    batch = engine.generate([*others, prompt], [*other_params, sampled])
    assert batch[-1].text == alone.text and batch[-1].seed == 7
    different = GenerationParams(max_tokens=30, ignore_eos=True, sampling=SamplingParams(temperature=1.0, seed=8))
    assert engine.generate([prompt], different)[0].token_ids != alone.token_ids


def test_an_unseeded_request_reports_the_seed_that_reproduces_it(engine, tokenizer):
    prompt = tokenizer("carol")["input_ids"]
    first = engine.generate(
        [prompt], GenerationParams(max_tokens=20, ignore_eos=True, sampling=SamplingParams(temperature=1.0))
    )[0]
    again = GenerationParams(max_tokens=20, ignore_eos=True, sampling=SamplingParams(temperature=1.0, seed=first.seed))
    assert engine.generate([prompt], again)[0].token_ids == first.token_ids


def test_stop_strings_end_the_text_before_the_stop(engine, tokenizer):
    prompt = tokenizer(PROMPTS[0])["input_ids"]
    (full,) = engine.generate([prompt], greedy(30))
    # A two-character stop string that first occurs a few characters in.
    stop = next(full.text[i : i + 2] for i in range(3, 25) if full.text.index(full.text[i : i + 2]) == i)
    before = engine.stats()["generated_tokens"]
    (stopped,) = engine.generate([prompt], greedy(60, stop=(stop,)))
    assert stopped.finish_reason == "stop"
    assert stopped.text == full.text[: full.text.index(stop)]
    # The engine makes no text: generate's consumer finds the stop string and cancels the sequence.
    assert engine.stats()["generated_tokens"] - before < 40


def test_eos_ends_a_request_unless_ignored(model, tokenizer):
    # Make every final hidden state the same vector b, and EOS's embedding 10 b: EOS always wins.
    biased = GPT2(model.config)
    biased.load_state_dict(model.state_dict())
    with torch.no_grad():
        biased.transformer.ln_f.weight.zero_()
        biased.transformer.ln_f.bias.copy_(torch.randn(model.config.n_embd))
        biased.transformer.wte.weight[tokenizer.eos_token_id] = 10 * biased.transformer.ln_f.bias
    engine = Engine(biased, tokenizer, EngineConfig(max_batch_size=2, max_seq_len=64, dtype="fp32")).start()
    try:
        prompt = tokenizer("alice")["input_ids"]
        (stopped,) = engine.generate([prompt], GenerationParams(max_tokens=10, sampling=SamplingParams(temperature=0)))
        assert stopped.finish_reason == "stop" and stopped.text == "" and stopped.completion_tokens == 1
        (ignored,) = engine.generate([prompt], greedy(10))
        assert ignored.finish_reason == "length" and ignored.completion_tokens == 10
    finally:
        engine.shutdown()


def test_a_compiled_decode_step_generates_what_the_eager_one_does(model, tokenizer):
    from torch._dynamo.utils import counters

    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS[:3]]
    outputs, graphs = {}, {}
    for compiled in (False, True):
        config = EngineConfig(max_batch_size=4, max_seq_len=64, dtype="fp32", compile=compiled)
        engine = Engine(model, tokenizer, config).start(warmup=False)  # compiles on first use
        before = counters["stats"]["unique_graphs"]
        try:
            outputs[compiled] = [c.token_ids for c in engine.generate(prompts, greedy(12))]
        finally:
            engine.shutdown()
        graphs[compiled] = counters["stats"]["unique_graphs"] - before
    # The option reaches the step: dynamo compiled graphs for the compiled engine, none for the other.
    assert graphs[False] == 0 and graphs[True] > 0, graphs
    assert outputs[True] == outputs[False]


def test_compile_null_compiles_the_modules_step_on_a_gpu_and_nothing_else():
    # With our decode kernels only the token pick would compile: not worth its seconds at every start.
    from gpt2_platform.engine.engine import default_compile

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert default_compile(cuda, "torch")
    assert not default_compile(cuda, "triton")
    assert not default_compile(cpu, "torch") and not default_compile(cpu, "triton")


def test_ids_past_the_tokenizer_are_never_sampled_from_a_padded_vocabulary(tokenizer):
    # A vocabulary padded past the tokenizer (as 50304 pads 50257), with the padding ids made the likeliest.
    torch.manual_seed(0)
    config = dataclasses.replace(preset("tiny"), vocab_size=len(tokenizer) + 43)
    padded = GPT2(config).eval()
    with torch.no_grad():
        padded.transformer.ln_f.weight.zero_()
        padded.transformer.ln_f.bias.copy_(torch.randn(config.n_embd))
        padded.transformer.wte.weight[len(tokenizer) :] = 10 * padded.transformer.ln_f.bias
    engine = Engine(padded, tokenizer, EngineConfig(max_batch_size=2, max_seq_len=64, dtype="fp32")).start()
    try:
        prompt = tokenizer("alice")["input_ids"]
        sampled = GenerationParams(max_tokens=12, ignore_eos=True, sampling=SamplingParams(temperature=1.0, seed=3))
        for completion in engine.generate([prompt, prompt], [greedy(12), sampled]):
            assert completion.completion_tokens == 12
            assert max(completion.token_ids) < len(tokenizer), completion.token_ids
    finally:
        engine.shutdown()


async def stream(engine: Engine, prompt_ids: list[int], params: GenerationParams) -> AsyncIterator[Event]:
    """A request's events on asyncio as they come, through the in-process client; closing the iterator early
    cancels the request."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Event] = asyncio.Queue()
    client = LocalEngine(engine)
    request_id = client.submit(prompt_ids, params, lambda event: loop.call_soon_threadsafe(queue.put_nowait, event))
    finished = False
    try:
        while not finished:
            event = await queue.get()
            finished = event.finished
            yield event
    finally:
        if not finished:
            client.cancel(request_id)


def test_streaming_yields_text_deltas_and_a_disconnect_frees_the_slot(engine, tokenizer):
    prompt = tokenizer(PROMPTS[1])["input_ids"]
    (reference,) = engine.generate([prompt], greedy(12))

    async def consume(limit: int | None) -> list:
        events = []
        async for event in stream(engine, prompt, greedy(12 if limit is None else 100)):
            events.append(event)
            if limit is not None and len(events) == limit:
                break  # the client goes away
        return events

    events = asyncio.run(consume(None))
    assert "".join(e.text for e in events) == reference.text
    assert events[-1].finish_reason == "length" and sum(len(e.token_ids) for e in events) == 12

    asyncio.run(consume(3))
    deadline = time.monotonic() + 5
    while engine.stats()["running"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.stats()["running"] == 0, "the abandoned request still holds its slot"


def test_more_requests_than_slots_all_finish(engine, tokenizer):
    prompts = [tokenizer(f"request {i}")["input_ids"] for i in range(11)]
    results = engine.generate(prompts, greedy(8))
    assert all(r.completion_tokens == 8 for r in results)
    assert engine.stats()["max_batch_size_seen"] == 4


def test_sequences_that_end_unforeseen_and_those_taking_their_slots_get_what_they_get_alone(engine, tokenizer):
    # The engine launches step n+1 before it reads step n's tokens, so a sequence that a stop string
    # ends at step n still gets a step n+1, whose token must be dropped; the request that takes its
    # slot next must not see any of it. Stops end some requests early, at steps the engine cannot foresee.
    requests = [
        (tokenizer(f"{name} has")["input_ids"], greedy(max_tokens, stop=stop))
        for name, max_tokens, stop in [
            ("alice", 30, (" ",)),
            ("bob", 5, ()),
            ("carol", 30, ("a",)),
            ("dave", 12, ()),
            ("erin", 30, ("e", "s")),
            ("frank", 3, ()),
            ("grace", 30, (".",)),
            ("heidi", 20, ()),
            ("ivan", 30, ("o",)),
            ("judy", 9, ()),
        ]
    ]
    alone = [engine.generate([prompt], params)[0] for prompt, params in requests]
    assert any(r.finish_reason == "stop" for r in alone) and any(r.finish_reason == "length" for r in alone)
    together = engine.generate([prompt for prompt, _ in requests], [params for _, params in requests])
    assert [(r.token_ids, r.text, r.finish_reason) for r in together] == [
        (r.token_ids, r.text, r.finish_reason) for r in alone
    ]
    assert engine.stats()["max_batch_size_seen"] == 4


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([], greedy(4), "prompt is empty"),
        ([1] * 120, greedy(20), "over the context of 128"),
        ([1, 2], greedy(0), "max_tokens"),
        ([1, 999], greedy(4), "outside the vocabulary"),
        ([1, 2], {"temperature": -1}, "temperature"),
        ([1, 2], {"top_p": 0}, "top_p"),
        ([1, 2], {"top_k": -3}, "top_k"),
        ([1, 2], {"top_k": 2**63}, "top_k"),
    ],
)
def test_bad_requests_are_refused_with_a_reason(engine, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        if isinstance(params, dict):  # SamplingParams refuses bad values as it is built
            params = GenerationParams(sampling=SamplingParams(**params))
        engine.submit(SubmitRequest(0, prompt, params), RecordingSink())
    assert engine.stats()["waiting"] == 0


def test_a_dead_loop_fails_waiting_requests_and_health(model, tokenizer):
    engine = Engine(model, tokenizer, EngineConfig(max_batch_size=2, max_seq_len=64, dtype="fp32")).start(warmup=False)

    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    engine.runner.launch = broken
    (result,) = engine.generate([[1, 2, 3]], greedy(5))
    assert result.finish_reason == "error" and "device lost" in result.error
    with pytest.raises(EngineDeadError):
        engine.check_health()


def test_a_plain_sampled_request_is_the_same_beside_a_top_k_neighbour(engine, tokenizer):
    # Alone it runs in the sort-free "plain" mode; beside a top-k request the step filters every row.
    plain = GenerationParams(max_tokens=24, ignore_eos=True, sampling=SamplingParams(temperature=1.0, seed=11))
    prompt = tokenizer("dave has")["input_ids"]
    (alone,) = engine.generate([prompt], plain)
    neighbour = GenerationParams(
        max_tokens=24, ignore_eos=True, sampling=SamplingParams(temperature=1.0, top_k=5, seed=1)
    )
    together = engine.generate([tokenizer("erin")["input_ids"], prompt], [neighbour, plain])
    assert together[1].token_ids == alone.token_ids


def test_the_two_pass_argmax_picks_what_argmax_picks_ties_included():
    from gpt2_platform.engine.runner import argmax_in_blocks

    torch.manual_seed(0)
    logits = torch.randn(6, 50257).to(torch.bfloat16)  # bf16: many exact ties between blocks
    logits[1, 50256] = 100.0  # the max in the last, padded block
    logits[2, [7, 3000, 40000]] = 100.0  # tied across blocks: the first wins
    logits[3, [1030, 1025]] = 100.0  # tied within a block
    logits[4] = 0.0  # all tied
    expected = torch.argmax(logits.float(), dim=-1)
    assert argmax_in_blocks(logits).tolist() == expected.tolist()
    assert expected[1:5].tolist() == [50256, 7, 1025, 0]
    for block in (1, 7, 64, 100000):
        assert argmax_in_blocks(logits, block).tolist() == expected.tolist()


class RecordingSink:
    """A token sink as the token link's Outlet is one: records gathered per iteration, then sent."""

    def __init__(self) -> None:
        self.pending: list = []
        self.messages: list[list] = []

    def add(self, record: tuple, num_generated: int) -> None:
        self.pending.append(record)

    def send(self) -> bool:
        if self.pending:
            self.messages.append(self.pending)
            self.pending = []
        return True


def test_a_sinks_sequences_send_one_record_per_token_and_their_end_on_the_last(engine, tokenizer):
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS[:3]]
    lengths = [1, 2, 17]  # a first token that is also the last, and one that takes a decode step
    expected = [engine.generate([p], greedy(n))[0].token_ids for p, n in zip(prompts, lengths, strict=True)]
    sink = RecordingSink()
    for key, (prompt, n) in enumerate(zip(prompts, lengths, strict=True)):
        engine.submit(SubmitRequest(key, prompt, greedy(n)), sink)
    assert wait_until(lambda: sum(r[2] is not None for m in sink.messages for r in m) == 3, timeout_s=30)
    records = [r for message in sink.messages for r in message]
    for key, tokens in enumerate(expected):
        mine = [r for r in records if r[0] == key]
        assert [r[1] for r in mine] == tokens
        assert [r[2] for r in mine] == [None] * (len(tokens) - 1) + ["length"]
    # The prefill's first token and the first decode step's come together; after that, a message a step.
    assert max(sum(r[0] == 2 for r in message) for message in sink.messages) <= 2
    assert len([r for r in records if r[0] == 2]) == 17


def test_a_typed_request_gets_records_per_token_as_delta_and_in_one_run_at_its_end_as_final(engine, tokenizer):
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS[:2]]
    lengths = [1, 17]
    delta, final = RecordingSink(), RecordingSink()
    for key, (prompt, n) in enumerate(zip(prompts, lengths, strict=True)):
        engine.submit(SubmitRequest(key, prompt, greedy(n)), delta)
        engine.submit(SubmitRequest(key, prompt, greedy(n), FINAL_ONLY), final)
    for sink in (delta, final):
        assert wait_until(lambda s=sink: sum(r[2] is not None for m in s.messages for r in m) == 2, timeout_s=30)
    for key in range(2):
        streamed = [r for m in delta.messages for r in m if r[0] == key]
        (message,) = [m for m in final.messages if any(r[0] == key for r in m)]  # a final one's come together
        assert [r for r in message if r[0] == key] == streamed
        assert [r[2] for r in streamed] == [None] * (lengths[key] - 1) + ["length"]


def test_stats_split_a_first_tokens_wait_into_queue_and_prefill(engine, tokenizer):
    before = engine.stats()
    engine.generate([tokenizer(p)["input_ids"] for p in PROMPTS], greedy(3))
    after = engine.stats()
    assert after["first_tokens"] - before["first_tokens"] == len(PROMPTS)
    assert after["queue_s"] > before["queue_s"] and after["first_token_s"] > before["first_token_s"]


def wait_until(predicate, timeout_s: float, interval_s: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return bool(predicate())


def test_quiet_sequences_end_with_one_run_holding_what_a_streamed_one_gets(engine, tokenizer):
    # generate() submits quiet sequences (no stop strings): their tokens are taken in a step at a time
    # with numpy and they come in one run, at the end. Streamed ones go token by token through Python.
    # Both must see the same tokens, end the same way, and (decoded) give the same text.
    prompts = [tokenizer(f"{name} has")["input_ids"] for name in ("alice", "bob", "carol", "dave", "erin", "frank")]
    params = [greedy(n) for n in (7, 1, 30, 12, 3, 20)]

    client = LocalEngine(engine)

    def streamed(prompt, p):
        events, done = [], threading.Event()

        def on_event(event):
            events.append(event)
            if event.finished:
                done.set()

        client.submit(prompt, p, on_event)
        assert done.wait(60)
        return events

    loud = [streamed(prompt, p) for prompt, p in zip(prompts, params, strict=True)]
    quiet = engine.generate(prompts, params)
    for events, completion, p in zip(loud, quiet, params, strict=True):
        assert [t for e in events for t in e.token_ids] == completion.token_ids
        assert "".join(e.text for e in events) == completion.text
        assert (events[-1].finish_reason, events[-1].completion_tokens) == ("length", p.max_tokens)
        assert completion.finish_reason == "length" and completion.completion_tokens == p.max_tokens

    sink = RecordingSink()
    engine.submit(SubmitRequest(0, prompts[0], params[2], FINAL_ONLY), sink)
    assert wait_until(lambda: any(r[2] is not None for m in sink.messages for r in m), timeout_s=60)
    (records,) = sink.messages
    assert records[-1][2] == "length" and len(records) == 30
    tokens = [r[1] for r in records]  # no text: the consumer decodes
    assert tokenizer.decode(tokens) == engine.generate([prompts[0]], [params[2]])[0].text


def test_logprobs_of_generated_tokens_are_transformers_log_softmax(model, tokenizer, tmp_path):
    # Greedy and sampled tokens, with 0, 2 and 5 alternatives, against transformers' GPT2LMHeadModel on the
    # same weights: the log-probabilities are of the raw logits, before temperature and top-k/top-p.
    from transformers import GPT2LMHeadModel

    checkpoint.save_pretrained(model, tmp_path / "model")
    hf = GPT2LMHeadModel.from_pretrained(tmp_path / "model").eval()
    engine = Engine(model, tokenizer, EngineConfig(max_batch_size=4, max_seq_len=128, dtype="fp32")).start()
    try:
        prompts = [tokenizer(text)["input_ids"] for text in ("alice has", "the quick brown fox", "bob")]
        params = [
            GenerationParams(max_tokens=9, ignore_eos=True, sampling=SamplingParams(temperature=0.0), logprobs=5),
            GenerationParams(
                max_tokens=7, ignore_eos=True, sampling=SamplingParams(temperature=1.3, top_k=4, seed=3), logprobs=2
            ),
            GenerationParams(max_tokens=5, ignore_eos=True, sampling=SamplingParams(temperature=0.0), logprobs=0),
        ]
        plain = engine.generate(prompts[:1], [dataclasses.replace(params[0], logprobs=None)])[0]
        completions = engine.generate(prompts, params)
    finally:
        engine.shutdown()
    assert plain.logprobs is None and plain.token_ids == completions[0].token_ids  # asking changes no token
    for prompt, p, completion in zip(prompts, params, completions, strict=True):
        assert len(completion.logprobs) == len(completion.token_ids) == p.max_tokens
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + completion.token_ids])).logits[0].double()
        expected = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : -1]  # the positions that chose each token
        for position, (token, (logprob, alternatives)) in enumerate(
            zip(completion.token_ids, completion.logprobs, strict=True)
        ):
            assert abs(logprob - expected[position, token].item()) < 1e-4
            assert len(alternatives) == p.logprobs
            top = torch.topk(expected[position], p.logprobs)
            assert [i for i, _ in alternatives] == top.indices.tolist()
            assert all(abs(lp - v) < 1e-4 for (_, lp), v in zip(alternatives, top.values.tolist(), strict=True))
        if p.sampling.temperature == 0 and p.logprobs:  # greedy: the chosen token is the top one
            assert all(
                alts[0][0] == token for token, (_, alts) in zip(completion.token_ids, completion.logprobs, strict=True)
            )


@pytest.mark.parametrize("logprobs", [-1, 6, 2.5, True])
def test_logprobs_out_of_range_are_refused(engine, logprobs):
    with pytest.raises(ValueError, match="logprobs must be an integer in"):
        engine.generate([[1, 2]], GenerationParams(max_tokens=2, logprobs=logprobs))


def test_an_echoed_prompt_is_scored_with_transformers_log_softmax_alone_or_before_generating(
    model, tokenizer, tmp_path
):
    # echo + logprobs: every prompt token's log-probability (the first has none), as lm-evaluation-harness
    # asks with max_tokens 0 to score a continuation; with max_tokens > 0 the generation follows as usual.
    from transformers import GPT2LMHeadModel

    checkpoint.save_pretrained(model, tmp_path / "model")
    hf = GPT2LMHeadModel.from_pretrained(tmp_path / "model").eval()
    engine = Engine(model, tokenizer, EngineConfig(max_batch_size=4, max_seq_len=128, dtype="fp32")).start()
    prompts = [tokenizer(text)["input_ids"] for text in ("alice has 3 apples.", "b", "the quick brown fox jumps over")]
    # One token past the context: all 128 positions are scored, as a training block of 129 tokens is.
    prompts.append([(7 * i) % 250 + 1 for i in range(129)])
    try:
        scored = engine.generate(prompts, GenerationParams(max_tokens=0, logprobs=3, echo=True))
        # One echo request admitted beside a plain one: the plain one is unchanged.
        both = engine.generate(
            prompts[:2],
            [GenerationParams(max_tokens=6, ignore_eos=True, logprobs=1, echo=True, sampling=SamplingParams(temperature=0)),
             greedy(6)],
        )  # fmt: skip
        alone = engine.generate(prompts[1:2], greedy(6))[0]
    finally:
        engine.shutdown()
    for prompt, completion in zip(prompts, scored, strict=True):
        assert completion.token_ids == [] and completion.completion_tokens == 0 and completion.text == ""
        assert completion.finish_reason == "length" and completion.prompt_tokens == len(prompt)
        assert len(completion.prompt_logprobs) == len(prompt) and completion.prompt_logprobs[0] is None
        with torch.no_grad():
            expected = torch.log_softmax(hf(torch.tensor([prompt[:128]])).logits[0].double(), dim=-1)
        for position, (token, entry) in enumerate(zip(prompt[1:], completion.prompt_logprobs[1:], strict=True)):
            logprob, alternatives = entry
            assert abs(logprob - expected[position, token].item()) < 1e-4
            top = torch.topk(expected[position], 3)
            assert [i for i, _ in alternatives] == top.indices.tolist()
            assert all(abs(lp - v) < 1e-4 for (_, lp), v in zip(alternatives, top.values.tolist(), strict=True))
    echoed, plain = both
    assert [e[0] for e in echoed.prompt_logprobs[1:]] == pytest.approx([e[0] for e in scored[0].prompt_logprobs[1:]])
    assert len(echoed.token_ids) == len(echoed.logprobs) == 6 and echoed.logprobs[0][1][0][0] == echoed.token_ids[0]
    assert plain.prompt_logprobs is None and plain.logprobs is None
    assert (plain.token_ids, plain.text) == (alone.token_ids, alone.text)


def test_max_tokens_0_needs_echo_and_an_echoed_prompt_must_fit_the_context(engine):
    with pytest.raises(ValueError, match=r"max_tokens must be >= 1 \(0 only with echo\)"):
        engine.generate([[1, 2]], GenerationParams(max_tokens=0, logprobs=1))
    with pytest.raises(ValueError, match="over the 129 tokens a scored prompt may hold"):
        engine.generate([[1] * 130], GenerationParams(max_tokens=0, logprobs=1, echo=True))
    with pytest.raises(ValueError, match="over the context of 128"):  # generating: the context is the limit
        engine.generate([[1] * 128], GenerationParams(max_tokens=1, logprobs=1, echo=True))


@pytest.mark.parametrize("sampling", [(0.0, 0, 1.0), (0.9, 20, 0.9)], ids=["greedy", "filtered"])
def test_a_packed_prefill_fills_the_cache_and_picks_as_the_padded_one(model, sampling):
    """Prompts of many lengths admitted together run back to back without padding; each slot ends as the
    padded prefill leaves it (cache, first token, position, step), and decoding goes on identically."""
    from gpt2_platform.engine.prefill import PACKED_PREFILL_MIN_PROMPTS
    from gpt2_platform.engine.runner import ModelRunner

    runners = {
        packed: ModelRunner(model, 48, 96, torch.float32, torch.device("cpu"), cuda_graphs=False, packed_prefill=packed)
        for packed in (True, False)
    }
    count = PACKED_PREFILL_MIN_PROMPTS + 5
    prompts = [[(11 * i + 3 * j) % 250 + 1 for j in range(1 + (37 * i) % 95)] for i in range(count)]
    slots = [(7 * i) % 48 for i in range(count)]
    temperature, top_k, top_p = sampling
    firsts = {}
    for packed, runner in runners.items():
        for slot in slots:
            runner.set_sampling(slot, temperature, top_k, top_p, seed=slot)
        firsts[packed] = runner.prefill(prompts, slots)
    packed, padded = runners[True], runners[False]
    assert (packed.packed_prefills, padded.packed_prefills) == (1, 0)
    assert firsts[True] == firsts[False]
    for slot, prompt in zip(slots, prompts, strict=True):
        for ours, theirs in zip(packed.cache.kv, padded.cache.kv, strict=True):
            torch.testing.assert_close(ours[slot, :, :, : len(prompt)], theirs[slot, :, :, : len(prompt)])
        assert packed.state.positions[slot].item() == len(prompt) and packed.state.steps[slot].item() == 1
    # Below the minimum, a group keeps the padded prefill.
    free = sorted(set(range(48)) - set(slots))[:3]
    for runner in runners.values():
        runner.prefill(prompts[:3], free)
    assert packed.packed_prefills == 1
    slots += free
    # Three decode steps over every admitted slot go on from what each prefill left, token for token.
    active = max(slots) + 1
    for step in range(3):
        steps = [r.launch(active, slots, max(map(len, prompts)) + step).tokens() for r in (packed, padded)]
        assert steps[0] == steps[1]


def test_a_compile_cache_dir_is_where_triton_and_torch_compile_keep_their_caches(model, tmp_path, monkeypatch):
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    triton = pytest.importorskip("triton")  # a dev dependency on Linux
    for variable in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
        monkeypatch.delenv(variable, raising=False)  # and put back as they were after the test
    directory = tmp_path / "compile-cache"
    engine = Engine(model, byte_tokenizer(), EngineConfig(max_batch_size=2, compile_cache_dir=str(directory)))
    try:
        # Each library's own answer to "where is my cache", as it asks whenever it compiles.
        assert triton.knobs.cache.dir == str(directory / "triton")
        assert cache_dir() == str(directory / "inductor")
        assert (directory / "triton").is_dir() and (directory / "inductor").is_dir()
    finally:
        engine.shutdown()
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ValueError, match=r"^engine.compile_cache_dir .*a-file: cannot make .*writable directory"):
        Engine(model, byte_tokenizer(), EngineConfig(max_batch_size=2, compile_cache_dir=str(blocker)))


def test_a_started_engine_sets_the_processs_gil_switch_interval_and_null_leaves_it(model):
    """The engine's thread must get the GIL back within a step's time when another thread of its process runs
    Python; Python's own 5 ms is longer than a decode step."""
    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        engine = Engine(model, byte_tokenizer(), EngineConfig(max_batch_size=2, gil_switch_interval_ms=0.25))
        assert sys.getswitchinterval() == 0.005  # built, not started: nothing changed yet
        engine.start(warmup=False)
        engine.shutdown()
        assert sys.getswitchinterval() == pytest.approx(0.00025)
        sys.setswitchinterval(0.005)
        Engine(model, byte_tokenizer(), EngineConfig(max_batch_size=2, gil_switch_interval_ms=None)).start(
            warmup=False
        ).shutdown()
        assert sys.getswitchinterval() == 0.005
    finally:
        sys.setswitchinterval(before)


def test_an_engine_with_packed_prefill_generates_what_one_without_it_does(model):
    """engine.packed_prefill reaches the runner: 20 prompts admitted together run packed (on a CPU, one
    attention a prompt), and every sequence gets the tokens the padded prefill gives it."""
    prompts = [[(5 * i + j) % 250 + 1 for j in range(3 + (7 * i) % 40)] for i in range(20)]
    params = GenerationParams(max_tokens=6, ignore_eos=True, sampling=SamplingParams(temperature=0.0))
    results = {}
    for packed in (True, False):
        config = EngineConfig(max_batch_size=24, max_seq_len=64, dtype="fp32", packed_prefill=packed)
        engine = Engine(model, byte_tokenizer(), config).start()
        try:
            results[packed] = [c.token_ids for c in engine.generate(prompts, params)]
            assert engine.stats()["packed_prefills"] == (1 if packed else 0)
        finally:
            engine.shutdown()
    assert results[True] == results[False]
