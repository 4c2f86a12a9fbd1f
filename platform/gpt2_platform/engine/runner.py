"""Runs the model for the engine: batched prefill, and a decode step replayed as CUDA graphs.

Decode shapes are bucketed, batch to a power of two and attention span to a
power of two, so a small set of graphs covers every step. On CPU the same
code runs eagerly.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Callable

import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from gpt2_platform.engine import kernels
from gpt2_platform.engine.cache import KVCache, PackedPrefillView, varlen_attention_available
from gpt2_platform.engine.config import MAX_LOGPROBS, SAMPLING_MODES
from gpt2_platform.engine.modes import Pick, SamplingMode, mode_of
from gpt2_platform.engine.sampling import sample, token_logprobs
from gpt2_platform.model import GPT2

logger = logging.getLogger(__name__)


# A staged prompt row: these columns, then the prompt's tokens. Floats travel as their float64 bits, so
# one int64 copy carries a prefill's whole input, sampling parameters included.
_SLOT, _LAST, _TEMPERATURE, _TOP_K, _TOP_P, _SEED, PROMPT_HEADER = range(7)
# Prompts admitted together up to this many, and up to this many tokens with their padding, replay a
# prefill graph; more (a batch job's first wave) take one eager prefill, whose launches cost milliseconds
# of host time (tools/probes/prefill_batching.py). A batch job at 1,024 slots admits about 4,096 prompt
# tokens (engine.max_prefill_tokens) at a time all through the run, not only in its first wave: up to 64
# prompts padded to 128, which a limit of 32 sent eager, and its host time per step was then the
# bottleneck (py-spy profile of the 100,000-prompt job, docs/benchmarks.md).
GRAPHED_PREFILL_MAX = 64
GRAPHED_PREFILL_TOKENS = 8192
# Warm-up captures the prefill graphs up to this many tokens; larger ones (a batch job's) on first use, so
# that a Serve replica's start-up does not pay for shapes it may never see (with all of them captured at
# warm-up, the batch actor's warm-up grew: docs/benchmarks.md, batch generation).
WARM_PREFILL_TOKENS = 4096
# From this many prompts admitted together (up to GRAPHED_PREFILL_TOKENS of them), a prefill runs packed: the
# prompts back to back without padding (cache.PackedPrefillView), replayed as a graph per (prompts and tokens
# each rounded up to a power of two, mode). A batch job's groups of about 50 prompts of 32-128 tokens, padded
# to 64 rows of the longest one's power-of-two width, are half padding (tools/probes/prefill_cost.py). Fewer
# prompts (a server's few at a time) keep the padded graphs. Powers of two, not finer token steps: each graph
# is captured on first use (tens of ms of the engine's thread), steps of 512 tokens gave a batch job's first
# wave dozens of shapes to capture, and its groups fill engine.max_prefill_tokens (4,096 by default) closely
# enough to land in one bucket anyway.
PACKED_PREFILL_MIN_PROMPTS = 16
PACKED_MIN_TOKENS = 512


def packed_layout(prompts: int, tokens: int) -> tuple[int, int, int, int, int, int]:
    """Where a packed prefill's inputs lie in its one flat int64 buffer (one copy to the device): the
    prompts' header rows (`prompts` x PROMPT_HEADER) from 0, then from each returned offset every token's id,
    position and slot (`tokens` each), each prompt's last token's index (`prompts`), where each prompt starts
    and then where the last one ends (`prompts` + 1); and the buffer's length."""
    ids = prompts * PROMPT_HEADER
    positions, slots = ids + tokens, ids + 2 * tokens
    last = ids + 3 * tokens
    starts = last + prompts
    return ids, positions, slots, last, starts, starts + prompts + 1


def buckets(limit: int, start: int) -> list[int]:
    """Powers of two from `start` up to `limit`, ending with `limit` itself."""
    sizes, size = [], start
    while size < limit:
        sizes.append(size)
        size *= 2
    return [*sizes, limit]


def bucket_for(value: int, sizes: list[int]) -> int:
    for size in sizes:
        if size >= value:
            return size
    raise AssertionError(f"{value} exceeds the largest bucket {sizes[-1]}")


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


class ModelRunner:
    """Owns the model on its device, the KV cache, the per-slot sampling state and the decode graphs."""

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
        # Variable-length attention is flash attention's: half precision, and GPUs from Ampere (sm80) on.
        # Checked before the model moves: `to` converts the caller's model in place, and a refused engine
        # must leave it as it was.
        packs_on_device = device.type != "cuda" or (
            dtype in (torch.bfloat16, torch.float16)
            and torch.cuda.get_device_capability(device) >= (8, 0)
            and varlen_attention_available()
        )
        if packed_prefill is None:
            packed_prefill = device.type == "cuda" and packs_on_device
        elif packed_prefill and not packs_on_device:
            raise ValueError(
                "engine.packed_prefill=true needs bf16 or fp16 on an Ampere or later GPU (flash attention's "
                f"variable-length kernel), with a torch that has it; this engine is {dtype} on "
                f"{torch.cuda.get_device_name(device)}: set engine.packed_prefill to null or false"
            )
        self.model = model.to(device=device, dtype=dtype).eval()
        # Ids at or past the limit are never sampled: a model's vocabulary is often padded past its
        # tokenizer's (50304 for 50257), and those ids decode to nothing.
        self.vocab_limit = min(vocab_limit or model.config.vocab_size, model.config.vocab_size)
        self.device = device
        # One slot more than sequences: the padding rows of a prefill graph (a few prompts padded to its
        # batch) write their cache entries and decode state there, never into a sequence's slot.
        self.scratch_slot = num_slots
        state = num_slots + 1
        self.cache = KVCache(model.config, state, max_seq_len, dtype, device)
        self.num_slots, self.max_seq_len = num_slots, max_seq_len
        self.batch_buckets = buckets(num_slots, 1)
        self.prefill_buckets = buckets(max_seq_len, min(16, max_seq_len))
        self.use_graphs = cuda_graphs and device.type == "cuda"
        # The LM head, padded to a multiple of 64 rows: cuBLAS has no fast kernel for an odd row count
        # such as GPT-2's 50257; padded to 50304 rows, the head ran several times faster on an H200
        # (tools/probes/linear_kernels.py; docs/benchmarks.md). The extra rows are zeros,
        # and the logits are cut to `vocab_limit` anyway.
        head = self.model.lm_head.weight
        padded_rows = -(-head.shape[0] // 64) * 64
        self.head = torch.zeros(padded_rows, head.shape[1], dtype=dtype, device=device)
        self.head[: head.shape[0]] = head.detach()
        # Decode state, one column per slot; a graph reads columns [:B]. Each step leaves its output
        # token, position + 1 and step + 1 here, so the next step can run before the host has read
        # this one's tokens (see `launch`).
        self.tokens = torch.zeros(state, dtype=torch.long, device=device)
        self.positions = torch.zeros(state, dtype=torch.long, device=device)
        self.steps = torch.zeros(state, dtype=torch.long, device=device)
        # What the host sets before a step, in one copy: rows token, position, step, and "fed" (1: take
        # this column from here; 0: keep what the previous step left on the device).
        self.staged = torch.zeros(4, state, dtype=torch.long, device=device)
        # Two of each host buffer: one for the step being set up, one for the step still in flight.
        pinned = device.type == "cuda"
        self.host_staged = [torch.zeros(4, state, dtype=torch.long, pin_memory=pinned) for _ in range(2)]
        self.host_staged_rows = [host.numpy() for host in self.host_staged]  # the same memory, written as arrays
        self.host_out = [torch.zeros(num_slots, dtype=torch.long, pin_memory=pinned) for _ in range(2)]
        # Log-probabilities come back beside the tokens, for steps (and prefills) that computed them.
        self.host_logprobs = [self._logprob_buffers(num_slots, pinned) for _ in range(2)]
        self.host_prefill_logprobs = [self._logprob_buffers(num_slots, pinned) for _ in range(2)]
        self.launches = 0
        # Host copies of what decides the sampling mode of a step (`mode_of`), and of every slot's sampling
        # parameters: a prefill carries its slots' to the device in its own staged copy (`start_prefill`).
        self.greedy = [True] * num_slots
        self.limited = [False] * num_slots  # top-k or top-p set
        self.logprobs = [False] * num_slots  # log-probabilities asked for
        self.sampling: list[tuple[float, int, float, int]] = [(0.0, 0, 1.0, 0)] * num_slots
        self._unsent_sampling: set[int] = set()  # set on the host, not yet on the device
        self.temperature = torch.zeros(state, dtype=torch.float32, device=device)
        self.top_k = torch.zeros(state, dtype=torch.long, device=device)
        self.top_p = torch.ones(state, dtype=torch.float32, device=device)
        self.seed = torch.zeros(state, dtype=torch.long, device=device)
        self.graphs: dict[tuple[int, int, SamplingMode], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # Prompts admitted together are staged as rows (header, then tokens) in one copy from pinned memory,
        # which waits for nothing on the host: a copy from pageable memory would wait for the decode step in
        # flight. Up to `graphed_prefill_max` of them replay a prefill graph per (batch bucket, width bucket,
        # mode): eager, a prefill's 200-odd small kernels cost milliseconds of launches, more host time than
        # the engine's decode step, and a server admits a few prompts at a time as requests arrive
        # (jobs/bench_serve.py, engine profile). One graph for all of them, not one replay each: a prefill
        # of a few prompts takes about as long on the GPU as one (tools/probes/prefill_batching.py). More
        # prompts than that (a batch job's first wave) take one eager prefill.
        self.prefill_graphs: dict[tuple[int, int, SamplingMode], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.graphed_prefill_max = min(GRAPHED_PREFILL_MAX, num_slots)
        self.prefill_batch_buckets = buckets(self.graphed_prefill_max, 1)
        # One column past the context: a scored prompt's last token, a target only (requests.scoring_only).
        self.staged_prompts = torch.zeros(num_slots, PROMPT_HEADER + max_seq_len + 1, dtype=torch.long, device=device)
        self.host_prompts = [
            torch.zeros(self.staged_prompts.shape, dtype=torch.long, pin_memory=pinned) for _ in range(2)
        ]
        self.host_firsts = [torch.zeros(num_slots, dtype=torch.long, pin_memory=pinned) for _ in range(2)]
        self.packed_prefill = packed_prefill
        self.packed_prefills = 0  # how many ran packed
        self.packed_prompt_buckets = buckets(num_slots, min(PACKED_PREFILL_MIN_PROMPTS, num_slots))
        packed_length = packed_layout(num_slots, GRAPHED_PREFILL_TOKENS)[-1]
        self.host_packed = [torch.zeros(packed_length, dtype=torch.long, pin_memory=pinned) for _ in range(2)]
        self.staged_packed = torch.zeros(packed_length, dtype=torch.long, device=device)
        self.packed_graphs: dict[tuple[int, int, SamplingMode], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._prefill_done: list[torch.cuda.Event | None] = [None, None]  # when each host buffer is free again
        self.prefills = 0
        # Graphs captured after warm-up, when a shape is first met, and the seconds they took.
        self.captures_on_use = 0
        self.capture_on_use_s = 0.0
        self._warming = False
        # Each capture's seconds by phase (the steps in flight, the eager run, the capture itself),
        # summed: what a replica's warm-up spends its time on, in its log line.
        self.capture_phases_s = [0.0, 0.0, 0.0]
        self.captures = 0
        self.prompt_positions = torch.arange(max_seq_len, device=device)[None, :]
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

    @staticmethod
    def _logprob_buffers(rows: int, pinned: bool) -> tuple[torch.Tensor, torch.Tensor]:
        values = torch.zeros(rows, 1 + MAX_LOGPROBS, dtype=torch.float32, pin_memory=pinned)
        return values, torch.zeros(rows, MAX_LOGPROBS, dtype=torch.long, pin_memory=pinned)

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
        for slot in self._unsent_sampling:
            for tensor, value in zip(
                (self.temperature, self.top_k, self.top_p, self.seed), self.sampling[slot], strict=True
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
        batch = len(prompts)
        buffer = self.prefills % 2
        self.prefills += 1
        done = self._prefill_done[buffer]
        if done is not None:
            done.synchronize()  # the copy from this buffer two prefills ago; long finished in a running engine
        longest = max(len(p) for p in prompts)
        # Pad to a power-of-two width: few shapes, each warmed before serving (a new
        # attention shape costs hundreds of ms of kernel planning on its first use). A scored prompt one
        # token past the context feeds all but its last token (a target only).
        assert longest <= self.max_seq_len or echo, f"a prompt of {longest} tokens is over the context"
        width = bucket_for(min(longest, self.max_seq_len), self.prefill_buckets)
        mode = mode_of(
            [self.greedy[s] for s in slots], [self.limited[s] for s in slots], [self.logprobs[s] for s in slots]
        )
        self._unsent_sampling.difference_update(slots)
        if (
            self.packed_prefill
            and not echo
            and batch >= PACKED_PREFILL_MIN_PROMPTS
            and sum(map(len, prompts)) <= GRAPHED_PREFILL_TOKENS
        ):
            launch = self._start_packed(prompts, slots, buffer, mode)
            self._prefill_done[buffer] = launch.done
            return launch
        bucket = bucket_for(batch, self.prefill_batch_buckets) if batch <= self.graphed_prefill_max else batch
        graphed = self._graphed_prefill(bucket, width) and not echo
        rows_in = bucket if graphed else batch  # a graph's batch takes padding rows
        host = self.host_prompts[buffer]
        rows = host.numpy()
        self._write_headers(rows[:rows_in], prompts, slots)
        for row, prompt in enumerate(prompts):
            rows[row, PROMPT_HEADER : PROMPT_HEADER + len(prompt)] = prompt
        # One contiguous run of the buffer, up to the last row's last prompt column: a strided slice (only
        # the columns some prompt reaches) would go through a pageable temporary (see `launch`). Padding past
        # a prompt, stale or not, is never read as its own: causal attention keeps it out of the prompt's
        # outputs, and decode steps overwrite those positions' cache entries before they read them.
        end = (rows_in - 1) * host.shape[1] + PROMPT_HEADER + longest
        self.staged_prompts.view(-1)[:end].copy_(host.view(-1)[:end], non_blocking=True)
        if graphed:
            graph, out = self.prefill_graphs.get((rows_in, width, mode)) or self._capture_prefill(rows_in, width, mode)
            graph.replay()
        else:
            out = self._prefill(self.staged_prompts[:batch, : PROMPT_HEADER + width + 1], width, mode, echo)
        prompt_logprobs = None
        if echo:
            out, prompt_logprobs = out
        launch = self._hand_back(out, self.host_firsts[buffer], batch, self.host_prefill_logprobs[buffer])
        if prompt_logprobs is not None:
            values, ids = prompt_logprobs
            launch.prompt_logprobs = (values.cpu().numpy(), ids.cpu().numpy())
        self._prefill_done[buffer] = launch.done
        return launch

    def _write_headers(self, rows: np.ndarray, prompts: list[list[int]], slots: list[int]) -> None:
        """Each prompt's header row (slot, last index, sampling parameters) into `rows` `(R, >= PROMPT_HEADER)`;
        the rows past the prompts (a graph's padding) are greedy, one token long, into the scratch slot."""
        as_float = rows.view("float64")
        for row, (prompt, slot) in enumerate(zip(prompts, slots, strict=True)):
            temperature, top_k, top_p, seed = self.sampling[slot]
            last = min(len(prompt), self.max_seq_len) - 1
            rows[row, _SLOT], rows[row, _LAST], rows[row, _TOP_K], rows[row, _SEED] = slot, last, top_k, seed
            as_float[row, _TEMPERATURE], as_float[row, _TOP_P] = temperature, top_p
        rows[len(prompts) :, :PROMPT_HEADER] = [self.scratch_slot, 0, 0, 0, 0, 0]
        as_float[len(prompts) :, _TOP_P] = 1.0

    def _start_packed(self, prompts: list[list[int]], slots: list[int], buffer: int, mode: SamplingMode) -> Launch:
        """Start prompts (each within the context) packed back to back into their slots; as `start_prefill`.

        On CUDA, replays the graph of the prompts' count and their tokens (from PACKED_MIN_TOKENS) each rounded
        up to a power of two: the padding prompts are empty (their header rows go to the scratch slot), and the
        padding tokens, in no prompt, write their keys and values into the scratch slot.
        """
        self.packed_prefills += 1
        batch = len(prompts)
        lengths = np.fromiter(map(len, prompts), np.int64, batch)
        ends = np.cumsum(lengths)
        total = int(ends[-1])
        count, tokens = batch, total
        if self.use_graphs:
            count = bucket_for(batch, self.packed_prompt_buckets)
            tokens = max(PACKED_MIN_TOKENS, 1 << (total - 1).bit_length())
        at_ids, at_positions, at_slots, at_last, at_starts, end = packed_layout(count, tokens)
        host = self.host_packed[buffer]
        flat = host.numpy()
        self._write_headers(flat[:at_ids].reshape(count, PROMPT_HEADER), prompts, slots)
        flat[at_ids : at_ids + total] = np.fromiter(itertools.chain.from_iterable(prompts), np.int64, total)
        flat[at_positions : at_positions + total] = np.arange(total) - np.repeat(ends - lengths, lengths)
        flat[at_slots : at_slots + total] = np.repeat(np.asarray(slots, np.int64), lengths)
        for at in (at_ids, at_positions):
            flat[at + total : at + tokens] = 0
        flat[at_slots + total : at_slots + tokens] = self.scratch_slot
        flat[at_last : at_last + batch] = ends - 1
        flat[at_last + batch : at_starts] = 0
        flat[at_starts] = 0
        flat[at_starts + 1 : at_starts + 1 + batch] = ends
        flat[at_starts + 1 + batch : end] = total
        self.staged_packed[:end].copy_(host[:end], non_blocking=True)  # contiguous, from pinned memory
        if self.use_graphs:
            graph, out = self.packed_graphs.get((count, tokens, mode)) or self._capture_packed(count, tokens, mode)
            graph.replay()
        else:
            out = self._prefill_packed(count, tokens, mode, bounds=[0, *ends.tolist()])
        return self._hand_back(out, self.host_firsts[buffer], batch, self.host_prefill_logprobs[buffer])

    def _prefill_packed(self, count: int, tokens: int, mode: SamplingMode, bounds: list[int] | None = None):
        """The packed prompts staged in `staged_packed` (`packed_layout(count, tokens)`) into their slots; the
        first token of each, as `_prefill` leaves them. `bounds`: where the prompts start and end, on the host
        (CPU only: CUDA attends by the staged starts)."""
        at_ids, at_positions, at_slots, at_last, at_starts, end = packed_layout(count, tokens)
        staged = self.staged_packed
        ids, positions = staged[at_ids:at_positions], staged[at_positions:at_slots]
        view = PackedPrefillView(
            self.cache, staged[at_slots:at_last], positions, staged[at_starts:end], self.max_seq_len, bounds
        )
        hidden = self.model.hidden(
            ids[None], positions=positions[None], cache=view, hidden_at=staged[at_last:at_starts]
        )
        return self._first_tokens(staged[:at_ids].view(count, PROMPT_HEADER), hidden, mode)

    def _capture_packed(self, count: int, tokens: int, mode: SamplingMode) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        graph, out = self._capture_graph(lambda: self._prefill_packed(count, tokens, mode))
        self.packed_graphs[(count, tokens, mode)] = (graph, out)
        return graph, out

    def _prefill(self, rows: torch.Tensor, width: int, mode: SamplingMode, echo: bool = False):
        """Staged prompt rows `(B, PROMPT_HEADER + width)` into their slots; the first token of each.

        Sets each slot's sampling parameters from its row, and leaves the slot's first token, position
        and step where the next decode step reads them. With `echo` (rows of `PROMPT_HEADER + width + 1`
        columns: the one past the width is a target only), returns (that, the prompt's log-probabilities:
        `(B, width, 1 + MAX_LOGPROBS)` values and `(B, width, MAX_LOGPROBS)` top ids, position t for token
        t + 1; a row's columns past its own prompt are padding).
        """
        slots, last = rows[:, _SLOT], rows[:, _LAST]
        tokens = rows[:, PROMPT_HEADER : PROMPT_HEADER + width]  # (B, T)
        positions = self.prompt_positions[:, :width].expand(rows.shape[0], width)
        view = self.cache.prefill(slots, positions)
        with self._prefill_attention():
            hidden = self.model.hidden(tokens, positions=positions, cache=view, hidden_at=None if echo else last)
        prompt_logprobs = None
        if echo:  # (B, T, C): every position's, for the prompt's own log-probabilities
            prompt_logprobs = self._prompt_logprobs(hidden, rows[:, PROMPT_HEADER + 1 : PROMPT_HEADER + 1 + width])
            hidden = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]  # (B, C)
        out = self._first_tokens(rows, hidden, mode)
        return out if prompt_logprobs is None else (out, prompt_logprobs)

    def _first_tokens(self, rows: torch.Tensor, hidden: torch.Tensor, mode: SamplingMode):
        """Each prompt's first token from its last position's `hidden` `(B, C)`, with the sampling parameters
        of its header row (`rows` `(B, >= PROMPT_HEADER)`); leaves the token, the position after the prompt and
        step 1 in its slot."""
        slots, last = rows[:, _SLOT], rows[:, _LAST]
        self.temperature[slots] = rows[:, _TEMPERATURE].view(torch.float64).float()
        self.top_k[slots] = rows[:, _TOP_K]
        self.top_p[slots] = rows[:, _TOP_P].view(torch.float64).float()
        self.seed[slots] = rows[:, _SEED]
        logits = self._logits(hidden)
        # The same choice of pick as a decode step's: for greedy rows only, the argmax without
        # sample's float64 sort and noise over the whole vocabulary.
        if mode.pick == Pick.GREEDY:
            first = torch.argmax(logits.float(), dim=-1)
        else:
            first = sample(
                logits,
                self.temperature[slots],
                self.top_k[slots],
                self.top_p[slots],
                self.seed[slots],
                torch.zeros_like(slots),
                filtered=mode.pick == Pick.FILTERED,
            )
        self.tokens[slots] = first
        self.positions[slots] = torch.clamp(last + 1, max=self.max_seq_len - 1)
        self.steps.index_fill_(0, slots, 1)  # a Python scalar here would be a host copy, refused in a capture
        return (first, *token_logprobs(logits, first, MAX_LOGPROBS)) if mode.logprobs else first

    def _prompt_logprobs(self, hidden: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probabilities of `targets` `(B, T)` (each position's next token) from `hidden` `(B, T, C)`, with
        the top ones; one row at a time, so the logits held at once are one prompt's `(T, V)`."""
        rows = [token_logprobs(self._logits(hidden[b]), targets[b], MAX_LOGPROBS) for b in range(hidden.shape[0])]
        return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])

    def _graphed_prefill(self, batch: int, width: int) -> bool:
        """Whether a prefill of `batch` rows (a batch bucket) at `width` replays a padded graph.

        With packing on, none of more rows than PACKED_PREFILL_MIN_PROMPTS does: 17 prompts or more within
        GRAPHED_PREFILL_TOKENS run packed, and more tokens than that are more than such a graph holds.
        """
        if self.packed_prefill and batch > PACKED_PREFILL_MIN_PROMPTS:
            return False
        return self.use_graphs and batch <= self.graphed_prefill_max and batch * width <= GRAPHED_PREFILL_TOKENS

    def _capture_prefill(self, batch: int, width: int, mode: SamplingMode) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        rows = self.staged_prompts[:batch, : PROMPT_HEADER + width]
        graph, out = self._capture_graph(lambda: self._prefill(rows, width, mode))
        self.prefill_graphs[(batch, width, mode)] = (graph, out)
        return graph, out

    def _prefill_attention(self) -> contextlib.AbstractContextManager:
        """On CUDA, keep prefills off cuDNN's attention, which plans anew for every (batch, width) it meets.

        Prefill batches come in any size (whoever is waiting), and each first-seen shape cost hundreds of
        ms of planning on an H200: requests that joined in a new group size waited for it. Flash attention
        needs no planning (prefills are plain causal, no mask); decode steps keep SDPA's choice, planned
        once per captured graph at warm-up.
        """
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])

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
        if self.decoder is not None:
            # Our kernels were faster than the compiled modules at batch 1, 64 and 256 on an H200
            # (tools/probes/decode_step_variants.py; docs/benchmarks.md).
            logits, positions, steps = self.decoder.forward(
                self.staged, self.tokens, self.positions, self.steps, self.cache.kv, batch
            )
            return logits[:, : self.vocab_limit], positions, steps
        staged = self.staged[:, :batch]
        fed = staged[3] != 0
        tokens = torch.where(fed, staged[0], self.tokens[:batch])
        positions = torch.where(fed, staged[1], self.positions[:batch])
        steps = torch.where(fed, staged[2], self.steps[:batch])
        view = self.cache.decode(positions, span)
        hidden = self.model.hidden(tokens[:, None], positions=positions[:, None], cache=view)  # (B, 1, C)
        return self._logits(hidden[:, -1]), positions, steps

    def _pick(
        self, logits: torch.Tensor, positions: torch.Tensor, steps: torch.Tensor, mode: SamplingMode
    ) -> torch.Tensor:
        """Each row's next token, left with its position + 1 and step + 1 as the next step's inputs."""
        batch = logits.shape[0]
        if mode.pick == Pick.GREEDY:
            # The same argmax `sample` takes for temperature-0 rows, without its sort and noise.
            out = argmax_in_blocks(logits) if logits.is_cuda and batch <= 16 else torch.argmax(logits.float(), dim=-1)
        else:
            out = sample(
                logits,
                self.temperature[:batch],
                self.top_k[:batch],
                self.top_p[:batch],
                self.seed[:batch],
                steps,
                filtered=mode.pick == Pick.FILTERED,
            )
        # A row whose sequence ended runs once more before the host knows; clamping keeps its
        # cache write inside the cache.
        self.tokens[:batch] = out
        self.positions[:batch] = torch.clamp(positions + 1, max=self.max_seq_len - 1)
        self.steps[:batch] = steps + 1
        if mode.logprobs:
            return (out, *token_logprobs(logits, out, MAX_LOGPROBS))
        return out

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
        buffer = self.launches % 2
        self.launches += 1
        host, rows = self.host_staged[buffer], self.host_staged_rows[buffer]
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
        self.staged.copy_(host, non_blocking=True)
        if self.use_graphs:
            graph, out = self.graphs.get((batch, span, mode)) or self._capture(batch, span, mode)
            graph.replay()
        else:
            out = self._decode_step(batch, span, mode)
        return self._hand_back(out, self.host_out[buffer], active, self.host_logprobs[buffer])

    def _hand_back(
        self,
        out: torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        host: torch.Tensor,
        count: int,
        host_logprobs: tuple[torch.Tensor, torch.Tensor],
    ) -> Launch:
        """`out[:count]` (tokens, or tokens with their log-probabilities and top ids) on its way to the
        pinned host buffers without waiting; the Launch that waits for it."""
        logprobs = None
        if isinstance(out, tuple):
            out, values, ids = out
            logprobs = host_logprobs
            logprobs[0][:count].copy_(values[:count], non_blocking=True)
            logprobs[1][:count].copy_(ids[:count], non_blocking=True)
        host[:count].copy_(out[:count], non_blocking=True)
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        return Launch(host, count, done, logprobs)

    def decode(self, tokens: list[int], positions: list[int], steps: list[int]) -> list[int]:
        """The next token for slots 0..len(tokens)-1, every row fed by the host, waiting for the result."""
        fed = np.array([tokens, positions, steps], dtype=np.int64)
        return self.launch(len(tokens), [], max(positions), fed).tokens()

    def _capture(self, batch: int, span: int, mode: SamplingMode) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # Rows that go on from the device's state advance it in each warm-up run: put it back after them.
        state = (self.tokens, self.positions, self.steps)
        graph, out = self._capture_graph(lambda: self._decode_step(batch, span, mode), keep=state)
        self.graphs[(batch, span, mode)] = (graph, out)
        return graph, out

    def _capture_graph(
        self, step: Callable[[], torch.Tensor], keep: tuple[torch.Tensor, ...] = ()
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """`step` captured as a CUDA graph, and the tensor it returns (filled by every replay).

        `step` runs once first, outside the graph: that loads its kernels and sizes cuBLAS's workspace,
        which a capture cannot do. (It ran twice, as torch's examples do. The eager runs are most of a
        replica's warm-up, but it is each kernel's first use that costs, so dropping the second run saved
        little: docs/benchmarks.md, a Serve replica's start. The GPU tests compare the graphs with the
        eager model.) `keep` are tensors it changes that must hold, after the capture, what they held
        before (a graph captured on first use, mid-sequence). All graphs share one memory pool: each
        output is read (copied to the host) right after its replay, before any other graph runs on the
        stream and may reuse that memory.
        """
        marks = [time.perf_counter()]
        torch.cuda.synchronize(self.device)  # the steps in flight: timed apart from the capture's own work
        marks.append(time.perf_counter())
        saved = [t.clone() for t in keep]
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            step()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        for tensor, before in zip(keep, saved, strict=True):
            tensor.copy_(before)
        torch.cuda.synchronize(self.device)  # the eager run's time, apart from the capture's
        marks.append(time.perf_counter())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool()):
            out = step()
        marks.append(time.perf_counter())
        self.captures += 1
        for phase in range(3):
            self.capture_phases_s[phase] += marks[phase + 1] - marks[phase]
        if not self._warming:  # a capture on first use holds up the engine's thread: the job's log says so
            self.captures_on_use += 1
            self.capture_on_use_s += marks[-1] - marks[0]
            logger.info(
                "captured a graph on first use in %.3f s (the steps in flight %.3f s, an eager run %.3f s, "
                "the capture %.3f s)",
                marks[-1] - marks[0],
                marks[1] - marks[0],
                marks[2] - marks[1],
                marks[3] - marks[2],
            )
        return graph, out

    def _pool(self):
        if not hasattr(self, "_graph_pool"):
            self._graph_pool = torch.cuda.graph_pool_handle()
        return self._graph_pool

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
        captures, phases = self.captures, list(self.capture_phases_s)
        self._warming = True
        try:
            decode_s = self._warm([SamplingMode(Pick(name), logprobs=False) for name in modes], prefills)
        finally:
            self._warming = False
        elapsed = time.perf_counter() - start
        phases = [now - before for now, before in zip(self.capture_phases_s, phases, strict=True)]
        logger.info(
            "engine warm: %d batch x %d span shapes x %d modes%s in %.1f s (decode %.1f s, prefill %.1f s%s)",
            len(self.batch_buckets),
            len(self.span_buckets),
            len(modes),
            " captured as CUDA graphs" if self.use_graphs else "",
            elapsed,
            decode_s,
            elapsed - decode_s,
            f"; {self.captures - captures} graphs: eager runs {phases[1]:.1f} s, captures {phases[2]:.1f} s, "
            f"waits {phases[0]:.1f} s"
            if self.captures > captures
            else "",
        )
        return elapsed

    def _warm(self, modes: list[SamplingMode], prefills: bool) -> float:
        """Warm-up's work; returns the seconds the decode shapes took."""
        start = time.perf_counter()
        self.positions.zero_()
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
        for width in self.prefill_buckets if prefills else ():
            self.prefill([[0] * width], [0])  # one prompt (on CUDA, through its greedy graph)
            if self.num_slots > 1:
                self.prefill([[0] * width] * 2, [0, 1])  # several
            eager_many = self.use_graphs and self.num_slots > self.graphed_prefill_max and not self.packed_prefill
            if eager_many:  # more than a graph takes: eager (with packing on, such a group runs packed)
                many = self.graphed_prefill_max + 1
                self.prefill([[0] * width] * many, list(range(many)))
            for batch in self.prefill_batch_buckets:
                warm = self._graphed_prefill(batch, width) and batch * width <= WARM_PREFILL_TOKENS
                for mode in modes if warm else ():
                    if (batch, width, mode) not in self.prefill_graphs:
                        self._capture_prefill(batch, width, mode)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return decode_s


class Launch:
    """A decode step started by `ModelRunner.launch`; its tokens once the device has them."""

    def __init__(
        self,
        result: torch.Tensor,
        active: int,
        done: torch.cuda.Event | None,
        logprobs: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        self.result, self.active, self.done, self._logprobs = result, active, done, logprobs
        # An echo prefill's: (B, T - 1, 1 + MAX_LOGPROBS) values and (B, T - 1, MAX_LOGPROBS) ids, on the host.
        self.prompt_logprobs: tuple[np.ndarray, np.ndarray] | None = None

    def tokens(self) -> list[int]:
        if self.done is not None:
            self.done.synchronize()
        return self.result[: self.active].tolist()

    def array(self) -> np.ndarray:
        """The tokens as a numpy array of their own (the pinned buffer is reused by a later launch)."""
        if self.done is not None:
            self.done.synchronize()
        return self.result[: self.active].numpy().copy()

    def logprobs(self) -> tuple[np.ndarray, np.ndarray] | None:
        """After `array()` or `tokens()`: (active, 1 + MAX_LOGPROBS) log-probabilities (the token's, then
        the top ones') and (active, MAX_LOGPROBS) the top ids, when the launch computed them."""
        if self._logprobs is None:
            return None
        values, ids = self._logprobs
        return values[: self.active].numpy().copy(), ids[: self.active].numpy().copy()
