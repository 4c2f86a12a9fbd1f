"""The environment check: what this machine has (Python, torch, CUDA, GPUs, NVML, Ray) and whether a job can run.

`collect()` probes and returns a plain report dict; `problems()` and `warnings_for()` judge a report for one job
kind; `format_human()` renders it. Every probe is guarded: one that fails records `{"error": "..."}` in its
section and the check goes on.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

JOB_KINDS = ("train", "serve", "generate")
REQUIRED_RAY_SERIES = "2.60"
MIN_TORCH = (2, 6)
# Flash attention kernels need Ampere (SM 8.0) or newer.
MIN_FLASH_CAPABILITY = (8, 0)
COMPILE_TIMEOUT_S = 120.0

Report = dict[str, Any]
CudaProbe = Callable[[], dict[str, Any]]


def _guarded(name: str, probe: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run one probe; a failure becomes the section `{"error": "<type>: <message>"}`."""
    try:
        return probe()
    except Exception as error:  # a probe must never take the check down
        logger.debug("probe %s failed", name, exc_info=True)
        return {"error": f"{type(error).__name__}: {error}"}


def _probe_python() -> dict[str, Any]:
    return {"version": sys.version.split()[0], "executable": sys.executable}


def _probe_torch() -> dict[str, Any]:
    import torch

    cudnn_version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {"version": torch.__version__, "cuda": torch.version.cuda, "cudnn": cudnn_version}


def _probe_cuda() -> dict[str, Any]:
    """CUDA availability, each GPU, bf16, NCCL and flash attention (with a tiny flash-only SDPA call)."""
    import torch
    import torch.distributed

    info: dict[str, Any] = {
        "available": torch.cuda.is_available(),
        "nccl_available": torch.distributed.is_available() and torch.distributed.is_nccl_available(),
        "gpus": [],
    }
    if not info["available"]:
        return info
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        info["gpus"].append(
            {
                "index": index,
                "name": props.name,
                "total_mem_gib": round(props.total_memory / 2**30, 1),
                "compute_capability": f"{props.major}.{props.minor}",
            }
        )
    info["bf16_supported"] = torch.cuda.is_bf16_supported()
    info["flash_attention"] = _guarded("flash_attention", _probe_flash_attention)
    return info


def _probe_flash_attention() -> dict[str, Any]:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    capability = torch.cuda.get_device_capability(0)
    result: dict[str, Any] = {
        "supported": capability >= MIN_FLASH_CAPABILITY and torch.backends.cuda.flash_sdp_enabled(),
        "ran": False,
    }
    if not result["supported"]:
        return result
    dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    q = torch.randn(1, 2, 16, 64, device="cuda", dtype=dtype)  # (B, nh, T, hs)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
    torch.cuda.synchronize()
    result["ran"] = True
    return result


def _compile_and_run(device: str) -> None:
    import torch

    def tiny(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(x @ x.T).sum()

    compiled = torch.compile(tiny, backend="inductor")
    x = torch.randn(8, 8, device=device)
    torch.testing.assert_close(compiled(x), tiny(x))


def _probe_compile(device: str, timeout_s: float = COMPILE_TIMEOUT_S) -> dict[str, Any]:
    """Compile a tiny function with inductor on `device` and run it, giving up after `timeout_s`."""
    outcome: dict[str, Any] = {"device": device, "backend": "inductor", "works": False}
    errors: list[BaseException] = []

    def target() -> None:
        try:
            _compile_and_run(device)
        except Exception as error:
            errors.append(error)

    # A daemon thread so a hung compile cannot keep the process alive after the check reports.
    thread = threading.Thread(target=target, name="envcheck-compile", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        outcome["error"] = f"timed out after {timeout_s:.0f} s"
    elif errors:
        outcome["error"] = f"{type(errors[0]).__name__}: {str(errors[0]).splitlines()[0] if str(errors[0]) else ''}"
    else:
        outcome["works"] = True
    return outcome


def _probe_nvml() -> dict[str, Any]:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as error:  # no driver, no library: expected on CPU machines
        return {"driver_version": "not available", "reason": f"{type(error).__name__}: {error}"}
    try:
        version = pynvml.nvmlSystemGetDriverVersion()
        return {"driver_version": version.decode() if isinstance(version, bytes) else version}
    finally:
        pynvml.nvmlShutdown()


def _probe_ray(address: str | None) -> dict[str, Any]:
    """Ray's version; with an address ("local" starts one), the cluster's resources and alive nodes."""
    import ray

    info: dict[str, Any] = {"version": ray.__version__, "connected": False}
    if address is None and not ray.is_initialized():
        return info
    started_here = not ray.is_initialized()
    if started_here:
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False, include_dashboard=False)
    try:
        info["connected"] = True
        info["address"] = address or "(already initialized)"
        info["cluster_resources"] = ray.cluster_resources()
        info["num_alive_nodes"] = sum(1 for node in ray.nodes() if node.get("Alive"))
    finally:
        if started_here:
            ray.shutdown()
    return info


def _probe_transformers() -> dict[str, Any]:
    import transformers

    return {"version": transformers.__version__}


def _probe_package() -> dict[str, Any]:
    import gpt2_platform

    return {"version": gpt2_platform.__version__}


def collect(probe_compile: bool, ray_address: str | None, cuda_probe: CudaProbe | None = None) -> Report:
    """Probe the environment. The compile probe runs on a GPU always, on CPU only with `probe_compile`.

    `ray_address` connects to that cluster ("local" starts an embedded one); None only reads Ray's version.
    `cuda_probe` replaces the real CUDA probe (tests pass fakes to exercise the GPU branches).
    """
    report: Report = {
        "python": _guarded("python", _probe_python),
        "torch": _guarded("torch", _probe_torch),
        "cuda": _guarded("cuda", cuda_probe or _probe_cuda),
        "nvml": _guarded("nvml", _probe_nvml),
    }
    if report["cuda"].get("available"):
        report["compile"] = _guarded("compile", lambda: _probe_compile("cuda"))
    elif probe_compile:
        report["compile"] = {"gpu": "no GPU", **_guarded("compile", lambda: _probe_compile("cpu"))}
    else:
        report["compile"] = {"gpu": "no GPU", "cpu": "not checked (--compile-check)"}
    report["ray"] = _guarded("ray", lambda: _probe_ray(ray_address))
    report["transformers"] = _guarded("transformers", _probe_transformers)
    report["gpt2_platform"] = _guarded("gpt2_platform", _probe_package)
    return report


def _version_tuple(version: str) -> tuple[int, ...]:
    """'2.13.0+cpu' -> (2, 13, 0); stops at the first part that is not a number."""
    parts: list[int] = []
    for part in version.split("+")[0].split("."):
        if not part.isdigit():
            break
        parts.append(int(part))
    return tuple(parts)


def problems(report: Report, job: str | None, need_gpu: bool) -> list[str]:
    """What stops `job` from running here, one line each: what is missing and what to do."""
    if job is not None and job not in JOB_KINDS:
        raise ValueError(f"job must be one of {', '.join(JOB_KINDS)}, got {job!r}")
    found: list[str] = []
    ray_info, torch_info, cuda = report.get("ray", {}), report.get("torch", {}), report.get("cuda", {})
    if "version" not in ray_info:
        found.append(f"Ray is not importable ({ray_info.get('error')}): pip install 'ray[serve,train,data]==2.60.0'")
    elif not ray_info["version"].startswith(REQUIRED_RAY_SERIES + "."):
        found.append(f"Ray {ray_info['version']} found, {REQUIRED_RAY_SERIES}.x needed: pip install 'ray==2.60.0'")
    if "version" not in torch_info:
        found.append(f"torch is not importable ({torch_info.get('error')}): pip install 'torch>=2.6'")
    elif _version_tuple(torch_info["version"]) < MIN_TORCH:
        found.append(f"torch {torch_info['version']} found, >= 2.6 needed: pip install -U 'torch>=2.6'")
    if not need_gpu:
        return found
    if not cuda.get("available"):
        reason = f" ({cuda['error']})" if "error" in cuda else f" (torch CUDA build: {torch_info.get('cuda')})"
        found.append(f"CUDA is not available{reason}: run on a GPU machine with a CUDA build of torch, or drop --gpu")
        return found  # bf16 and NCCL follow from CUDA; one line says it all
    if job == "train" and not cuda.get("nccl_available"):
        found.append("NCCL is not available to torch.distributed: install a torch build with NCCL (the CUDA wheels)")
    return found


def warnings_for(report: Report, job: str | None, need_gpu: bool) -> list[str]:
    """What lets `job` run, but not as configured by default."""
    cuda = report.get("cuda", {})
    found: list[str] = []
    if need_gpu and job == "train" and cuda.get("available") and not cuda.get("bf16_supported"):
        found.append("this GPU has no bf16: train with --set train.precision=fp16 (loss-scaled)")
    flash = cuda.get("flash_attention", {})
    if need_gpu and cuda.get("available") and not flash.get("ran"):
        found.append(f"flash attention unavailable ({flash.get('error', 'needs SM >= 8.0')}): SDPA falls back")
    return found


def _format_value(value: Any) -> str:
    if isinstance(value, dict):
        # node:<ip> resources are one per node and only noise here; Ray counts memory in bytes.
        return ", ".join(
            f"{k}={v / 2**30:.1f}GiB"
            if str(k).endswith("memory") and isinstance(v, int | float)
            else f"{k}={_format_value(v)}"
            for k, v in value.items()
            if not str(k).startswith("node:")
        )
    if isinstance(value, float):
        return f"{value:g}"
    if value is None:
        return "-"
    return str(value)


def format_human(report: Report) -> str:
    """Sections of aligned `name: value` lines; each GPU on its own line."""
    rows: list[tuple[str, str] | str] = []
    for section, fields in report.items():
        if not isinstance(fields, dict):
            rows.append((section, _format_value(fields)))
            continue
        rows.append(f"[{section}]")
        for name, value in fields.items():
            if name == "gpus":
                for gpu in value:
                    line = f"{gpu['name']}, {gpu['total_mem_gib']} GiB, SM {gpu['compute_capability']}"
                    rows.append((f"gpu {gpu['index']}", line))
            else:
                rows.append((name, _format_value(value)))
    width = max(len(row[0]) for row in rows if isinstance(row, tuple))
    lines = [row if isinstance(row, str) else f"  {row[0] + ':':<{width + 1}} {row[1]}" for row in rows]
    return "\n".join(lines)
