"""Probe: how fast cuBLAS runs the decode step's linears and the LM head, for batch rows 1 to 256.

    python tools/probes/linear_kernels.py

Prints microseconds per call (20 calls captured in one CUDA graph, bf16): each GPT-2 124M linear
with and without its bias, and the LM head with GPT-2's 50257 rows against the same head padded
to 50304 rows. The padded head is why engine/runner.py keeps its own copy of the head. Needs CUDA.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

LINEARS = {"c_attn": (768, 2304), "attn.c_proj": (768, 768), "c_fc": (768, 3072), "mlp.c_proj": (3072, 768)}


def microseconds(fn: Callable[[], torch.Tensor], calls: int = 200) -> float:
    """Per call, replayed from a CUDA graph of 20 calls, so launch gaps are those of the engine's graphs."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(20):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(calls // 20):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / calls * 1e6


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 1
    device, dtype = torch.device("cuda"), torch.bfloat16
    print("| rows | linear | weight MB | with bias us | without bias us |\n|---|---|---|---|---|")
    for rows in (1, 64, 256):
        for name, (k, n) in LINEARS.items():
            x = torch.randn(rows, k, device=device, dtype=dtype)
            w = torch.randn(n, k, device=device, dtype=dtype) * 0.02
            b = torch.randn(n, device=device, dtype=dtype)
            with_bias, without = microseconds(partial(F.linear, x, w, b)), microseconds(partial(F.linear, x, w))
            print(f"| {rows} | {name} | {w.numel() * 2 / 1e6:.1f} | {with_bias:.2f} | {without:.2f} |")
    print("\n| rows | LM head 50257 rows us | padded to 50304 us |\n|---|---|---|")
    head = torch.randn(50257, 768, device=device, dtype=dtype)
    padded = torch.zeros(50304, 768, device=device, dtype=dtype)
    padded[:50257] = head
    for rows in (1, 64, 256):
        x = torch.randn(rows, 768, device=device, dtype=dtype)
        odd, aligned = microseconds(partial(F.linear, x, head)), microseconds(partial(F.linear, x, padded))
        print(f"| {rows} | {odd:.1f} | {aligned:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
