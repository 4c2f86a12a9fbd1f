"""gpt2_platform.ops.envcheck and jobs/env_check.py: real probes on this CPU machine, GPU branches on hand-built reports."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import ray

from conftest import REPO_ROOT
from gpt2_platform.ops import envcheck


def _load_main() -> Callable[[list[str]], int]:
    # jobs/ is not a package: load the script as a module from its path.
    spec = importlib.util.spec_from_file_location("jobs_env_check", REPO_ROOT / "jobs" / "env_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


env_check_main = _load_main()


@pytest.fixture(scope="module")
def cpu_report() -> dict[str, Any]:
    return envcheck.collect(probe_compile=False, ray_address=None)


@pytest.fixture(autouse=True)
def no_ray_address(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI must not connect to (or start) a cluster in these tests."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


def gpu_report(**cuda: Any) -> dict[str, Any]:
    """A report as collect() writes it on a healthy 2-GPU H200 machine; `cuda` overrides fields of its cuda section."""
    gpu = {"name": "NVIDIA H200", "total_mem_gib": 139.8, "compute_capability": "9.0"}
    return {
        "python": {"version": "3.11.7"},
        "torch": {"version": "2.11.0+cu128", "cuda": "12.8", "cudnn": 91002},
        "cuda": {
            "available": True,
            "nccl_available": True,
            "gpus": [{"index": 0, **gpu}, {"index": 1, **gpu}],
            "bf16_supported": True,
            "flash_attention": {"supported": True, "ran": True},
            **cuda,
        },
        "nvml": {"driver_version": "570.86.15"},
        "compile": {"device": "cuda", "backend": "inductor", "works": True},
        "ray": {"version": "2.60.0", "connected": False},
        "transformers": {"version": "5.24.0"},
        "gpt2_platform": {"version": "0.1.0"},
    }


# ---- the real probes on this machine -------------------------------------------------------------------


def test_collect_on_this_machine_reports_versions_and_no_gpu(cpu_report: dict[str, Any]) -> None:
    assert cpu_report["python"]["version"] == sys.version.split()[0]
    assert cpu_report["torch"]["version"].startswith("2.")
    assert cpu_report["ray"]["version"].startswith("2.60.")
    # An already-connected Ray (the test session's, when other tests started it) is reported as such.
    assert cpu_report["ray"]["connected"] is ray.is_initialized()
    assert cpu_report["transformers"]["version"]
    assert cpu_report["gpt2_platform"]["version"]
    assert cpu_report["cuda"]["available"] is False
    assert cpu_report["compile"]["gpu"] == "no GPU"
    assert cpu_report["nvml"]["driver_version"] == "not available"
    assert cpu_report["nvml"]["reason"]
    assert not [name for name, section in cpu_report.items() if "error" in section]


def test_format_human_aligns_name_value_lines_in_sections(cpu_report: dict[str, Any]) -> None:
    text = envcheck.format_human(cpu_report)
    assert "[torch]" in text and "[nvml]" in text
    value_columns = {len(match.group(0)) for match in re.finditer(r"^  \S+:\s+", text, flags=re.MULTILINE)}
    assert len(value_columns) == 1, text


def test_format_human_lists_each_gpu() -> None:
    text = envcheck.format_human(gpu_report())
    assert "gpu 0" in text and "gpu 1" in text and "NVIDIA H200, 139.8 GiB, SM 9.0" in text


def test_cli_json_is_ok_when_no_gpu_is_needed(capsys: pytest.CaptureFixture[str]) -> None:
    assert env_check_main(["--json", "--for", "serve"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["ok"] is True
    assert payload["problems"] == []
    assert payload["cuda"]["available"] is False
    assert payload["nvml"]["driver_version"] == "not available"


def test_cli_with_the_dashboard_url_as_ray_address_checks_this_machine_and_says_how_to_check_the_cluster(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # docs/operating.md exports RAY_ADDRESS=http://127.0.0.1:8265 for `ray job submit`; ray.init() refuses it.
    monkeypatch.setenv("RAY_ADDRESS", "http://127.0.0.1:8265")
    assert env_check_main(["--for", "serve"]) == 0
    out = capsys.readouterr().out
    assert "note: http://127.0.0.1:8265 is the dashboard's URL" in out and "ray job submit" in out
    assert "error" not in out and "not importable" not in out, out


def test_cli_train_on_gpu_fails_here_with_one_line_naming_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    assert env_check_main(["--for", "train", "--gpu"]) == 1
    errors = [line for line in capsys.readouterr().out.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, errors
    assert "CUDA" in errors[0] and "GPU machine" in errors[0]


def test_cli_as_a_subprocess_exits_1_for_a_gpu_job() -> None:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run(
        [sys.executable, str(REPO_ROOT / "jobs" / "env_check.py"), "--for", "train", "--gpu", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert done.returncode == 1, done.stderr
    payload = json.loads(done.stdout)
    assert payload["ok"] is False
    assert len(payload["problems"]) == 1 and "CUDA" in payload["problems"][0]


# ---- problems() and warnings_for() on hand-built GPU reports --------------------------------------------


@pytest.mark.parametrize("job", [*envcheck.JOB_KINDS, None])
def test_a_healthy_gpu_machine_has_no_problems(job: str | None) -> None:
    assert envcheck.problems(gpu_report(), job, need_gpu=True) == []
    assert envcheck.warnings_for(gpu_report(), job, need_gpu=True) == []


def test_train_without_bf16_warns_and_suggests_fp16() -> None:
    report = gpu_report(bf16_supported=False)
    assert envcheck.problems(report, "train", need_gpu=True) == []
    (advice,) = envcheck.warnings_for(report, "train", need_gpu=True)
    assert "bf16" in advice and "fp16" in advice


def test_multi_gpu_train_without_nccl_is_a_problem() -> None:
    (problem,) = envcheck.problems(gpu_report(nccl_available=False), "train", need_gpu=True)
    assert "NCCL" in problem
    assert envcheck.problems(gpu_report(nccl_available=False), "serve", need_gpu=True) == []


def test_serve_on_gpu_needs_cuda() -> None:
    report = gpu_report(available=False, gpus=[])
    (problem,) = envcheck.problems(report, "serve", need_gpu=True)
    assert "CUDA" in problem
    assert envcheck.problems(report, "serve", need_gpu=False) == []


@pytest.mark.parametrize(
    ("section", "fields", "expected"),
    [
        ("ray", {"version": "2.59.1"}, "2.60"),
        ("ray", {"error": "ModuleNotFoundError: No module named 'ray'"}, "Ray is not importable"),
        ("torch", {"version": "2.5.1+cu124"}, ">= 2.6"),
    ],
)
def test_every_job_needs_ray_2_60_and_torch_2_6(section: str, fields: dict[str, Any], expected: str) -> None:
    report = {**gpu_report(), section: fields}
    (problem,) = envcheck.problems(report, None, need_gpu=False)
    assert expected in problem and "pip install" in problem


def test_unknown_job_kind_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="job must be one of"):
        envcheck.problems(gpu_report(), "finetune", need_gpu=False)


# ---- guarded probes ------------------------------------------------------------------------------------


def test_a_failing_probe_is_recorded_and_the_check_completes(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> dict[str, Any]:
        raise RuntimeError("transformers exploded")

    monkeypatch.setattr(envcheck, "_probe_transformers", broken)
    report = envcheck.collect(probe_compile=False, ray_address=None)
    assert report["transformers"] == {"error": "RuntimeError: transformers exploded"}
    assert report["torch"]["version"] and report["ray"]["version"]
    assert "transformers exploded" in envcheck.format_human(report)


def test_a_fake_gpu_probe_drives_the_gpu_branch_and_a_failing_compile_is_recorded() -> None:
    fake = gpu_report()["cuda"]
    report = envcheck.collect(probe_compile=False, ray_address=None, cuda_probe=lambda: fake)
    assert report["cuda"] is fake
    # The GPU compile probe runs for real against a CPU-only torch: it fails, with the reason kept.
    assert report["compile"]["device"] == "cuda"
    assert report["compile"]["works"] is False and report["compile"]["error"]


def test_a_hung_compile_times_out(monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    release = threading.Event()
    monkeypatch.setattr(envcheck, "_compile_and_run", lambda device: release.wait(5))
    outcome = envcheck._probe_compile("cuda", timeout_s=0.1)
    release.set()
    assert outcome["works"] is False and "timed out" in outcome["error"]
