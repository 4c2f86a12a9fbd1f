"""Prefill: new prompts into their KV-cache slots, padded to a shared width or packed back to back.

Prompts admitted together are staged as rows (a header, then the tokens) in one copy from pinned memory, which
waits for nothing on the host: a copy from pageable memory would wait for the decode step in flight. Up to
`graphed_prefill_max` of them replay a padded prefill graph per (batch bucket, width bucket, mode): eager, a
prefill's 200-odd small kernels cost milliseconds of launches, more host time than the engine's decode step,
and a server admits a few prompts at a time as requests arrive (jobs/bench_serve.py, engine profile). One graph
for all of them, not one replay each: a prefill of a few prompts takes about as long on the GPU as one
(tools/probes/prefill_batching.py). More prompts than that (a batch job's first wave) take one eager prefill,
or, with packing, run packed (PACKED_PREFILL_MIN_PROMPTS).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Callable

import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from gpt2_platform.engine.buffers import Launch, PrefillBuffers, SlotState, hand_back
from gpt2_platform.engine.cache import KVCache, PackedPrefillView, varlen_attention_available
from gpt2_platform.engine.config import MAX_LOGPROBS
from gpt2_platform.engine.graphs import Graph, GraphCache, bucket_for, buckets
from gpt2_platform.engine.modes import Pick, SamplingMode
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


def resolve_packed_prefill(packed_prefill: bool | None, dtype: torch.dtype, device: torch.device) -> bool:
    """`engine.packed_prefill` for this device: None is on CUDA where the GPU can (see below); true where it
    cannot is a ValueError."""
    # Variable-length attention is flash attention's: half precision, and GPUs from Ampere (sm80) on.
    packs_on_device = device.type != "cuda" or (
        dtype in (torch.bfloat16, torch.float16)
        and torch.cuda.get_device_capability(device) >= (8, 0)
        and varlen_attention_available()
    )
    if packed_prefill is None:
        return device.type == "cuda" and packs_on_device
    if packed_prefill and not packs_on_device:
        raise ValueError(
            "engine.packed_prefill=true needs bf16 or fp16 on an Ampere or later GPU (flash attention's "
            f"variable-length kernel), with a torch that has it; this engine is {dtype} on "
            f"{torch.cuda.get_device_name(device)}: set engine.packed_prefill to null or false"
        )
    return packed_prefill


class Prefiller:
    """Runs new prompts into their slots, each from position 0, and picks each one's first token: padded
    (replayed as a graph, or eager), or packed; leaves each slot as a decode step reads it."""

    def __init__(
        self,
        model: GPT2,
        cache: KVCache,
        state: SlotState,
        sampling: list[tuple[float, int, float, int]],
        logits: Callable[[torch.Tensor], torch.Tensor],
        graphs: GraphCache,
        *,
        num_slots: int,
        max_seq_len: int,
        device: torch.device,
        use_graphs: bool,
        packed_prefill: bool,
    ) -> None:
        """`cache` and `state` have a column per slot and one for scratch; `sampling`: every slot's (temperature,
        top-k, top-p, seed) as set on the host (the runner's list, read at each prefill); `logits`: the LM head's
        logits of hidden states."""
        self.model, self.cache, self.state, self.sampling, self.logits = model, cache, state, sampling, logits
        self.graphs, self.use_graphs, self.packed_prefill = graphs, use_graphs, packed_prefill
        self.num_slots, self.max_seq_len = num_slots, max_seq_len
        self.on_cuda = device.type == "cuda"
        # The padding rows of a graph (a few prompts padded to its batch), and a packed graph's padding tokens,
        # write their cache entries and decode state into this slot, never into a sequence's.
        self.scratch_slot = num_slots
        self.widths = buckets(max_seq_len, min(16, max_seq_len))
        self.graphed_prefill_max = min(GRAPHED_PREFILL_MAX, num_slots)
        self.batch_buckets = buckets(self.graphed_prefill_max, 1)
        self.packed_prompt_buckets = buckets(num_slots, min(PACKED_PREFILL_MIN_PROMPTS, num_slots))
        # One column past the context: a scored prompt's last token, a target only (requests.scoring_only).
        self.staged_prompts = torch.zeros(num_slots, PROMPT_HEADER + max_seq_len + 1, dtype=torch.long, device=device)
        packed_length = packed_layout(num_slots, GRAPHED_PREFILL_TOKENS)[-1]
        self.staged_packed = torch.zeros(packed_length, dtype=torch.long, device=device)
        self.buffers = [
            PrefillBuffers.allocate(self.staged_prompts.shape[1], packed_length, num_slots, pinned=self.on_cuda)
            for _ in range(2)
        ]
        self.prompt_positions = torch.arange(max_seq_len, device=device)[None, :]
        self.prefills = 0
        self.packed_prefills = 0  # how many ran packed

    def start(self, prompts: list[list[int]], slots: list[int], mode: SamplingMode, echo: bool = False) -> Launch:
        """As `ModelRunner.start_prefill`, with the prompts' sampling `mode`."""
        batch = len(prompts)
        buffers = self.buffers[self.prefills % 2]
        self.prefills += 1
        if buffers.done is not None:
            buffers.done.synchronize()  # the copy from these buffers two prefills ago; long finished in an engine
        longest = max(len(p) for p in prompts)
        # A scored prompt one token past the context feeds all but its last token (a target only).
        assert longest <= self.max_seq_len or echo, f"a prompt of {longest} tokens is over the context"
        if (
            self.packed_prefill
            and not echo
            and batch >= PACKED_PREFILL_MIN_PROMPTS
            and sum(map(len, prompts)) <= GRAPHED_PREFILL_TOKENS
        ):
            launch = self._start_packed(prompts, slots, buffers, mode)
        else:
            launch = self._start_padded(prompts, slots, buffers, mode, longest, echo)
        buffers.done = launch.done
        return launch

    def _start_padded(
        self,
        prompts: list[list[int]],
        slots: list[int],
        buffers: PrefillBuffers,
        mode: SamplingMode,
        longest: int,
        echo: bool,
    ) -> Launch:
        """The prompts padded to a power-of-two width: few shapes, each warmed before serving (a new attention
        shape costs hundreds of ms of kernel planning on its first use)."""
        batch = len(prompts)
        width = bucket_for(min(longest, self.max_seq_len), self.widths)
        bucket = bucket_for(batch, self.batch_buckets) if batch <= self.graphed_prefill_max else batch
        graphed = self.graphed(bucket, width) and not echo
        rows_in = bucket if graphed else batch  # a graph's batch takes padding rows
        host = buffers.prompts
        rows = host.numpy()
        self._write_headers(rows[:rows_in], prompts, slots)
        for row, prompt in enumerate(prompts):
            rows[row, PROMPT_HEADER : PROMPT_HEADER + len(prompt)] = prompt
        # One contiguous run of the buffer, up to the last row's last prompt column: a strided slice (only
        # the columns some prompt reaches) would go through a pageable temporary (see `ModelRunner.launch`).
        # Padding past a prompt, stale or not, is never read as its own: causal attention keeps it out of the
        # prompt's outputs, and decode steps overwrite those positions' cache entries before they read them.
        end = (rows_in - 1) * host.shape[1] + PROMPT_HEADER + longest
        self.staged_prompts.view(-1)[:end].copy_(host.view(-1)[:end], non_blocking=True)
        if graphed:
            graph, out = self.graphs.prefill.get((rows_in, width, mode)) or self._capture_padded(rows_in, width, mode)
            graph.replay()
        else:
            out = self._padded(self.staged_prompts[:batch, : PROMPT_HEADER + width + 1], width, mode, echo)
        prompt_logprobs = None
        if echo:
            out, prompt_logprobs = out
        launch = hand_back(out, buffers.firsts, batch, buffers.logprobs, self.on_cuda)
        if prompt_logprobs is not None:
            values, ids = prompt_logprobs
            launch.prompt_logprobs = (values.cpu().numpy(), ids.cpu().numpy())
        return launch

    def _write_headers(self, rows: np.ndarray, prompts: list[list[int]], slots: list[int]) -> None:
        """Each prompt's header row (slot, last index, sampling parameters) into `rows` `(R, >= PROMPT_HEADER)`;
        the rows past the prompts (a graph's padding) are greedy, one token long, into the scratch slot."""
        as_float: np.ndarray = rows.view("float64")
        for row, (prompt, slot) in enumerate(zip(prompts, slots, strict=True)):
            temperature, top_k, top_p, seed = self.sampling[slot]
            last = min(len(prompt), self.max_seq_len) - 1
            rows[row, _SLOT], rows[row, _LAST], rows[row, _TOP_K], rows[row, _SEED] = slot, last, top_k, seed
            as_float[row, _TEMPERATURE], as_float[row, _TOP_P] = temperature, top_p
        rows[len(prompts) :, :PROMPT_HEADER] = [self.scratch_slot, 0, 0, 0, 0, 0]
        as_float[len(prompts) :, _TOP_P] = 1.0

    def _start_packed(
        self, prompts: list[list[int]], slots: list[int], buffers: PrefillBuffers, mode: SamplingMode
    ) -> Launch:
        """Start prompts (each within the context) packed back to back into their slots; as `start`.

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
        host = buffers.packed
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
            graph, out = self.graphs.packed.get((count, tokens, mode)) or self._capture_packed(count, tokens, mode)
            graph.replay()
        else:
            out = self._packed(count, tokens, mode, bounds=[0, *ends.tolist()])
        return hand_back(out, buffers.firsts, batch, buffers.logprobs, self.on_cuda)

    def _packed(self, count: int, tokens: int, mode: SamplingMode, bounds: list[int] | None = None):
        """The packed prompts staged in `staged_packed` (`packed_layout(count, tokens)`) into their slots; the
        first token of each, as `_padded` leaves them. `bounds`: where the prompts start and end, on the host
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

    def _capture_packed(self, count: int, tokens: int, mode: SamplingMode) -> Graph:
        return self.graphs.capture(self.graphs.packed, (count, tokens, mode), lambda: self._packed(count, tokens, mode))

    def _padded(self, rows: torch.Tensor, width: int, mode: SamplingMode, echo: bool = False):
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
        with self._attention():
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
        state = self.state
        slots, last = rows[:, _SLOT], rows[:, _LAST]
        state.temperature[slots] = rows[:, _TEMPERATURE].view(torch.float64).float()
        state.top_k[slots] = rows[:, _TOP_K]
        state.top_p[slots] = rows[:, _TOP_P].view(torch.float64).float()
        state.seed[slots] = rows[:, _SEED]
        logits = self.logits(hidden)
        # The same choice of pick as a decode step's: for greedy rows only, the argmax without sample's
        # float64 sort and noise over the whole vocabulary.
        if mode.pick == Pick.GREEDY:
            first = torch.argmax(logits.float(), dim=-1)
        else:
            first = sample(
                logits,
                state.temperature[slots],
                state.top_k[slots],
                state.top_p[slots],
                state.seed[slots],
                torch.zeros_like(slots),
                filtered=mode.pick == Pick.FILTERED,
            )
        state.tokens[slots] = first
        state.positions[slots] = torch.clamp(last + 1, max=self.max_seq_len - 1)
        state.steps.index_fill_(0, slots, 1)  # a Python scalar here would be a host copy, refused in a capture
        return (first, *token_logprobs(logits, first, MAX_LOGPROBS)) if mode.logprobs else first

    def _prompt_logprobs(self, hidden: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probabilities of `targets` `(B, T)` (each position's next token) from `hidden` `(B, T, C)`, with
        the top ones; one row at a time, so the logits held at once are one prompt's `(T, V)`."""
        rows = [token_logprobs(self.logits(hidden[b]), targets[b], MAX_LOGPROBS) for b in range(hidden.shape[0])]
        return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])

    def graphed(self, batch: int, width: int) -> bool:
        """Whether a prefill of `batch` rows (a batch bucket) at `width` replays a padded graph.

        With packing on, none of more rows than PACKED_PREFILL_MIN_PROMPTS does: 17 prompts or more within
        GRAPHED_PREFILL_TOKENS run packed, and more tokens than that are more than such a graph holds.
        """
        if self.packed_prefill and batch > PACKED_PREFILL_MIN_PROMPTS:
            return False
        return self.use_graphs and batch <= self.graphed_prefill_max and batch * width <= GRAPHED_PREFILL_TOKENS

    def capture_warm(self, width: int, modes: list[SamplingMode]) -> None:
        """Warm-up's padded graphs at `width` in `modes`: every batch bucket that replays a graph, up to
        WARM_PREFILL_TOKENS tokens (larger ones on first use)."""
        for batch in self.batch_buckets:
            warm = self.graphed(batch, width) and batch * width <= WARM_PREFILL_TOKENS
            for mode in modes if warm else ():
                if (batch, width, mode) not in self.graphs.prefill:
                    self._capture_padded(batch, width, mode)

    def _capture_padded(self, batch: int, width: int, mode: SamplingMode) -> Graph:
        rows = self.staged_prompts[:batch, : PROMPT_HEADER + width]
        return self.graphs.capture(self.graphs.prefill, (batch, width, mode), lambda: self._padded(rows, width, mode))

    def _attention(self) -> contextlib.AbstractContextManager:
        """On CUDA, keep prefills off cuDNN's attention, which plans anew for every (batch, width) it meets.

        Prefill batches come in any size (whoever is waiting), and each first-seen shape cost hundreds of
        ms of planning on an H200: requests that joined in a new group size waited for it. Flash attention
        needs no planning (prefills are plain causal, no mask); decode steps keep SDPA's choice, planned
        once per captured graph at warm-up.
        """
        if not self.on_cuda:
            return contextlib.nullcontext()
        return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
