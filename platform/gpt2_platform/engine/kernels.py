"""Triton kernels for the decode step: up to batch 4, a GPT-2 layer in five launches instead of about eleven.

Why by hand: a decode step at small batch is a chain of small, latency-bound kernels. The compiled
step of GPT-2 124M launches over a hundred kernels at batch 1 and spends several times longer on their
launches and gaps than its weights take to stream at the card's bandwidth
(docs/benchmarks.md, engine and generation).
cuBLAS, inductor's fusions and its Triton GEMM templates still give every layer norm, bias, GELU,
residual add, cache write and attention its own kernel or its own GEMM. These kernels fold each
of those into the GEMV that reads the weights anyway, or into the attention:

- `ln_linear`: layer norm of the input rows, then `x @ W.T + bias`, then the MLP's activation
  (GELU in GPT-2; any of `model.ACTIVATIONS`) or a residual add.
- `decode_attention`: writes the step's key and value into the cache and attends over the row's
  positions only (not a whole span bucket), one program per (row, head).
- `embed`: picks each row's token, position and step (fed by the host, or left by the previous
  step), and adds the token and position embeddings.

A layer up to `GEMV_MAX_BATCH` rows is then: ln_1 + QKV, attention, out-projection + residual,
ln_2 + FC + GELU, down-projection + residual; above it, cuBLAS GEMMs that add the residual in
place, around our attention and a layer norm that adds the bias the GEMM left out. On
Hopper they launch with programmatic dependent launch (`pdl_supported`). Numerics follow the
model's own path in its dtype: every GEMM accumulates in fp32 and rounds its output once to the
activation dtype, as cuBLAS does, and residual adds are done on the rounded values; past
`GEMV_MAX_BATCH` the residual is added inside the GEMM's fp32 sum and the bias after the rounding.

The kernels run on CUDA, and in Triton's interpreter on CPU (`TRITON_INTERPRET=1`), which the tests
use to check them against the model on a machine without a GPU. Their Triton sources are in
`kernels_jit.py`, imported on the first launch, so that importing the engine does not import Triton.
"""

from __future__ import annotations

import importlib.util
import math
import os

import torch
import torch.nn.functional as F

from gpt2_platform.model import activate


def available() -> bool:
    """Whether Triton is installed (the CPU build of torch does not bring it; the engine then keeps the torch
    path). Asked without importing it: see `_jit`."""
    return importlib.util.find_spec("triton") is not None


def _jit():
    """The kernels' Triton sources, imported on the first launch rather than with the engine: a worker that
    never launches one (any CPU engine outside the tests' interpreter) then never loads Triton, whose native
    bindings print leak reports when such a process exits."""
    from gpt2_platform.engine import kernels_jit

    return kernels_jit


# `ln_linear`'s activation codes, by `GPT2Config.activation` (0 is none).
_ACTIVATION_CODES = {"gelu_tanh": 1, "gelu": 2, "relu": 3, "silu": 4}


def unsupported(config) -> str | None:
    """Why these kernels cannot run a model of this `GPT2Config`, or None if they can."""
    head_dim = config.n_embd // config.n_head
    if head_dim & (head_dim - 1):
        return f"the attention kernel needs a power-of-two head size; this model's is {head_dim}"
    return None


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def pdl_supported(device: torch.device) -> bool:
    """Whether kernels on `device` can use programmatic dependent launch: CUDA on Hopper (sm_90) or newer.

    Why: at batch 1 a decode step is about 60 of our kernels in a row, each a few microseconds, and
    the gap between two of them in a CUDA graph is part of every one. With it, a kernel starts while the
    one before is finishing, loads its weights, then waits for its input (`gdc_wait`).
    """
    return (
        device.type == "cuda"
        and available()
        and torch.cuda.get_device_capability(device)[0] >= 9
        and not os.environ.get("TRITON_INTERPRET")
    )


def _launch(pdl: bool) -> dict:
    # Passed only when set: Triton's interpreter takes no launch_pdl.
    return {"launch_pdl": True} if pdl else {}


GEMV_MAX_BATCH = 4
"""Up to this many rows, linears run as our GEMV kernel; past it, as cuBLAS GEMMs (see `TritonDecoder`).

Where the two cross on an H200 (graph replay of the whole step, tools/probes/decode_step_variants.py;
docs/benchmarks.md, engine and generation): the GEMV wins at the smallest batches and loses a few rows
up, because it reads the weights once per row."""


def linear_config(n: int, k: int) -> dict[str, int]:
    """Tile sizes for `ln_linear`: a GEMV, one row a program (the grid's second axis runs over rows).

    At batch 1 on an H200 (tools/probes/triton_kernels.py, weights hot in L2; docs/benchmarks.md, engine and generation),
    8 output columns a program with whole
    1,024-wide rows of K loaded at once was
    the fastest of seven tilings for every linear of GPT-2 124M, and beat cuBLAS plus torch's layer
    norm on each. Tiles of several rows (`tl.dot` at 16-64 rows, or products of 4 rows with K cut to 256
    to fit the registers) lost to cuBLAS, which is why rows past `GEMV_MAX_BATCH` go to cuBLAS.
    """
    return dict(BLOCK_N=8, BLOCK_K=min(_pow2(k), 1024), num_warps=8)


def ln_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    ln: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    activation: str | None = None,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """`act(layer_norm(x) @ weight.T + bias) (+ residual)` for `x` `(B, K)`; `out` may be `residual` itself.

    `activation`: None, or a `GPT2Config.activation` (gelu_tanh, gelu, relu, silu).

    `pdl`: launch with programmatic dependent launch (`pdl_supported`), so that this kernel loads its
    weights while the kernel before it finishes.
    """
    batch, k = x.shape
    n = weight.shape[0]
    assert weight.shape[1] == k and x.is_contiguous() and weight.is_contiguous()
    if out is None:
        out = torch.empty(batch, n, dtype=x.dtype, device=x.device)
    config = dict(config or linear_config(n, k))
    num_warps = config.pop("num_warps")
    grid = ((n + config["BLOCK_N"] - 1) // config["BLOCK_N"], batch)
    ln_w, ln_b, eps = ln if ln is not None else (None, None, 0.0)
    _jit().ln_linear_kernel[grid](
        x,
        ln_w,
        ln_b,
        weight,
        bias,
        residual,
        out,
        n,
        eps,
        K=k,
        LN=ln is not None,
        HAS_BIAS=bias is not None,
        ACTIVATION=0 if activation is None else _ACTIVATION_CODES[activation],
        RESIDUAL=residual is not None,
        PDL=pdl,
        num_warps=num_warps,
        **config,
        **_launch(pdl),
    )
    return out


def write_cache(
    k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor
) -> None:
    """Store tokens' keys and values `k`, `v` `(N, H, D)` (any strides: views of the attention's input
    projection) into the layer's cache `kv` `(slots, 2, H, T, D)` at `slots`, `positions` `(N,)`.

    Why not an indexed assignment: a prefill's write went through torch's generic index kernel plus a
    stack of k and v, a large share of a batch job's prefill (tools/probes/prefill_cost.py,
    docs/benchmarks.md, batch generation). One program a token reads its keys and values where
    the projection left them and writes each head's D values contiguously.
    """
    tokens, heads, head_dim = k.shape
    assert kv.is_contiguous() and kv.shape[1] == 2 and k.stride(2) == 1 and v.stride(2) == 1
    assert slots.is_contiguous() and positions.is_contiguous(), "one slot and one position a token, contiguous"
    _jit().cache_write_kernel[(tokens,)](
        k,
        v,
        kv,
        slots,
        positions,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        kv.stride(0),
        kv.stride(1),
        kv.stride(2),
        H=heads,
        D=head_dim,
        BLOCK=_pow2(heads * head_dim),
        num_warps=4,
    )


def decode_attention(
    qkv: torch.Tensor,
    kv: torch.Tensor,
    positions: torch.Tensor,
    scale: float | None = None,
    block_t: int | None = None,
    pdl: bool = False,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Attention of one new token per row: `qkv` `(B, 3C)`; `kv` the layer's cache `(slots, 2, H, T, D)`.

    Row i is cache slot i. Writes the rows' keys and values at `positions` `(B,)`, then attends over
    positions 0..positions[i] of slot i, with `scale` on the scores (default 1/sqrt(D)). Returns `(B, C)`.
    `num_stages` above 0: the loop over cache blocks software-pipelined that deep (CUDA only; the
    interpreter runs the plain loop whatever it is).
    """
    batch = qkv.shape[0]
    _, two, heads, _, head_dim = kv.shape
    if block_t is None:
        # Few rows leave most of the card idle, so each program takes a longer span of positions; many
        # rows fill it, and from 256 rows (where the attention is most of the step) short blocks with 2
        # warps read the cache fastest. tools/probes/triton_kernels.py sweeps these choices.
        block_t = 256 if batch <= 8 else 128 if batch < 256 else 64
    if num_warps is None:
        num_warps = 2 if batch >= 256 else 4
    if num_stages is None:
        # From 256 rows, software-pipelining the cache loop 2 deep read it faster (the probe's sweep at 256
        # and 1,024 rows: docs/benchmarks.md, batch generation); below, not measured: the plain loop.
        num_stages = 2 if batch >= 256 else 0
    assert two == 2 and kv.is_contiguous() and qkv.is_contiguous() and qkv.shape[1] == 3 * heads * head_dim
    out = torch.empty(batch, heads * head_dim, dtype=qkv.dtype, device=qkv.device)
    _jit().decode_attention_kernel[(batch, heads)](
        qkv,
        kv,
        positions,
        out,
        1.0 / math.sqrt(head_dim) if scale is None else scale,
        kv.stride(0),
        kv.stride(1),
        kv.stride(2),
        H=heads,
        D=head_dim,
        BLOCK_T=block_t,
        PDL=pdl,
        STAGES=0 if os.environ.get("TRITON_INTERPRET") else num_stages,
        num_warps=num_warps,
        **_launch(pdl),
    )
    return out


def add_layer_norm(
    x: torch.Tensor, bias: torch.Tensor | None, ln: tuple[torch.Tensor, torch.Tensor, float], pdl: bool = False
) -> torch.Tensor:
    """`x += bias` in place (when `bias` is given), then return `layer_norm(x)`; `x` `(B, C)`, one launch.

    Lets a GEMM add the residual itself (`x.addmm_`, beta = 1) and leave its bias to the layer norm
    that reads `x` next, so neither the residual add nor the bias costs a kernel of its own. `pdl`:
    launch with programmatic dependent launch, so that the launch overlaps the GEMM's last blocks.
    """
    batch, width = x.shape
    assert x.is_contiguous()
    ln_w, ln_b, eps = ln
    y = torch.empty_like(x)
    _jit().add_layer_norm_kernel[(batch,)](
        x,
        bias,
        ln_w,
        ln_b,
        y,
        eps,
        C=width,
        BLOCK_C=_pow2(width),
        HAS_BIAS=bias is not None,
        PDL=pdl,
        num_warps=4,
        **_launch(pdl),
    )
    return y


def embed(
    staged: torch.Tensor,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    steps: torch.Tensor,
    wte: torch.Tensor,
    wpe: torch.Tensor,
    batch: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `batch` rows' embeddings `(B, C)`, and their (token, position, step) `(3, S)`.

    A row takes its inputs from `staged` `(4, S)` where its fed flag is set, else from what the
    previous step left in `tokens`, `positions` and `steps` `(S,)`.
    """
    slots = tokens.shape[0]
    width = wte.shape[1]
    current = torch.empty(3, slots, dtype=tokens.dtype, device=tokens.device)
    x = torch.empty(batch, width, dtype=wte.dtype, device=wte.device)
    _jit().embed_kernel[(batch,)](
        staged, tokens, positions, steps, current, wte, wpe, x, slots, C=width, BLOCK_C=_pow2(width), num_warps=4
    )
    return x, current


class TritonDecoder:
    """The model's decode step from these kernels, plus cuBLAS where it is faster.

    Per layer at up to `GEMV_MAX_BATCH` rows: 5 launches (QKV with ln_1, attention with the cache
    write, out-projection with the residual, FC with ln_2 and GELU, down-projection with the
    residual). Past it, 7 (`gemm_layers`): cuBLAS GEMMs, which our `tl.dot` tiles did not beat, that
    add the residual themselves, around our attention and our layer norms that add the bias. The LM
    head is always cuBLAS: 77 MB streamed, where our kernel was no faster on an H200
    (docs/benchmarks.md, engine and generation).

    Holds references to the model's own parameters (no copies), so it follows weights loaded later.
    `pdl`: programmatic dependent launch between our kernels; None: where the device supports it.
    """

    def __init__(self, model: torch.nn.Module, head: torch.Tensor, pdl: bool | None = None) -> None:
        t = model.transformer
        self.wte, self.wpe = t.wte.weight, t.wpe.weight
        self.activation = model.config.activation
        self.scales = [model.config.attention_scale(layer) for layer in range(len(t.h))]
        self.layers = [
            (
                (b.ln_1.weight, b.ln_1.bias, b.ln_1.eps),
                (b.attn.c_attn.weight, b.attn.c_attn.bias),
                (b.attn.c_proj.weight, b.attn.c_proj.bias),
                (b.ln_2.weight, b.ln_2.bias, b.ln_2.eps),
                (b.mlp.c_fc.weight, b.mlp.c_fc.bias),
                (b.mlp.c_proj.weight, b.mlp.c_proj.bias),
            )
            for b in t.h
        ]
        self.ln_f = (t.ln_f.weight, t.ln_f.bias, t.ln_f.eps)
        self.head = head
        self.width = t.wte.weight.shape[1]
        self.pdl = pdl_supported(head.device) if pdl is None else pdl

    def forward(
        self,
        staged: torch.Tensor,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        steps: torch.Tensor,
        kv: list[torch.Tensor],
        batch: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Logits `(B, padded vocab)` of rows [:batch], and the positions and steps they were computed at."""
        x, current = embed(staged, tokens, positions, steps, self.wte, self.wpe, batch)
        position = current[1, :batch]
        if batch <= GEMV_MAX_BATCH:
            pdl = self.pdl
            for layer, (ln_1, qkv_proj, out_proj, ln_2, fc, down) in enumerate(self.layers):
                qkv = ln_linear(x, *qkv_proj, ln=ln_1, pdl=pdl)
                attended = decode_attention(qkv, kv[layer], position, self.scales[layer], pdl=pdl)
                ln_linear(attended, *out_proj, residual=x, out=x, pdl=pdl)
                hidden = ln_linear(x, *fc, ln=ln_2, activation=self.activation, pdl=pdl)
                ln_linear(hidden, *down, residual=x, out=x, pdl=pdl)
            normed = F.layer_norm(x, (self.width,), *self.ln_f)
        else:
            normed = self.gemm_layers(x, kv, position)
        logits = F.linear(normed, self.head)
        return logits, position, current[2, :batch]

    def gemm_layers(self, x: torch.Tensor, kv: list[torch.Tensor], position: torch.Tensor) -> torch.Tensor:
        """The layers on cuBLAS GEMMs around our attention, 7 launches a layer; returns `ln_f(x)`.

        Each residual add happens inside the GEMM that produces it (`x.addmm_`, beta = 1); its bias
        goes into the next layer norm's kernel (`add_layer_norm`); FC, its bias and GELU are one
        cuBLASLt call with the GELU epilogue (ReLU has one too; exact GELU and SiLU follow the GEMM
        as their own kernel). The plain way (layer norm, linear, residual add, ...)
        takes 10 launches a layer.
        """
        pdl = self.pdl  # for our kernels, each of which follows a cuBLAS one here
        pending = None  # the down-projection's bias, still to be added to x
        for layer, (ln_1, qkv_proj, out_proj, ln_2, fc, down) in enumerate(self.layers):
            qkv = F.linear(add_layer_norm(x, pending, ln_1, pdl=pdl), *qkv_proj)
            x.addmm_(decode_attention(qkv, kv[layer], position, self.scales[layer], pdl=pdl), out_proj[0].t())
            normed = add_layer_norm(x, out_proj[1], ln_2, pdl=pdl)
            hidden = self._fc(normed, fc)
            x.addmm_(hidden, down[0].t())
            pending = down[1]
        return add_layer_norm(x, pending, self.ln_f, pdl=pdl)

    def _fc(self, normed: torch.Tensor, fc: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The MLP's first linear with its bias and activation, on cuBLAS."""
        if self.activation in ("gelu_tanh", "relu") and normed.is_cuda:
            # On CUDA, cuBLASLt's GELU epilogue is the tanh approximation GPT-2 uses (torch's non-Lt
            # fallback applies the same); without use_gelu, the epilogue is ReLU. On the CPU (Triton's
            # interpreter) torch's _addmm_activation applies the exact GELU, so there the activation
            # follows the GEMM.
            return torch._addmm_activation(fc[1], normed, fc[0].t(), use_gelu=self.activation == "gelu_tanh")
        return activate(F.linear(normed, *fc), self.activation)
