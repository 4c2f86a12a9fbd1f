"""Cross-entropy over bf16 logits in two Triton passes, for the training loss on CUDA.

Why by hand: the compiled `F.cross_entropy(logits.float(), ...)` is the largest memory-bound part of a
GPT-2 step (its kernels read and write fp32 copies of the logits, 4 bytes x vocabulary per token; see
the profiles `jobs/bench_train.py --profile-dir` writes). These kernels read the bf16 logits once forward
(online max and sum of exponentials in fp32, per row) and once backward, and write the gradient in the
logits' dtype, which is what the head's bf16 matmul consumes anyway. Columns at and past `vocab` (the
padding of train/loss.py) take no probability and get a zero gradient.

The kernels run on CUDA, and in Triton's interpreter on CPU (`TRITON_INTERPRET=1`) for the tests. Triton is
imported on their first launch, not with this module (see `_kernels`), as the engine's are (engine/kernels.py).
"""

from __future__ import annotations

import functools
import importlib.util
from typing import TYPE_CHECKING

import torch

IGNORE_INDEX = -100
_BLOCK = 4096

# `triton.language`, bound by `_kernels` on the first launch: the kernels' bodies look it up among this
# module's globals. The type checker reads it as that module from the start.
if TYPE_CHECKING:
    import triton.language as tl
else:
    tl = None


def available() -> bool:
    """Whether Triton is installed (the CPU build of torch does not bring it; the loss then stays torch's).
    Asked without importing it: see `_kernels`."""
    return importlib.util.find_spec("triton") is not None


@functools.cache
def _kernels():
    """The forward and backward kernels, defined (and Triton imported) on the first launch rather than with the
    loss: a process that never launches one (any CPU worker) does not load Triton, whose native bindings print
    leak reports when such a process exits, through this module."""
    global tl
    import triton
    import triton.language as tl

    @triton.jit
    def _forward_kernel(logits_ptr, stride, targets_ptr, loss_ptr, lse_ptr, vocab, ignore_index, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * stride
        # Per-lane running max and sum, combined once at the end: one pass over the row.
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, x)
            # lanes still at -inf (only masked columns so far) keep a zero sum instead of exp(nan)
            s = tl.where(m_new == float("-inf"), 0.0, s * tl.exp(m - m_new) + tl.exp(x - m_new))
            m = m_new
        row_max = tl.max(m, 0)
        lse = row_max + tl.log(tl.sum(s * tl.exp(m - row_max), 0))
        target = tl.load(targets_ptr + row)
        ignored = target == ignore_index
        picked = tl.load(base + tl.where(ignored, 0, target)).to(tl.float32)
        tl.store(loss_ptr + row, tl.where(ignored, 0.0, lse - picked))
        tl.store(lse_ptr + row, lse)

    @triton.jit
    def _backward_kernel(
        logits_ptr, stride, grad_ptr, grad_stride, targets_ptr, lse_ptr, scale_ptr, vocab, width, ignore_index,
        BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        target = tl.load(targets_ptr + row)
        scale = tl.where(target == ignore_index, 0.0, tl.load(scale_ptr))
        lse = tl.load(lse_ptr + row)
        for start in range(0, width, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(logits_ptr + row * stride + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
            p = tl.exp(x - lse)
            grad = tl.where(cols == target, p - 1.0, p) * scale
            tl.store(grad_ptr + row * grad_stride + cols, grad.to(grad_ptr.dtype.element_ty), mask=cols < width)

    return _forward_kernel, _backward_kernel


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, vocab: int) -> torch.Tensor:
        rows = logits.size(0)
        losses = torch.empty(rows, dtype=torch.float32, device=logits.device)
        lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
        forward_kernel, _ = _kernels()
        forward_kernel[(rows,)](logits, logits.stride(0), targets, losses, lse, vocab, IGNORE_INDEX, BLOCK=_BLOCK)
        counted = (targets != IGNORE_INDEX).sum()
        ctx.save_for_backward(logits, targets, lse, counted)
        ctx.vocab = vocab
        # The mean over counted tokens, as F.cross_entropy's (NaN when every target is ignored, as there).
        return losses.sum() / counted

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        logits, targets, lse, counted = ctx.saved_tensors
        scale = (grad_output.float() / counted).reshape(1)  # stays on the device: no host sync
        grad = torch.empty_like(logits)
        rows, width = logits.shape
        _, backward_kernel = _kernels()
        backward_kernel[(rows,)](
            logits, logits.stride(0), grad, grad.stride(0), targets, lse, scale, ctx.vocab, width, IGNORE_INDEX,
            BLOCK=_BLOCK,
        )  # fmt: skip
        return grad, None, None


# A Triton launch inside an autograd Function: compiled models call it eagerly. torch's lazy form of
# torch.compiler.disable (the same graph break): importing torch._dynamo imports Triton, so it waits for the
# first call instead of coming with this module.
@torch._disable_dynamo
def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, vocab: int) -> torch.Tensor:
    """Mean cross-entropy of `logits` `(N, width)` over their first `vocab` columns against `targets`
    `(N,)`, targets of -100 ignored: `F.cross_entropy(logits[:, :vocab].float(), targets)`."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    return _CrossEntropy.apply(logits, targets.contiguous(), vocab)
