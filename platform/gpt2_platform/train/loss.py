"""The training loss from the final hidden states: the LM head's matmul and the cross-entropy, done fast.

The head is the largest matmul of a GPT-2 step (vocabulary x width, for every token), and its logits
the largest activation. What is done about it, all exact (the loss is the loss of the unpadded model):

- `vocab_multiple`: the head's matmul runs over the vocabulary padded with zero rows to a multiple of
  this (GPT-2's 50,257 is odd; 50,304 gives the GEMM aligned tiles). The padding's logits are dropped
  before the softmax, so they take no probability; checkpoints keep the true vocabulary because the
  padding lives only inside this function.
- the cross-entropy of the `logits` path runs as two Triton kernels on CUDA (train/cross_entropy.py), which
  read the bf16 logits once each way instead of the compiled torch loss's fp32 copies.
- `fused`: liger-kernel's fused linear + cross-entropy (Triton, CUDA only). It computes the logits a
  chunk of tokens at a time and turns each chunk straight into its gradients, so the full fp32 logits
  (4 bytes x vocabulary per token) never exist. The padding is masked there with a -inf bias.

Measured against the plain path by `jobs/bench_train.py`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from gpt2_platform.train import cross_entropy as cross_entropy_kernels
from gpt2_platform.train.config import LossImpl
from gpt2_platform.train.cross_entropy import IGNORE_INDEX

LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def padded_size(vocab_size: int, multiple: int) -> int:
    return math.ceil(vocab_size / multiple) * multiple


def _pad_rows(weight: torch.Tensor, rows: int) -> torch.Tensor:
    return F.pad(weight, (0, 0, 0, rows - weight.size(0))) if rows > weight.size(0) else weight


def _compute_dtype(tensor: torch.Tensor) -> torch.dtype:
    """The dtype the head's matmul runs in: autocast's when it is on (as nn.Linear would), else the tensor's."""
    if torch.is_autocast_enabled(tensor.device.type):
        return torch.get_autocast_dtype(tensor.device.type)
    return tensor.dtype


class LMLoss:
    """`loss_fn(hidden (B, T, C), head_weight (V, C), targets (B, T)) -> mean cross-entropy`, targets of
    -100 ignored, as `GPT2.forward` computes it from its logits."""

    def __init__(self, impl: LossImpl = "logits", vocab_multiple: int = 1, triton_ce: bool = True) -> None:
        if impl not in ("logits", "fused"):
            raise ValueError(f"train.loss must be 'logits' or 'fused', got {impl!r}")
        if vocab_multiple < 1:
            raise ValueError(f"train.vocab_multiple must be at least 1, got {vocab_multiple}")
        self.vocab_multiple = vocab_multiple
        # logits on CUDA: the cross-entropy of train/cross_entropy.py instead of the compiled torch one
        # (faster, and exact to fp32 rounding: jobs/bench_train.py's "triton CE" variants)
        self.triton_ce = triton_ce and cross_entropy_kernels.available()
        self._fused: Callable | None = None
        if impl == "fused":
            self._fused = fused_linear_cross_entropy()

    def __call__(self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        vocab = weight.size(0)
        rows = padded_size(vocab, self.vocab_multiple)
        if self._fused is not None:
            return self._fused(hidden, weight, targets, vocab, rows)
        logits = F.linear(hidden, _pad_rows(weight, rows))
        if self.triton_ce and logits.is_cuda:
            return cross_entropy_kernels.cross_entropy(logits.reshape(-1, rows), targets.reshape(-1), vocab)
        if rows > vocab:
            logits = logits[..., :vocab]
        return F.cross_entropy(logits.float().reshape(-1, vocab), targets.reshape(-1), ignore_index=IGNORE_INDEX)


def fused_linear_cross_entropy() -> Callable:
    """liger-kernel's fused linear + cross-entropy, or a clear error saying why it cannot run here."""
    if not torch.cuda.is_available():
        raise ValueError("train.loss=fused needs a CUDA GPU (liger-kernel's Triton kernels); use train.loss=logits")
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
    except ImportError as error:
        raise ValueError(
            f"train.loss=fused needs liger-kernel ({error}); pip install 'gpt2-platform[fused]' "
            "or use train.loss=logits"
        ) from None
    # Gradients of the head accumulate over chunks: in fp32, not in the bf16 of the matmul.
    liger = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX, accum_dtype=torch.float32)

    # Dynamo does not trace liger's autograd Function and Triton launches well; compiled models run it eagerly.
    @torch.compiler.disable
    def fused(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab: int, rows: int):
        dtype = _compute_dtype(hidden)
        weight = _pad_rows(weight.to(dtype), rows)
        bias = None
        if rows > vocab:
            bias = torch.zeros(rows, dtype=dtype, device=weight.device)
            bias[vocab:] = float("-inf")
        return liger(weight, hidden.to(dtype).reshape(-1, hidden.size(-1)), targets.reshape(-1), bias)

    return fused
