"""Generation benchmark: transformers' `generate` against our engine, same model, same prompts, one process."""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Literal

import numpy as np
import torch

from gpt2_platform.engine.config import DecodeKernels, Dtype
from gpt2_platform.engine.engine import Engine, EngineConfig, GenerationParams, resolve_dtype
from gpt2_platform.engine.runner import ModelRunner
from gpt2_platform.engine.sampling import SamplingParams
from gpt2_platform.model import GPT2, preset
from gpt2_platform.tokenizer import byte_tokenizer

logger = logging.getLogger(__name__)


@dataclass
class GenerationMeasurement:
    implementation: str
    batch_size: int
    prompt_tokens: int
    new_tokens: int
    seconds: float
    tokens_per_s: float
    ms_per_step: float

    @classmethod
    def of(cls, implementation: str, prompts: torch.Tensor, new_tokens: int, seconds: float) -> GenerationMeasurement:
        batch, length = prompts.shape
        return cls(
            implementation,
            batch,
            length,
            new_tokens,
            seconds,
            batch * new_tokens / seconds,
            1000 * seconds / new_tokens,
        )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_prompts(batch: int, length: int, vocab: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab - 1, (batch, length), generator=generator)


def hf_generate(
    model: GPT2, prompts: torch.Tensor, new_tokens: int, dtype: torch.dtype, device: torch.device, runs: int = 3
) -> GenerationMeasurement:
    """transformers' generate (greedy, SDPA, dynamic cache), as users serve it today."""
    from transformers import AutoModelForCausalLM

    from gpt2_platform.checkpoint import save_pretrained

    with tempfile.TemporaryDirectory() as directory:
        save_pretrained(model, f"{directory}/model")
        hf = AutoModelForCausalLM.from_pretrained(f"{directory}/model", attn_implementation="sdpa")
    hf = hf.to(device=device, dtype=dtype).eval()
    inputs = prompts.to(device)
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        # Warm up at the measured shapes: cuDNN plans its attention per sequence length on first
        # use, which made an untimed-warm-up run 8x slower per step than the steady state.
        hf.generate(inputs, attention_mask=torch.ones_like(inputs), **kwargs)
        seconds = _fastest(lambda: hf.generate(inputs, attention_mask=torch.ones_like(inputs), **kwargs), device, runs)
    return GenerationMeasurement.of("transformers generate", prompts, new_tokens, seconds)


def _fastest(generate: Callable[[], object], device: torch.device, runs: int) -> float:
    """The best of `runs` timed calls, in seconds. Both sides get the same: at batch 1, where the host's
    Python sets the pace, transformers' time per step varied by up to 2x between single runs on the same
    card (docs/benchmarks.md, engine and generation), and the best of a few is its fairest
    figure."""
    best = float("inf")
    for _ in range(runs):
        _sync(device)
        start = time.perf_counter()
        generate()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def engine_generate(engine: Engine, prompts: torch.Tensor, new_tokens: int, runs: int = 3) -> GenerationMeasurement:
    """Our engine: all prompts submitted at once, continuous batching, greedy."""
    params = GenerationParams(max_tokens=new_tokens, ignore_eos=True, sampling=SamplingParams(temperature=0.0))
    rows = prompts.tolist()
    engine.generate(rows[:1], GenerationParams(max_tokens=4, ignore_eos=True, sampling=SamplingParams(temperature=0.0)))

    def generate() -> None:
        results = engine.generate(rows, params)
        assert all(r.completion_tokens == new_tokens for r in results)

    seconds = _fastest(generate, engine.runner.device, runs)
    return GenerationMeasurement.of("gpt2-platform engine", prompts, new_tokens, seconds)


def engine_only(
    preset_name: str,
    batch_sizes: list[int],
    prompt_tokens: int,
    new_tokens: int,
    max_batch_size: int | Literal["auto"],
    dtype_name: Dtype = "auto",
    compile_step: bool | None = None,
    runs: int = 3,
) -> list[dict]:
    """Our engine alone, configured as the Serve app configures it (compile None: the device's
    default), at each batch size: the reference a serving benchmark's HTTP tokens/s is held to."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = GPT2(preset(preset_name))
    config = EngineConfig(
        max_batch_size=max_batch_size,
        max_seq_len=prompt_tokens + new_tokens,
        dtype=dtype_name,
        compile=compile_step,
    )
    engine = Engine(model, byte_tokenizer(), config, device=device).start(modes=("greedy",))
    try:
        prompts = {b: random_prompts(b, prompt_tokens, model.config.vocab_size) for b in batch_sizes}
        return [asdict(engine_generate(engine, prompts[b], new_tokens, runs)) for b in batch_sizes]
    finally:
        engine.shutdown()


def fed_step(runner: ModelRunner, tokens: list[int], positions: list[int], steps: list[int]) -> list[int]:
    """One decode step for slots 0..len(tokens)-1, every row fed by the host (no prefill), waiting for its
    tokens."""
    fed = np.array([tokens, positions, steps], dtype=np.int64)
    return runner.launch(len(tokens), [], max(positions), fed).tokens()


def decode_step_latency(engine: Engine, batch: int, position: int, repeats: int = 200) -> float:
    """Milliseconds per decode step at this batch size, host work included (tokens in, tokens out)."""
    runner = engine.runner
    tokens, positions, steps = [1] * batch, [position] * batch, [1] * batch
    for _ in range(10):
        fed_step(runner, tokens, positions, steps)
    _sync(runner.device)
    start = time.perf_counter()
    for _ in range(repeats):
        fed_step(runner, tokens, positions, steps)
    _sync(runner.device)
    return 1000 * (time.perf_counter() - start) / repeats


HBM_COPY_GBPS = {"H200": 4300.0, "H100": 3000.0}
"""A device-to-device copy's rate (GB/s) on cards we ran on: the floor a decode step is held to (a step
reads every weight and every row's keys and values once; DESIGN.md quotes 4.3 TB/s for the H200)."""


def copy_rate_gbps(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((rate for card, rate in HBM_COPY_GBPS.items() if card in name), None)


def step_bytes(model: GPT2, batch: int, context: float, dtype: torch.dtype) -> float:
    """What one decode step must read at least: every parameter once, and each row's keys and values for
    `context` positions in every layer (the head is the token embedding, counted once)."""
    config = model.config
    itemsize = torch.empty((), dtype=dtype).element_size()
    weights = sum(p.numel() for p in model.parameters()) * itemsize
    kv_per_token = config.n_layer * 2 * config.n_embd * itemsize
    return weights + batch * context * kv_per_token


def pipelined_step_latency(
    engine: Engine, batch: int, position: int, repeats: int = 200, logprobs: bool = False
) -> float:
    """Milliseconds per decode step as the engine's loop runs them: step n+1 is launched before step n's
    tokens are read, each step going on from the last one's tokens on the device.

    `logprobs`: every row asks for log-probabilities (the step's log-probability graph, which also copies
    them to the host), to price them against the plain step."""
    runner = engine.runner
    # Positions advance a step at a time: they must stay inside the context.
    assert position + repeats + 10 < runner.max_seq_len, f"position {position} + {repeats} steps passes the context"
    runner.logprobs[:batch] = [logprobs] * batch
    try:
        return _pipelined(runner, batch, position, repeats)
    finally:
        runner.logprobs[:batch] = [False] * batch


def _pipelined(runner, batch: int, position: int, repeats: int) -> float:
    every = list(range(batch))
    # Fed by the host once; every later step continues from what the device holds for its rows.
    pending = runner.launch(batch, [], position, np.array([[1] * batch, [position] * batch, [1] * batch]))
    for step in range(1, repeats + 10):
        if step == 10:
            pending.tokens()
            start = time.perf_counter()
        launched = runner.launch(batch, every, position + step)
        pending.tokens()
        pending = launched
    pending.tokens()
    return 1000 * (time.perf_counter() - start) / repeats


def run(
    preset_name: str,
    batch_sizes: list[int],
    prompt_tokens: int,
    new_tokens: int,
    dtype_name: Dtype,
    device: torch.device,
    compile_step: bool = False,
    runs: int = 3,
    decode_kernels: DecodeKernels = "auto",
    engine_only: bool = False,
    logprobs: bool = False,
) -> dict:
    """transformers first (before our engine exists, so nothing of ours runs beside it), then the engine.

    `engine_only`: skip transformers (at batch 1,024 its generate takes minutes and is not the question).
    `logprobs`: also time the pipelined steps with every row asking for log-probabilities."""
    torch.manual_seed(0)
    model = GPT2(preset(preset_name))
    dtype = resolve_dtype(dtype_name, device)
    prompts = {b: random_prompts(b, prompt_tokens, model.config.vocab_size) for b in batch_sizes}
    theirs = (
        {} if engine_only else {b: hf_generate(model, prompts[b], new_tokens, dtype, device, runs) for b in batch_sizes}
    )
    max_seq_len = prompt_tokens + new_tokens
    config = EngineConfig(
        max_batch_size=max(batch_sizes),
        max_seq_len=max_seq_len,
        dtype=dtype_name,
        compile=compile_step,
        decode_kernels=decode_kernels,
    )
    # Greedy only: warming the sampling modes too would triple a compiled engine's warm-up.
    engine = Engine(model, byte_tokenizer(), config, device=device).start(modes=("greedy",))
    try:
        steps = _step_timings(engine, model, sorted({1, *batch_sizes}), prompt_tokens, max_seq_len, dtype, logprobs)
        rows = _generation_rows(engine, prompts, theirs, batch_sizes, new_tokens, runs, engine_only)
    finally:
        engine.shutdown()
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return {
        **steps,
        "copy_rate_gbps": copy_rate_gbps(device),
        "peak_memory_gib": peak,
        "engine_only": engine_only,
        "rows": rows,
        "stats": engine.stats(),
        "compile": compile_step,
        "decode_kernels": "torch" if engine.runner.decoder is None else "triton",
        "runs": runs,
    }


def _step_timings(
    engine: Engine,
    model: GPT2,
    sizes: list[int],
    prompt_tokens: int,
    max_seq_len: int,
    dtype: torch.dtype,
    logprobs: bool,
) -> dict:
    """Decode-step milliseconds at each batch size, one at a time and pipelined (and with log-probabilities
    when asked), and the bytes a step must read."""
    latency = {b: decode_step_latency(engine, b, prompt_tokens) for b in sizes}
    # From the same position, in the same span bucket as the one-at-a-time steps.
    repeats = min(200, max_seq_len - prompt_tokens - 12)
    pipelined = {b: pipelined_step_latency(engine, b, prompt_tokens, repeats) for b in sizes}
    with_logprobs = (
        {b: pipelined_step_latency(engine, b, prompt_tokens, repeats, logprobs=True) for b in sizes} if logprobs else {}
    )
    # The timed steps' mean context: they run from position prompt_tokens + 10 on, one position a step.
    context = prompt_tokens + 10 + (repeats + 1) / 2
    return {
        "decode_step_ms": latency,
        "pipelined_decode_step_ms": pipelined,
        "pipelined_context": context,
        "pipelined_with_logprobs_ms": with_logprobs,
        "step_bytes": {b: step_bytes(model, b, context, dtype) for b in sizes},
    }


def _generation_rows(
    engine: Engine,
    prompts: dict[int, torch.Tensor],
    theirs: dict[int, GenerationMeasurement],
    batch_sizes: list[int],
    new_tokens: int,
    runs: int,
    engine_only: bool,
) -> list[dict]:
    """The engine's generation at each batch size, after transformers' (unless engine_only), logged as it goes."""
    rows: list[dict] = []
    for batch in batch_sizes:
        ours = engine_generate(engine, prompts[batch], new_tokens, runs)
        if engine_only:
            rows.append(asdict(ours))
            logger.info("batch %d: engine %.0f tokens/s", batch, ours.tokens_per_s)
            continue
        rows += [asdict(theirs[batch]), asdict(ours)]
        logger.info(
            "batch %d: transformers %.0f tokens/s, engine %.0f tokens/s (%.1fx)",
            batch,
            theirs[batch].tokens_per_s,
            ours.tokens_per_s,
            ours.tokens_per_s / theirs[batch].tokens_per_s,
        )
    return rows


def as_markdown(result: dict) -> str:
    rows = result["rows"]
    if result.get("engine_only"):
        lines = ["| batch | engine tokens/s | engine ms/step |", "|---|---|---|"]
        lines += [f"| {r['batch_size']} | {r['tokens_per_s']:,.0f} | {r['ms_per_step']:.2f} |" for r in rows]
    else:
        lines = [
            "| batch | transformers tokens/s | engine tokens/s | speedup | transformers ms/step | engine ms/step |",
            "|---|---|---|---|---|---|",
        ]
        for theirs, ours in zip(rows[::2], rows[1::2], strict=True):
            lines.append(
                f"| {ours['batch_size']} | {theirs['tokens_per_s']:,.0f} | {ours['tokens_per_s']:,.0f} | "
                f"{ours['tokens_per_s'] / theirs['tokens_per_s']:.1f}x | {theirs['ms_per_step']:.2f} | {ours['ms_per_step']:.2f} |"
            )
    rate = result.get("copy_rate_gbps")
    lines += [
        "",
        f"Decode steps at a mean context of {result.get('pipelined_context', float('nan')):.0f} tokens; GB/s is what "
        "a step must read (weights once, every row's keys and values) over its time"
        + (f", against a copy rate of {rate:,.0f} GB/s." if rate else "."),
        "",
        "| batch | one at a time ms (host included) | pipelined ms | MB read a step | GB/s | of copy rate | floor ms |",
        "|---|---|---|---|---|---|---|",
    ]
    pipelined, traffic = result.get("pipelined_decode_step_ms", {}), result.get("step_bytes", {})
    for b, ms in result["decode_step_ms"].items():
        step, moved = pipelined.get(b, float("nan")), traffic.get(b, float("nan"))
        gbps = moved / step / 1e6
        share = f"{gbps / rate:.0%}" if rate else "-"
        floor = f"{moved / rate / 1e6:.3f}" if rate else "-"
        lines.append(f"| {b} | {ms:.3f} | {step:.3f} | {moved / 1e6:,.0f} | {gbps:,.0f} | {share} | {floor} |")
    with_logprobs = result.get("pipelined_with_logprobs_ms") or {}
    if with_logprobs:
        lines += ["", "| batch | pipelined ms | with logprobs (5 alternatives) ms | cost |", "|---|---|---|---|"]
        for b, ms in with_logprobs.items():
            plain = pipelined.get(b, float("nan"))
            lines.append(f"| {b} | {plain:.3f} | {ms:.3f} | {ms / plain - 1:+.1%} |")
    if result.get("peak_memory_gib") is not None:
        lines += [
            "",
            f"Peak memory allocated: {result['peak_memory_gib']:.2f} GiB (the KV cache for the largest batch included).",
        ]
    return "\n".join(lines)
