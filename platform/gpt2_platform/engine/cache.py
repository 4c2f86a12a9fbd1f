"""A static key/value cache with one slot per running sequence.

Preallocated once: per layer, `(num_slots, max_seq_len, n_head, head_dim)` for keys
and for values, so decoding never allocates and a CUDA graph can replay it. A
sequence owns one slot from its prefill until it finishes; slot i is row i of
every decode batch, so a decode step reads `[:batch, :span]` without a gather.

On CUDA in half precision, a decode step attends with flash attention's
variable-length kernel, which reads each row's keys only up to its own position
(`seqused_k`): SDPA with a mask reads the whole span bucket, which at batch 64
was half of an H200's decode step. Elsewhere SDPA with a boolean mask.

One tensor per layer, not one for all layers: under torch.compile, a write into a
view of a larger tensor is functionalized into a copy of that whole tensor, which
on an H200 made every compiled decode step copy the entire cache (12.5 ms a step).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpt2_platform.model import GPT2Config


class KVCache:
    def __init__(
        self, config: GPT2Config, num_slots: int, max_seq_len: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        if max_seq_len > config.n_positions:
            raise ValueError(f"max_seq_len={max_seq_len} exceeds the model's context of {config.n_positions}")
        # Sequence before heads: a slot's keys are then rows [slot * max_seq_len, ...) of one
        # (num_slots * max_seq_len, n_head, head_dim) matrix, the packed layout flash attention reads.
        shape = (num_slots, max_seq_len, config.n_head, config.n_embd // config.n_head)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layer)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layer)]
        self.num_slots = num_slots
        self.max_seq_len = max_seq_len
        self.flash_decode = flash_decode_supported(device, dtype)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

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

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # Index (B, 1) x (B, T): the target is (B, T, nh, hs).
        self.cache.k[layer][self.slots, self.positions] = k.transpose(1, 2)
        self.cache.v[layer][self.slots, self.positions] = v.transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class DecodeView:
    """Writes one token per row and attends over the row's cache up to its own position."""

    def __init__(self, cache: KVCache, positions: torch.Tensor, span: int) -> None:
        batch, device = positions.shape[0], positions.device
        self.cache, self.positions, self.span = cache, positions, span
        self.rows = torch.arange(batch, device=device)
        if cache.flash_decode:
            # Row i's query is packed row i; its keys start at row i * max_seq_len of the packed cache,
            # and it uses its first position + 1 of them.
            self.query_starts = torch.arange(batch + 1, dtype=torch.int32, device=device)
            self.key_starts = self.query_starts * cache.max_seq_len
            self.used = (positions + 1).to(torch.int32)
        else:
            # (B, 1, 1, span): a row sees positions 0..its own, nothing past it.
            self.mask = (torch.arange(span, device=device)[None, :] <= positions[:, None])[:, None, None, :]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        batch = k.shape[0]
        k_layer, v_layer = self.cache.k[layer], self.cache.v[layer]
        k_layer[self.rows, self.positions] = k[:, :, 0]  # (B, nh, hs)
        v_layer[self.rows, self.positions] = v[:, :, 0]
        if self.cache.flash_decode:
            n_head, head_dim = k_layer.shape[-2:]
            out = torch.ops.aten._flash_attention_forward(
                q[:, :, 0],  # (B, nh, hs): one query per row
                k_layer.view(-1, n_head, head_dim),
                v_layer.view(-1, n_head, head_dim),
                self.query_starts,
                self.key_starts,
                1,
                self.span,
                0.0,
                False,
                False,
                seqused_k=self.used,
            )[0]
            return out[:, :, None]  # (B, nh, 1, hs)
        keys = k_layer[:batch, : self.span].transpose(1, 2)  # (B, nh, span, hs)
        values = v_layer[:batch, : self.span].transpose(1, 2)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=self.mask)


def flash_decode_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Flash attention's variable-length kernel with per-row key counts: CUDA, half precision, and a
    torch whose kernel takes `seqused_k` (2.5 on)."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return False
    schema = str(torch.ops.aten._flash_attention_forward.default._schema)
    return "seqused_k" in schema and torch.backends.cuda.is_flash_attention_available()
