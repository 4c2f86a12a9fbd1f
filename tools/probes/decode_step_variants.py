"""Probe: the decode step's GPU time under different ways of compiling it (graph replay alone).

    python tools/probes/decode_step_variants.py [--device cuda] [--preset gpt2] [variant ...]

Variants:
  compiled         the model's modules under torch.compile(dynamic=True), cuBLASLt GEMMs (the
                   engine with decode_kernels="torch")
  eager            not compiled (graphs captured around the eager step)
  cublas           compiled, with cuBLAS preferred over cuBLASLt for the linear layers
  autotune         dynamic=False + mode="max-autotune-no-cudagraphs" (Triton GEMM templates)
  triton           the engine's own decode kernels (engine/kernels.py) at every batch size, not compiled
  triton-compiled  what the engine does on CUDA: our kernels, token pick compiled (with programmatic
                   dependent launch between them on Hopper)
  triton-nopdl     triton-compiled without programmatic dependent launch
  triton-gemv8     triton-compiled with our GEMV up to batch 8
  triton-hybrid    triton-compiled with cuBLAS linears around our attention at batch 1 too
  triton-unfused   triton-compiled with the plain cuBLAS layer past the GEMV (layer norm, linear,
                   GELU and residual add each its own launch: 10 a layer) instead of gemm_layers (7)

At commit 5912346 this probe also compared flash attention's varlen kernel for the decode
attention (reading each row's keys up to its own position) with masked SDPA; it was slower
(docs/benchmarks/2026-12-01-s4-engine-best-of-3-h200.md) and left the engine.

For each: compile + capture seconds, replay ms at batch 1, 64 and 256 (position 200, span 256),
kernels per replay at batch 1 and 64 (with the top ones), and whether its greedy tokens at batch
64 match the eager step's. On CPU (--device cpu) the graphs are not captured and the times are
plain calls: for checking that every variant compiles and agrees, not for its numbers.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "platform"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from gpt2_platform.bench.generation import fed_step  # noqa: E402
from gpt2_platform.engine import kernels  # noqa: E402
from gpt2_platform.engine.modes import Pick, SamplingMode  # noqa: E402
from gpt2_platform.engine.runner import ModelRunner  # noqa: E402
from gpt2_platform.model import GPT2, preset  # noqa: E402

VARIANTS = (
    "compiled",
    "eager",
    "cublas",
    "autotune",
    "triton",
    "triton-compiled",
    "triton-nopdl",
    "triton-gemv8",
    "triton-hybrid",
    "triton-unfused",
)
SPAN, POSITION, SLOTS = 256, 200, 256
GEMV_MAX_BATCH = kernels.GEMV_MAX_BATCH
BATCHES = (1, 2, 4, 8, 64, 256)


def build(variant: str, device: torch.device, preset_name: str, dtype: torch.dtype) -> ModelRunner:
    torch._dynamo.reset()
    torch.manual_seed(0)
    if device.type == "cuda":
        torch.backends.cuda.preferred_blas_library("cublas" if variant == "cublas" else "cublaslt")
    model = GPT2(preset(preset_name))
    if variant.startswith("triton"):
        # triton-hybrid: cuBLAS linears around our attention at every batch size, batch 1 included.
        kernels.GEMV_MAX_BATCH = {"triton-hybrid": 0, "triton-gemv8": 8}.get(variant, GEMV_MAX_BATCH)
        # Our decode kernels (engine/kernels.py); the token pick compiled or not.
        runner = ModelRunner(
            model,
            SLOTS,
            SPAN,
            dtype,
            device,
            cuda_graphs=device.type == "cuda",
            compile_step=variant != "triton",
            decode_kernels="triton",
        )
        if variant == "triton-nopdl":
            runner.decoder.pdl = False
        if variant == "triton-unfused":
            runner.decoder.gemm_layers = functools.partial(unfused_gemm_layers, runner.decoder)
        return runner
    runner = ModelRunner(model, SLOTS, SPAN, dtype, device, cuda_graphs=device.type == "cuda")
    if variant == "eager":
        return runner
    torch._dynamo.config.cache_size_limit = 64
    options = {"dynamic": variant != "autotune"}
    if variant == "autotune":
        options["mode"] = "max-autotune-no-cudagraphs"
    runner.forward = torch.compile(runner._forward, **options)
    runner.pick = torch.compile(runner._pick, **options)
    return runner


def unfused_gemm_layers(decoder: kernels.TritonDecoder, x: torch.Tensor, kv: list, position: torch.Tensor):
    """The engine's layers past the GEMV before gemm_layers: every layer norm, bias, GELU and add on its own."""
    width = decoder.width
    for layer, (ln_1, qkv_proj, out_proj, ln_2, fc, down) in enumerate(decoder.layers):
        qkv = F.linear(F.layer_norm(x, (width,), *ln_1), *qkv_proj)
        x = x + F.linear(kernels.decode_attention(qkv, kv[layer], position), *out_proj)
        hidden = F.gelu(F.linear(F.layer_norm(x, (width,), *ln_2), *fc), approximate="tanh")
        x = x + F.linear(hidden, *down)
    return F.layer_norm(x, (width,), *decoder.ln_f)


def step(runner: ModelRunner, batch: int) -> torch.Tensor:
    rows = [(1 + row % 200, POSITION, 1) for row in range(batch)]
    return torch.tensor(fed_step(runner, [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows]))


def replay_ms(runner: ModelRunner, batch: int, repeats: int) -> float:
    if not runner.use_graphs:
        started = time.perf_counter()
        for _ in range(repeats):
            step(runner, batch)
        return (time.perf_counter() - started) * 1000 / repeats
    graph, _ = runner.graphs[(batch, runner.span_buckets[-1], SamplingMode(Pick.GREEDY, False))]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


def kernels_per_replay(runner: ModelRunner, batch: int) -> tuple[int, list[str]]:
    if not runner.use_graphs:
        return 0, []
    graph, _ = runner.graphs[(batch, runner.span_buckets[-1], SamplingMode(Pick.GREEDY, False))]
    with profile(activities=[ProfilerActivity.CUDA]) as profiler:
        for _ in range(10):
            graph.replay()
        torch.cuda.synchronize()
    events = [e for e in profiler.key_averages() if e.device_type.name == "CUDA"]
    count = sum(e.count for e in events) // 10
    top = sorted(events, key=lambda e: e.device_time_total, reverse=True)[:12]
    return count, [f"{e.device_time_total / 10:8.1f} us  x{e.count // 10:3d}  {e.key[:90]}" for e in top]


def probe(variant: str, device: torch.device, preset_name: str, dtype: torch.dtype, reference: torch.Tensor) -> dict:
    runner = build(variant, device, preset_name, dtype)
    started = time.perf_counter()
    with torch.inference_mode():
        tokens = step(runner, 64)
        for batch in BATCHES:
            step(runner, batch)
    result = {"compile_and_capture_s": round(time.perf_counter() - started, 1)}
    repeats = 500 if device.type == "cuda" else 5
    result |= {f"batch{b}_ms": round(replay_ms(runner, b, repeats), 4) for b in BATCHES}
    result["greedy_agreement_b64"] = float((tokens == reference).float().mean())
    for batch in (1, 64):
        result[f"kernels_b{batch}"], result[f"top_kernels_b{batch}"] = kernels_per_replay(runner, batch)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("variants", nargs="*", default=list(VARIANTS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--preset", default="gpt2")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.inference_mode():
        reference = step(build("eager", device, args.preset, dtype), 64)
    results = {}
    for variant in args.variants:
        try:
            results[variant] = probe(variant, device, args.preset, dtype, reference)
        except Exception as error:  # a variant that fails to compile is a result too
            results[variant] = {"error": f"{type(error).__name__}: {str(error)[:400]}"}
        print(variant, json.dumps(results[variant], indent=1), flush=True)
        if args.json_out:
            args.json_out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
