"""Runs the model for the engine: batched prefill (engine/prefill.py), and a decode step replayed as CUDA graphs.

Decode shapes are bucketed, batch to a power of two and attention span to a power of two, so a small set of
graphs (engine/graphs.py) covers every step. On CPU the same code runs eagerly.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from gpt2_platform.engine import kernels
from gpt2_platform.engine.buffers import Launch, SlotState, StepBuffers, hand_back
from gpt2_platform.engine.cache import KVCache
from gpt2_platform.engine.config import MAX_LOGPROBS, SAMPLING_MODES
from gpt2_platform.engine.graphs import Graph, GraphCache, bucket_for, buckets
from gpt2_platform.engine.modes import Pick, SamplingMode, mode_of
from gpt2_platform.engine.prefill import Prefiller, resolve_packed_prefill
from gpt2_platform.engine.sampling import sample, token_logprobs
from gpt2_platform.model import GPT2

logger = logging.getLogger(__name__)


def argmax_in_blocks(logits: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """`torch.argmax(logits, dim=-1)` of `(B, V)` logits, in two passes: each block's max, then the best block.

    One pass gives a row's 50K logits to one thread block, a long serial reduction that a small batch's
    decode step waits on, and inductor does not split an argmax itself.
    Ties go to the first index, as with argmax: the first block holding the row's max, then the first
    index in it. The engine uses it on CUDA at batch <= 16 only: on an H200 it made the batch-1 step
    faster and the batch-256 step slower (tools/probes/decode_step_variants.py;
    docs/benchmarks.md, engine). Batch sizes in between were not measured,
    nor is it used on CPUs.
    """
    batch, vocab = logits.shape
    padded = torch.nn.functional.pad(logits.float(), (0, -vocab % block), value=float("-inf"))
    best, within = padded.view(batch, -1, block).max(dim=-1)  # (B, blocks)
    first = best.argmax(dim=-1, keepdim=True)
    return (first * block + within.gather(1, first))[:, 0]


def padded_head(weight: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The LM head's `weight`, padded with zero rows to a multiple of 64.

    cuBLAS has no fast kernel for an odd row count such as GPT-2's 50257; padded to 50304 rows, the head
    ran several times faster on an H200 (tools/probes/linear_kernels.py; docs/benchmarks.md). The logits
    are cut to the vocabulary limit anyway.
    """
    padded_rows = -(-weight.shape[0] // 64) * 64
    head = torch.zeros(padded_rows, weight.shape[1], dtype=dtype, device=device)
    head[: weight.shape[0]] = weight.detach()
    return head


class ModelRunner:
    """Owns the model on its device, the KV cache, the per-slot sampling state and the decode graphs; what the
    engine calls to set a sequence's sampling, prefill prompts, launch decode steps and warm up."""

    def __init__(
        self,
        model: GPT2,
        num_slots: int,
        max_seq_len: int,
        dtype: torch.dtype,
        device: torch.device,
        cuda_graphs: bool,
        compile_step: bool = False,
        vocab_limit: int | None = None,
        decode_kernels: str = "torch",
        packed_prefill: bool | None = None,
    ) -> None:
        """`packed_prefill`: run groups of prompts packed (PACKED_PREFILL_MIN_PROMPTS); None: on CUDA in bf16 or
        fp16 on an Ampere or later GPU, where torch has variable-length (flash) attention."""
        # Checked before the model moves: `to` converts the caller's model in place, and a refused engine
        # must leave it as it was.
        packed_prefill = resolve_packed_prefill(packed_prefill, dtype, device)
        self.model = model.to(device=device, dtype=dtype).eval()
        # Ids at or past the limit are never sampled: a model's vocabulary is often padded past its
        # tokenizer's (50304 for 50257), and those ids decode to nothing.
        self.vocab_limit = min(vocab_limit or model.config.vocab_size, model.config.vocab_size)
        self.device, self.on_cuda = device, device.type == "cuda"
        # One slot more than sequences: the padding rows of a prefill graph (a few prompts padded to its
        # batch) write their cache entries and decode state there, never into a sequence's slot.
        self.cache = KVCache(model.config, num_slots + 1, max_seq_len, dtype, device)
        self.num_slots, self.max_seq_len = num_slots, max_seq_len
        self.batch_buckets = buckets(num_slots, 1)
        self.use_graphs = cuda_graphs and device.type == "cuda"
        self.head = padded_head(self.model.lm_head.weight, dtype, device)
        self.state = SlotState(num_slots + 1, device)
        # What the host set before a step (StepBuffers.staged), on the device; two sets of host buffers, one
        # for the step being set up, one for the step still in flight.
        self.staged = torch.zeros(4, num_slots + 1, dtype=torch.long, device=device)
        self.step_buffers = tuple(StepBuffers.allocate(num_slots, pinned=self.on_cuda) for _ in range(2))
        self.launches = 0
        # Host copies of what decides the sampling mode of a step (`mode_of`), and of every slot's sampling
        # parameters: a prefill carries its slots' to the device in its own staged copy (`start_prefill`).
        self.greedy = [True] * num_slots
        self.limited = [False] * num_slots  # top-k or top-p set
        self.logprobs = [False] * num_slots  # log-probabilities asked for
        self.sampling: list[tuple[float, int, float, int]] = [(0.0, 0, 1.0, 0)] * num_slots
        self._unsent_sampling: set[int] = set()  # set on the host, not yet on the device
        self.graph_cache = GraphCache(device)
        self.graphs = self.graph_cache.decode  # bound once: every decode step looks its graph up here
        self.prefiller = Prefiller(
            self.model,
            self.cache,
            self.state,
            self.sampling,
            self._logits,
            self.graph_cache,
            num_slots=num_slots,
            max_seq_len=max_seq_len,
            device=device,
            use_graphs=self.use_graphs,
            packed_prefill=packed_prefill,
        )
        self._set_up_decode(decode_kernels, compile_step)

    def _set_up_decode(self, decode_kernels: str, compile_step: bool) -> None:
        """The decode step's model part (modules or our kernels), its span buckets, and its compilation."""
        # Compiled with dynamic shapes, the step fuses its small kernels (layer norms, GELU,
        # residuals, cache writes) once for every bucket; the graphs are then captured around it.
        # Two compiled parts: the model, the same for every sampling mode, and the small pick of the
        # tokens, one variant per mode. Compiled whole, the model was compiled again for every mode,
        # which made the warm-up several times longer (docs/benchmarks.md, batch generation).
        # With decode_kernels="triton", our kernels (engine/kernels.py) run the model's part of every
        # decode step (fused GEMVs at batch 1, cuBLAS around our attention above it), and `compile`
        # compiles only the token pick: seconds of warm-up instead of the modules' 1-2 minutes.
        self.decoder = None
        if decode_kernels == "triton":
            self.decoder = kernels.TritonDecoder(self.model, self.head)
        elif decode_kernels != "torch":
            raise ValueError(f"decode_kernels must be torch or triton, got {decode_kernels!r}")
        # The modules' step attends over a span bucket of the cache, masked past each row's position; our
        # attention kernel reads each row up to its own position whatever the span, so one span serves
        # every step, and warm-up captures a third of the graphs.
        max_seq_len = self.max_seq_len
        self.span_buckets = [max_seq_len] if self.decoder is not None else buckets(max_seq_len, min(64, max_seq_len))
        self.forward, self.pick = self._forward, self._pick
        if compile_step:
            # Batch 1 is specialised, and `pick` has one variant per mode: past dynamo's default
            # limit of 8 it would quietly fall back to eager for the rest. Process-wide, as dynamo has it:
            # the limit is read whenever a compiled function meets a new shape, at any step of the engine's
            # life, so a setting scoped to this constructor would not hold. Only ever raised, never lowered,
            # so other compiled code in the process keeps at least the room it had.
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 32)
            if self.decoder is None:
                self.forward = torch.compile(self._forward, dynamic=True)
            self.pick = torch.compile(self._pick, dynamic=True)

    @property
    def packed_prefills(self) -> int:
        """How many prefills ran packed."""
        return self.prefiller.packed_prefills

    @property
    def captures_on_use(self) -> int:
        """Graphs captured after warm-up, when a shape was first met."""
        return self.graph_cache.captures_on_use

    @property
    def capture_on_use_s(self) -> float:
        """The seconds those captures took."""
        return self.graph_cache.capture_on_use_s

    def set_sampling(
        self, slot: int, temperature: float, top_k: int, top_p: float, seed: int, logprobs: bool = False
    ) -> None:
        """A new sequence's sampling parameters, kept on the device for every later step; `logprobs`: its
        steps compute log-probabilities.

        Held on the host until the slot's prefill, which carries them in its staged copy: four tensor
        writes per new sequence cost the engine's thread more than the rest of its admission.
        """
        self.greedy[slot] = temperature <= 0
        self.limited[slot] = top_k > 0 or top_p < 1.0
        self.logprobs[slot] = logprobs
        self.sampling[slot] = (float(temperature), int(top_k), float(top_p), int(seed))
        self._unsent_sampling.add(slot)

    def _send_sampling(self) -> None:
        """Sampling parameters set for slots that no prefill has carried (only tests and probes do that)."""
        state = self.state
        for slot in self._unsent_sampling:
            for tensor, value in zip(
                (state.temperature, state.top_k, state.top_p, state.seed), self.sampling[slot], strict=True
            ):
                tensor[slot] = value
        self._unsent_sampling.clear()

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], slots: list[int]) -> list[int]:
        """Run new prompts (each from position 0) into their slots and wait for each one's first token."""
        return self.start_prefill(prompts, slots).tokens()

    @torch.inference_mode()
    def start_prefill(self, prompts: list[list[int]], slots: list[int], echo: bool = False) -> Launch:
        """Start new prompts (each from position 0) into their slots, with the sampling parameters set for them.

        Nothing waits on the host: the first tokens come with `Launch.tokens()`. Each slot is left on the
        device as a decode step expects it (its first token, the position after the prompt, step 1), so
        the next decode step can go on from there before the host has seen the first token.

        `echo`: also the log-probabilities of every prompt token after the first (`Launch.prompt_logprobs`),
        from an eager prefill that keeps every position's hidden state; this waits for the device once.
        """
        mode = mode_of(
            [self.greedy[s] for s in slots], [self.limited[s] for s in slots], [self.logprobs[s] for s in slots]
        )
        self._unsent_sampling.difference_update(slots)
        return self.prefiller.start(prompts, slots, mode, echo)

    @torch.inference_mode()
    def launch(
        self, active: int, continuing: list[int] | np.ndarray, max_position: int, fed: np.ndarray | None = None
    ) -> Launch:
        """Start the decode step for slots 0..active-1 without waiting for it; `Launch.tokens()` waits.

        The slots in `continuing` go on from what the device holds for them: their prefill's first
        token, or the previous step's output, so a step can start before the host has read the one
        before it. Every other slot in range is fed from `fed` `(3, active)` (rows token, position,
        step), or without it, position 0 of nothing (a free slot). `max_position` is the largest
        position among the rows, for the span bucket. On CUDA the step runs while the host handles the
        previous one's tokens; on CPU it runs now.
        """
        batch = bucket_for(active, self.batch_buckets)
        span = bucket_for(max_position + 1, self.span_buckets)
        mode = mode_of(self.greedy[:active], self.limited[:active], self.logprobs[:active])
        if self._unsent_sampling:
            self._send_sampling()
        buffers = self.step_buffers[self.launches % 2]
        self.launches += 1
        rows = buffers.rows
        # A few whole-row writes, whatever the batch: per-element tensor writes cost a large share of a step at big batch.
        rows[:3, :batch] = 0
        if fed is not None:
            rows[:3, :active] = fed
        rows[3, :batch] = 1  # padding rows are fed position 0 of unused slots
        rows[3, continuing] = 0
        # The whole buffer (a few KB), not the columns [:batch]: that slice is strided, and torch copies a
        # strided pinned tensor through a pageable temporary (a host allocation and an extra copy every step,
        # and a copy CUDA may make wait for the stream). The step timed the same either way on an H200
        # (docs/benchmarks.md); tests/test_gpu.py fails if a pageable copy comes back.
        self.staged.copy_(buffers.staged, non_blocking=True)
        if self.use_graphs:
            graph, out = self.graphs.get((batch, span, mode)) or self._capture(batch, span, mode)
            graph.replay()
        else:
            out = self._decode_step(batch, span, mode)
        return hand_back(out, buffers.tokens, active, buffers.logprobs, self.on_cuda)

    def _capture(self, batch: int, span: int, mode: SamplingMode) -> Graph:
        # Rows that go on from the device's state advance it in each warm-up run: put it back after them.
        state = (self.state.tokens, self.state.positions, self.state.steps)
        return self.graph_cache.capture(
            self.graphs, (batch, span, mode), lambda: self._decode_step(batch, span, mode), keep=state
        )

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(hidden, self.head)[..., : self.vocab_limit]

    def _decode_step(self, batch: int, span: int, mode: SamplingMode) -> torch.Tensor:
        """One token for rows [:batch], attending over [0, span); reads and advances only the static buffers."""
        logits, positions, steps = self.forward(batch, span)
        return self.pick(logits, positions, steps, mode)

    def _forward(self, batch: int, span: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The logits `(B, vocab)` of rows [:batch], and the positions and steps they were computed at.

        A row's inputs come from `staged` where the host fed them, else from what the previous step left.
        """
        state = self.state
        if self.decoder is not None:
            # Our kernels were faster than the compiled modules at batch 1, 64 and 256 on an H200
            # (tools/probes/decode_step_variants.py; docs/benchmarks.md).
            logits, positions, steps = self.decoder.forward(
                self.staged, state.tokens, state.positions, state.steps, self.cache.kv, batch
            )
            return logits[:, : self.vocab_limit], positions, steps
        staged = self.staged[:, :batch]
        fed = staged[3] != 0
        tokens = torch.where(fed, staged[0], state.tokens[:batch])
        positions = torch.where(fed, staged[1], state.positions[:batch])
        steps = torch.where(fed, staged[2], state.steps[:batch])
        view = self.cache.decode(positions, span)
        hidden = self.model.hidden(tokens[:, None], positions=positions[:, None], cache=view)  # (B, 1, C)
        return self._logits(hidden[:, -1]), positions, steps

    def _pick(
        self, logits: torch.Tensor, positions: torch.Tensor, steps: torch.Tensor, mode: SamplingMode
    ) -> torch.Tensor:
        """Each row's next token, left with its position + 1 and step + 1 as the next step's inputs."""
        batch = logits.shape[0]
        state = self.state
        if mode.pick == Pick.GREEDY:
            # The same argmax `sample` takes for temperature-0 rows, without its sort and noise.
            out = argmax_in_blocks(logits) if logits.is_cuda and batch <= 16 else torch.argmax(logits.float(), dim=-1)
        else:
            out = sample(
                logits,
                state.temperature[:batch],
                state.top_k[:batch],
                state.top_p[:batch],
                state.seed[:batch],
                steps,
                filtered=mode.pick == Pick.FILTERED,
            )
        # A row whose sequence ended runs once more before the host knows; clamping keeps its
        # cache write inside the cache.
        state.tokens[:batch] = out
        state.positions[:batch] = torch.clamp(positions + 1, max=self.max_seq_len - 1)
        state.steps[:batch] = steps + 1
        if mode.logprobs:
            return (out, *token_logprobs(logits, out, MAX_LOGPROBS))
        return out

    @torch.inference_mode()
    def warmup(self, modes: tuple[str, ...] = SAMPLING_MODES, prefills: bool = True) -> float:
        """Run (and on CUDA capture) every decode and prefill shape of `modes` (Pick names) before serving;
        returns seconds.

        A mode left out is captured on first use instead (tens of ms per shape): a batch job that
        only decodes greedily need not capture the sampling graphs at start. So are prefill graphs
        over WARM_PREFILL_TOKENS, every prefill graph without `prefills`, and packed prefills' graphs.
        """
        unknown = set(modes) - set(SAMPLING_MODES)
        assert not unknown, f"unknown sampling modes {unknown}"
        start = time.perf_counter()
        graphs = self.graph_cache
        captures, phases = graphs.captures, list(graphs.capture_phases_s)
        with graphs.warming():
            decode_s = self._warm([SamplingMode(Pick(name), logprobs=False) for name in modes], prefills)
        elapsed = time.perf_counter() - start
        phases = [now - before for now, before in zip(graphs.capture_phases_s, phases, strict=True)]
        logger.info(
            "engine warm: %d batch x %d span shapes x %d modes%s in %.1f s (decode %.1f s, prefill %.1f s%s)",
            len(self.batch_buckets),
            len(self.span_buckets),
            len(modes),
            " captured as CUDA graphs" if self.use_graphs else "",
            elapsed,
            decode_s,
            elapsed - decode_s,
            f"; {graphs.captures - captures} graphs: eager runs {phases[1]:.1f} s, captures {phases[2]:.1f} s, "
            f"waits {phases[0]:.1f} s"
            if graphs.captures > captures
            else "",
        )
        return elapsed

    def _warm(self, modes: list[SamplingMode], prefills: bool) -> float:
        """Warm-up's work; returns the seconds the decode shapes took."""
        start = time.perf_counter()
        self.state.positions.zero_()
        self.staged.zero_()  # every row fed position 0 while warming up
        self.staged[3] = 1
        for batch in self.batch_buckets:
            for span in self.span_buckets:
                for mode in modes:
                    if self.use_graphs:
                        self._capture(batch, span, mode)
                    else:
                        self._decode_step(batch, span, mode)
        decode_s = time.perf_counter() - start
        prefiller = self.prefiller
        for width in prefiller.widths if prefills else ():
            self.prefill([[0] * width], [0])  # one prompt (on CUDA, through its greedy graph)
            if self.num_slots > 1:
                self.prefill([[0] * width] * 2, [0, 1])  # several
            eager_many = (
                self.use_graphs and self.num_slots > prefiller.graphed_prefill_max and not prefiller.packed_prefill
            )
            if eager_many:  # more than a graph takes: eager (with packing on, such a group runs packed)
                many = prefiller.graphed_prefill_max + 1
                self.prefill([[0] * width] * many, list(range(many)))
            prefiller.capture_warm(width, modes)
        if self.on_cuda:
            torch.cuda.synchronize(self.device)
        return decode_s
