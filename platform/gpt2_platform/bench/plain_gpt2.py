"""The anchor for the training benchmark: GPT-2 as one plain module, the way a user writes it by hand.

This is what someone who has read nanoGPT would write in an afternoon: fused QKV, SDPA with the causal
flag, tanh GELU, the head tied to the token embedding, the vocabulary padded to 50,304 so the head's
matmul has aligned shapes (the padding is never a target, so it learns to stay unlikely; the loss is
*not* the same function as unpadded GPT-2's, which is why the platform's model masks it instead),
bf16 autocast, torch.compile of the whole model, fused AdamW and the loss on logits upcast to fp32.
No platform code is used, so `bench_train.py` measures the platform against an independent baseline.
"""

from __future__ import annotations

import inspect
import math

import torch
import torch.nn.functional as F
from torch import nn

from gpt2_platform.model import GPT2Config


class _Block(nn.Module):
    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln_1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.fc_proj = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln_1(x)).view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.fc_proj(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))


class PlainGPT2(nn.Module):
    def __init__(self, config: GPT2Config, vocab_multiple: int = 64) -> None:
        super().__init__()
        d, L = config.n_embd, config.n_layer
        self.vocab = math.ceil(config.vocab_size / vocab_multiple) * vocab_multiple
        self.wte = nn.Embedding(self.vocab, d)
        self.wpe = nn.Embedding(config.n_positions, d)
        self.blocks = nn.ModuleList(_Block(d, config.n_head) for _ in range(L))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, self.vocab, bias=False)
        self.head.weight = self.wte.weight
        for name, p in self.named_parameters():
            if p.dim() >= 2:  # the residual projections scaled by 1/sqrt(2 L), as GPT-2 does
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * L) if name.endswith("proj.weight") else 0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
            else:  # layer norm scales
                nn.init.ones_(p)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return logits, F.cross_entropy(logits.float().view(-1, self.vocab), targets.reshape(-1))


class PlainStep:
    """The hand-written loop's step: autocast forward, backward, clip at 1.0, fused AdamW, zero grads."""

    def __init__(self, config: GPT2Config, device: torch.device, lr: float = 6e-4) -> None:
        self.device = device
        self.raw = PlainGPT2(config).to(device)
        self.model = torch.compile(self.raw)
        decay = [p for p in self.raw.parameters() if p.dim() >= 2]
        rest = [p for p in self.raw.parameters() if p.dim() < 2]
        fused = device.type == "cuda" and "fused" in inspect.signature(torch.optim.AdamW).parameters
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
            lr=lr,
            betas=(0.9, 0.95),
            fused=fused or None,
        )
        self.dtype = torch.bfloat16 if device.type == "cuda" else None

    def __call__(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], lr: float):
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        total = torch.zeros((), device=self.device)
        for inputs, targets in micro_batches:
            with torch.autocast(self.device.type, dtype=self.dtype or torch.bfloat16, enabled=self.dtype is not None):
                _, loss = self.model(inputs, targets)
            (loss / len(micro_batches)).backward()
            total += loss.detach() / len(micro_batches)
        norm = torch.nn.utils.clip_grad_norm_(self.raw.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total, norm
