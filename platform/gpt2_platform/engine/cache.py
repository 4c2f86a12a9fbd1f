"""A static key/value cache with one slot per running sequence.

Preallocated once: per layer, `(num_slots, 2, n_head, max_seq_len, head_dim)`, keys
then values, so decoding never allocates and a CUDA graph can replay it. Keys and
values share a tensor so that a step writes both in one kernel, not two. A
sequence owns one slot from its prefill until it finishes; slot i is row i of
every decode batch, so a decode step reads `[:batch, :, :, :span]` without a gather.

One tensor per layer, not one for all layers: under torch.compile, a write into a
view of a larger tensor is functionalized into a copy of that whole tensor, which
on an H200 made every compiled decode step copy the entire cache (12.5 ms a step).
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from gpt2_platform.engine import kernels
from gpt2_platform.model import GPT2Config


class KVCache:
    def __init__(
        self, config: GPT2Config, num_slots: int, max_seq_len: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        if max_seq_len > config.n_positions:
            raise ValueError(f"max_seq_len={max_seq_len} exceeds the model's context of {config.n_positions}")
        shape = (num_slots, 2, config.n_head, max_seq_len, config.n_embd // config.n_head)
        # Read and written only through these tensors: a compiled step given both a layer's tensor and
        # a view of it would see two aliased inputs, one of them written.
        self.kv = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layer)]
        self.num_slots = num_slots
        self.max_seq_len = max_seq_len
        # How a prefill writes its keys and values: None chooses (our kernel, kernels.write_cache, on CUDA
        # where Triton is installed); False keeps the indexed assignment (tools/probes/prefill_cost.py times
        # both; tests force either).
        self.prefill_write_kernel: bool | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kv)

    def prefill(self, slots: torch.Tensor, positions: torch.Tensor) -> PrefillView:
        """For a batch of prompts starting at position 0: rows go to `slots` `(B,)` at `positions` `(B, T)`."""
        return PrefillView(self, slots, positions)

    def decode(self, positions: torch.Tensor, span: int) -> DecodeView:
        """For one new token in each of the first `B` slots at `positions` `(B,)`, attending over `[0, span)`."""
        return DecodeView(self, positions, span)


class PrefillView:
    """Writes the prompt's keys and values; attention is plain causal over the prompt itself."""

    def __init__(self, cache: KVCache, slots: torch.Tensor, positions: torch.Tensor) -> None:
        self.cache, self.slots, self.positions = cache, slots[:, None], positions
        write_kernel = cache.prefill_write_kernel
        if write_kernel is None:
            write_kernel = cache.kv[0].is_cuda and kernels.available()
        self.write_kernel = write_kernel
        if write_kernel:  # each token's slot and position, flattened as the kernel reads them
            # contiguous(): for one prompt, reshape keeps the expand's zero stride (a view, not a copy).
            self.token_slots = self.slots.expand_as(positions).reshape(-1).contiguous()
            self.token_positions = positions.reshape(-1).contiguous()

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        if self.write_kernel:
            # (B, nh, T, hs) -> (B * T, nh, hs): a view of the projection's output, no copy.
            k_tokens, v_tokens = [t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3]) for t in (k, v)]
            kernels.write_cache(k_tokens, v_tokens, self.cache.kv[layer], self.token_slots, self.token_positions)
        else:
            # Index (B, 1) x (B, T) around the head dim: the target is (B, T, 2, nh, hs).
            kv = torch.stack((k.transpose(1, 2), v.transpose(1, 2)), dim=2)
            self.cache.kv[layer][self.slots, :, :, self.positions] = kv
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


def _varlen_attn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch before 2.10
        return None
    return varlen_attn


def varlen_attention_available() -> bool:
    """Whether this torch has variable-length attention (flash attention over packed sequences, CUDA): from
    torch 2.10, where `varlen_attn` made the flash op's packed form public (and where it was tested here)."""
    return _varlen_attn() is not None and hasattr(torch.ops.aten, "_flash_attention_forward")


class PackedPrefillView:
    """Prompts packed back to back in one row `(1, N)`, each from position 0: writes every token's keys and
    values into its slot, and attends causally within each prompt.

    On CUDA, variable-length (flash) attention over `starts`, with `longest` as its bound (the context, in
    a graph that serves every group of prompts); tokens past the last prompt's end (a graph's padding)
    belong to no prompt: their outputs are never read. On CPU, one attention a prompt over the host's
    `bounds`.
    """

    def __init__(
        self,
        cache: KVCache,
        slots: torch.Tensor,
        positions: torch.Tensor,
        starts: torch.Tensor,
        longest: int,
        bounds: list[int] | None = None,
    ) -> None:
        """`slots`, `positions` `(N,)`: each token's (contiguous); `starts` `(B + 1,)`: where each prompt
        begins, then where the last one ends; `bounds`: the same on the host (CPU only)."""
        self.cache, self.slots, self.positions, self.longest, self.bounds = cache, slots, positions, longest, bounds
        self.on_cuda = cache.kv[0].is_cuda
        self.starts = starts.to(torch.int32)
        if not self.on_cuda and bounds is None:
            raise ValueError("a packed prefill on CPU needs the prompts' bounds on the host")

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        # (1, nh, N, hs) -> (N, nh, hs): views of the input projection's output.
        q, k, v = (t[0].transpose(0, 1) for t in (q, k, v))
        if self.on_cuda and kernels.available():
            kernels.write_cache(k, v, self.cache.kv[layer], self.slots, self.positions)
        else:
            self.cache.kv[layer][self.slots, :, :, self.positions] = torch.stack((k, v), dim=1)  # (N, 2, nh, hs)
        if self.on_cuda:
            # The flash kernel that `varlen_attn` runs, called as the aten op: the public function reaches it
            # through a custom op whose kernel is wrapped to disable dynamo, and that wrapper's first call
            # imports torch._dynamo, seconds that a batch job's first packed prefill waited for, mid-run, in
            # an engine that compiles nothing (py-spy of the job's actor: docs/benchmarks.md, batch generation).
            # Flash, as `varlen_attn` chose here, not cuDNN (see engine/prefill.py, Prefiller._attention). Causal within
            # each prompt, as window (-1, 0) is.
            out = torch.ops.aten._flash_attention_forward(
                q, k, v, self.starts, self.starts, self.longest, self.longest, 0.0, True, False, scale=scale
            )[0]
        else:
            assert self.bounds is not None  # __init__ requires them on CPU
            out = torch.zeros_like(q)
            for a, b in itertools.pairwise(self.bounds):
                prompt_q, prompt_k, prompt_v = (t[a:b].transpose(0, 1) for t in (q, k, v))
                prompt_out = F.scaled_dot_product_attention(prompt_q, prompt_k, prompt_v, is_causal=True, scale=scale)
                out[a:b] = prompt_out.transpose(0, 1)
        return out.transpose(0, 1)[None]  # (1, nh, N, hs)


class DecodeView:
    """Writes one token per row and attends over the row's cache up to its own position."""

    def __init__(self, cache: KVCache, positions: torch.Tensor, span: int) -> None:
        batch = positions.shape[0]
        self.cache, self.positions, self.span = cache, positions, span
        self.rows = torch.arange(batch, device=positions.device)
        # (B, 1, 1, span): a row sees positions 0..its own, nothing past it.
        self.mask = (torch.arange(span, device=positions.device)[None, :] <= positions[:, None])[:, None, None, :]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        batch = k.shape[0]
        kv = self.cache.kv[layer]
        kv[self.rows, :, :, self.positions] = torch.stack((k[:, :, 0], v[:, :, 0]), dim=1)  # (B, 2, nh, hs)
        keys, values = kv[:batch, 0, :, : self.span], kv[:batch, 1, :, : self.span]
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=self.mask, scale=scale)
