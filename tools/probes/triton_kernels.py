"""Probe: the decode kernels of engine/kernels.py, one at a time, against what the torch path runs.

    python tools/probes/triton_kernels.py [--json-out F]

For GPT-2 124M's shapes in bf16: at batch 1, each linear of a layer (with its layer norm, bias,
GELU or residual) as our `ln_linear` under a few tile configurations, against the torch ops the
eager step runs for it; at batch 1, 64 and 256, the decode attention (position 200) against the
cache write and masked SDPA over the 256-position span, under several block sizes and warp counts,
with the GB/s each reads (`--attention-only --batch-sizes 256 1024` for the large batches), the cache loop
plain or software-pipelined 2 or 3 deep. Each figure is microseconds per call, 20 calls captured in one CUDA graph and
replayed 50 times. Also the largest difference from the torch result, to catch a config that is
fast and wrong.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "platform"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from linear_kernels import microseconds  # noqa: E402  (this folder, on the path when run as a script)

from gpt2_platform.engine import kernels  # noqa: E402

C, H, D, T, POSITION = 768, 12, 64, 256, 200
CONFIGS = [
    dict(BLOCK_N=n, BLOCK_K=k, num_warps=w)
    for n, k, w in [(4, 512, 4), (8, 256, 4), (8, 512, 4), (16, 256, 4), (16, 512, 8), (32, 256, 8), (8, 1024, 8)]
]
"""GEMV tilings tried at batch 1. An earlier version of this probe also had `tl.dot` tiles for 64 and
256 rows; they lost to cuBLAS (docs/benchmarks/2026-12-01-s5-decode-kernels-h200.md) and the kernel no
longer has them."""


def graph_us(fn) -> float:
    return microseconds(fn, calls=1000)


def linears(batch: int, dtype: torch.dtype, device: torch.device) -> dict:
    def w(*shape):
        return (torch.randn(*shape, device=device) * 0.02).to(dtype)

    g, beta = 1 + w(C), w(C)
    x = torch.randn(batch, C, device=device).to(dtype)
    h4 = torch.randn(batch, 4 * C, device=device).to(dtype)
    shapes = {
        "qkv (ln)": dict(x=x, weight=w(3 * C, C), bias=w(3 * C), ln=(g, beta, 1e-5)),
        "out (residual)": dict(x=x, weight=w(C, C), bias=w(C), residual=True),
        "fc (ln, gelu)": dict(x=x, weight=w(4 * C, C), bias=w(4 * C), ln=(g, beta, 1e-5), activation="gelu_tanh"),
        "down (residual)": dict(x=h4, weight=w(C, 4 * C), bias=w(C), residual=True),
        "head (ln)": dict(x=x, weight=w(50304, C), bias=None, ln=(g, beta, 1e-5)),
    }
    results = {}
    for name, spec in shapes.items():
        res = torch.randn(batch, spec["weight"].shape[0], device=device).to(dtype) if spec.get("residual") else None

        def torch_op(spec=spec, res=res):
            y = spec["x"]
            if spec.get("ln"):
                y = F.layer_norm(y, (C,), spec["ln"][0], spec["ln"][1], 1e-5)
            y = F.linear(y, spec["weight"], spec["bias"])
            if spec.get("gelu"):
                y = F.gelu(y, approximate="tanh")
            return y if res is None else res + y

        reference = torch_op().float()
        row = {"torch": round(graph_us(torch_op), 2)}
        for config in CONFIGS:
            label = "n{}k{}w{}".format(*config.values())

            def ours(spec=spec, res=res, config=config):
                out = None if res is None else res.clone()
                return kernels.ln_linear(
                    spec["x"],
                    spec["weight"],
                    spec["bias"],
                    ln=spec.get("ln"),
                    activation=spec.get("activation"),
                    residual=out,
                    out=out,
                    config=config,
                )

            try:
                error = (ours().float() - reference).abs().max().item()
                row[label] = [round(graph_us(ours), 2), round(error, 4)]
            except Exception as failure:  # a config that does not compile is a result too
                row[label] = f"{type(failure).__name__}: {str(failure)[:120]}"
        results[name] = row
        print(batch, name, json.dumps(row), flush=True)
    return results


def attention(batch: int, dtype: torch.dtype, device: torch.device, position: int = POSITION) -> dict:
    """Our decode attention under each (BLOCK_T, num_warps), against the torch path; each with the GB/s
    it reads (the keys and values of positions 0..position of every row and head) and its largest error."""
    span = max(T, 1 << position.bit_length())
    kv = torch.randn(batch, 2, H, span, D, device=device).to(dtype)
    qkv = torch.randn(batch, 3 * C, device=device).to(dtype)
    positions = torch.full((batch,), position, device=device)
    mask = (torch.arange(span, device=device)[None, :] <= positions[:, None])[:, None, None, :]
    read_bytes = batch * 2 * H * (position + 1) * D * kv.element_size()

    def torch_op():
        q, k, v = (t.view(batch, H, 1, D) for t in qkv.split(C, dim=1))
        kv[torch.arange(batch, device=device), :, :, positions] = torch.stack((k[:, :, 0], v[:, :, 0]), dim=1)
        return F.scaled_dot_product_attention(q, kv[:, 0], kv[:, 1], attn_mask=mask).reshape(batch, C)

    def timed(fn) -> dict:
        us = graph_us(fn)
        return {"us": round(us, 2), "GB/s": round(read_bytes / us / 1e3)}

    reference = torch_op().float()
    row = {"torch (write + masked SDPA)": timed(torch_op)}
    for block_t in (32, 64, 128, 256):
        for num_warps in (2, 4, 8):
            for stages in (0, 2, 3):

                def ours(block_t=block_t, num_warps=num_warps, stages=stages):
                    return kernels.decode_attention(
                        qkv, kv, positions, block_t=block_t, num_warps=num_warps, num_stages=stages
                    )

                error = (ours().float() - reference).abs().max().item()
                label = f"ours BLOCK_T={block_t} warps={num_warps}" + (f" stages={stages}" if stages else "")
                row[label] = timed(ours) | {"max error": round(error, 4)}
    print(batch, f"attention at position {position}", json.dumps(row), flush=True)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--attention-only", action="store_true", help="skip the linears")
    parser.add_argument("--position", type=int, default=POSITION, help="the attention's position (context - 1)")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    torch.manual_seed(0)
    device, dtype = torch.device("cuda"), torch.bfloat16
    results = {}
    for batch in args.batch_sizes:
        results[f"batch{batch}"] = {
            "linears": None if args.attention_only else linears(batch, dtype, device),
            "attention": attention(batch, dtype, device, args.position),
        }
        if args.json_out:
            args.json_out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
