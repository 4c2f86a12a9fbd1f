"""GPT-2 as one single-device module, with the Hugging Face parameter names.

Architecture only: no distribution, precision or compilation here; those are
applied from outside (see train/parallelize.py). Linear layers are
`nn.Linear` (weights `(out, in)`); Hugging Face stores them as `Conv1D`
(`(in, out)`), and checkpoint.py transposes on the way in and out.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

# transformers' names for the MLP activations (config.json `activation_function`) this model implements,
# each mapped to the function it computes. The tanh family are one formula written five ways.
ACTIVATIONS: dict[str, str] = {
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "gelu_python_tanh": "gelu_tanh",
    "gelu_accurate": "gelu_tanh",
    "gelu": "gelu",
    "gelu_python": "gelu",
    "relu": "relu",
    "silu": "silu",
    "swish": "silu",
}


@dataclass(frozen=True)
class GPT2Config:
    """The architecture, with transformers' `GPT2Config` names for every field that changes the arithmetic."""

    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    vocab_size: int = 50257
    n_positions: int = 1024
    dropout: float = 0.0
    layer_norm_epsilon: float = 1e-5
    n_inner: int | None = None
    """The MLP's hidden width; None means 4 x n_embd."""
    activation_function: str = "gelu_new"
    """The MLP's activation, by transformers' name (see ACTIVATIONS)."""
    tie_word_embeddings: bool = True
    """The LM head is the token embedding; False gives it a weight of its own."""
    scale_attn_weights: bool = True
    """Attention scores are divided by sqrt(head size)."""
    scale_attn_by_inverse_layer_idx: bool = False
    """Attention scores of layer i (from 0) are also divided by i + 1."""
    reorder_and_upcast_attn: bool = False
    """transformers' eager attention then computes scores and softmax in fp32. Every attention here
    (SDPA, flash, our decode kernel) already keeps scores and softmax in fp32, so the flag is carried
    for a faithful save and changes nothing."""

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if self.activation_function not in ACTIVATIONS:
            raise ValueError(
                f"activation_function={self.activation_function!r} is not implemented; "
                f"supported: {', '.join(ACTIVATIONS)}"
            )
        if self.n_inner is not None and self.n_inner <= 0:
            raise ValueError(f"n_inner={self.n_inner} must be a positive MLP width (or null for 4 x n_embd)")

    @property
    def mlp_width(self) -> int:
        return self.n_inner if self.n_inner is not None else 4 * self.n_embd

    @property
    def activation(self) -> str:
        """The MLP activation's function: gelu_tanh, gelu, relu or silu."""
        return ACTIVATIONS[self.activation_function]

    def attention_scale(self, layer: int) -> float:
        """The factor on layer `layer`'s attention scores (q @ k.T), as transformers' GPT-2 applies it."""
        scale = (self.n_embd // self.n_head) ** -0.5 if self.scale_attn_weights else 1.0
        if self.scale_attn_by_inverse_layer_idx:
            scale /= layer + 1
        return scale

    def to_dict(self) -> dict:
        return asdict(self)


# The real GPT-2 shapes, plus a tiny one for CPU tests and the demo. The tiny
# vocabulary fits the offline byte-level tokenizer (256 bytes + <|endoftext|>).
PRESETS: dict[str, GPT2Config] = {
    "tiny": GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=257, n_positions=256),
    "gpt2": GPT2Config(n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": GPT2Config(n_layer=24, n_head=16, n_embd=1024),
    "gpt2-large": GPT2Config(n_layer=36, n_head=20, n_embd=1280),
    "gpt2-xl": GPT2Config(n_layer=48, n_head=25, n_embd=1600),
}


def preset(name: str, **overrides: object) -> GPT2Config:
    """The config of a named preset, with optional field overrides."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
    return GPT2Config(**{**PRESETS[name].to_dict(), **overrides})


class AttentionCache(Protocol):
    """A key/value store for inference (see engine/cache.py): it keeps each step's keys and values and
    attends over everything it holds for the row."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """Store this step's k, v `(B, nh, T, hs)`; return the attention output `(B, nh, T, hs)` for q,
        with `scale` the factor on the scores."""
        ...


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPT2Config, layer: int = 0) -> None:
        super().__init__()
        self.layer = layer
        self.n_head = config.n_head
        self.scale = config.attention_scale(layer)
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, cache: AttentionCache | None = None) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, T, C) -> (B, nh, T, hs)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if cache is not None:
            y = cache.attend(self.layer, q, k, v, self.scale)
        else:
            # SDPA picks flash / memory-efficient kernels on GPU (plain causal case).
            dropout = self.dropout if self.training else 0.0
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout, scale=self.scale)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))


def activate(x: torch.Tensor, activation: str) -> torch.Tensor:
    """`GPT2Config.activation`'s function of x. GPT-2 itself uses the tanh approximation of GELU."""
    if activation == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if activation == "gelu":
        return F.gelu(x)
    if activation == "relu":
        return F.relu(x)
    assert activation == "silu", activation
    return F.silu(x)


class MLP(nn.Module):
    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, config.mlp_width)
        self.c_proj = nn.Linear(config.mlp_width, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)
        self.activation = config.activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(activate(self.c_fc(x), self.activation)))


class Block(nn.Module):
    def __init__(self, config: GPT2Config, layer: int = 0) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = CausalSelfAttention(config, layer)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cache: AttentionCache | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), cache)
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    """GPT-2 language model; `lm_head` shares its weight with `transformer.wte` unless
    `config.tie_word_embeddings` is False."""

    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.n_positions, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList(Block(config, layer) for layer in range(config.n_layer)),
                ln_f=nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.transformer.wte.weight
        if self.lm_head.weight.is_meta:
            return  # built to be loaded into (checkpoint.load_pretrained): there is nothing to initialise
        self.apply(self._init_weights)
        # GPT-2 scales the residual projections by 1/sqrt(2 * n_layer).
        for name, param in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(
        self,
        input_ids: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        positions: torch.Tensor | None = None,
        cache: AttentionCache | None = None,
        logits_at: torch.Tensor | None = None,
        loss_fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Logits `(B, T, vocab)` and, given next-token targets `(B, T)`, the mean cross-entropy.

        For training: `loss_fn(hidden, head_weight, targets)` computes the loss from the final hidden
        states in place of the head and cross-entropy (see train/loss.py); the logits are then None.

        For inference: `positions` `(B, T)` places the tokens (default 0..T-1), `cache`
        keeps keys and values between calls, and `logits_at` `(B,)` picks the one
        position per row whose logits are wanted (then `(B, vocab)`).
        """
        hidden = self.hidden(input_ids, positions=positions, cache=cache, hidden_at=logits_at)
        if loss_fn is not None and targets is not None:
            return None, loss_fn(hidden, self.lm_head.weight, targets)
        logits = self.lm_head(hidden)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-100)
        return logits, loss

    def hidden(
        self,
        input_ids: torch.Tensor,
        *,
        positions: torch.Tensor | None = None,
        cache: AttentionCache | None = None,
        hidden_at: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The final layer norm's output `(B, T, C)`, or `(B, C)` at `hidden_at`: everything but the LM head.

        The engine applies its own copy of the head (see engine/runner.py), padded to an aligned vocabulary.
        """
        B, T = input_ids.shape
        # With `positions` given, a row may hold several sequences back to back (the engine's packed prefill).
        if positions is None and T > self.config.n_positions:
            raise ValueError(f"sequence length {T} exceeds the model's context of {self.config.n_positions}")
        if positions is None:
            positions = torch.arange(T, device=input_ids.device)
        x = self.transformer.drop(self.transformer.wte(input_ids) + self.transformer.wpe(positions))  # (B, T, C)
        for block in self.transformer.h:
            x = block(x, cache)
        if hidden_at is not None:
            x = x[torch.arange(B, device=x.device), hidden_at]  # (B, C)
        return self.transformer.ln_f(x)

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameter count (a tied head counted once); non_embedding drops wte and wpe."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.transformer.wte.weight.numel() + self.transformer.wpe.weight.numel()
        return n


def flops_per_token(config: GPT2Config, seq_len: int) -> float:
    """Training FLOPs per token: 6N for the matmuls (forward + backward) plus attention's 12·L·d·T.

    N counts every parameter but the position embeddings: the token embedding is a lookup, and the
    LM head (the same weight when tied) a real matmul.
    """
    d, L, V, m = config.n_embd, config.n_layer, config.vocab_size, config.mlp_width
    # Per layer: QKV and out-projection (4d^2 + 4d), the MLP (2dm + m + d), two layer norms (4d).
    n = L * (4 * d * d + 2 * d * m + 9 * d + m) + V * d + 2 * d
    return 6 * n + 12 * L * d * seq_len
