"""gpt2_platform.bench.memory: the loss-parity table (the runs themselves need a GPU, or time: see docs/training.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from gpt2_platform import traces
from gpt2_platform.bench import memory


def test_each_new_setup_is_a_row_and_parity_compares_final_losses_with_the_reference() -> None:
    assert {"ddp + adamw8bit + checkpointing", "ddp + adamw_bf16 + checkpointing"} <= set(memory.SETUPS)
    assert memory.REFERENCE_SETUP in memory.SETUPS
    reference = [5.0] * 10 + [3.0] * 10  # the last 10 steps' mean is what counts
    curves = {memory.REFERENCE_SETUP: reference, "near": [9.0] * 10 + [3.02] * 10, "far": [3.1] * 20}
    assert memory.final_loss(reference) == 3.0
    rows = memory.parity_as_markdown(curves).splitlines()
    assert rows[2].startswith("| ddp | 3.0000 | +0.00% | yes |")
    assert rows[3] == "| near | 3.0200 | +0.67% | yes |"
    assert rows[4] == "| far | 3.1000 | +3.33% | no |"


def test_a_lora_setup_trains_only_the_adapters_and_a_profiled_step_leaves_a_trace_the_summary_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(memory._free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        model, step = memory.build_setup("tiny", "ddp + lora r16 + checkpointing", torch.device("cpu"))
        trainable = [name for name, param in model.named_parameters() if param.requires_grad]
        assert trainable and all("lora_" in name for name in trainable), trainable
        frozen = {name: param.detach().clone() for name, param in model.named_parameters() if not param.requires_grad}
        tokens = torch.randint(0, model.config.vocab_size, (2, 33))
        path = memory.profile_steps(step, [(tokens[:, :-1], tokens[:, 1:])], tmp_path / "tiny-lora")
    finally:
        dist.destroy_process_group()
    for name, param in model.named_parameters():
        if name in frozen:
            assert torch.equal(param, frozen[name]), f"{name} is frozen but changed"
    assert path.name == "tiny-lora.pt.trace.json"
    assert "aten::" in traces.summary(tmp_path, top=5)  # the operators its steps ran


def test_a_step_of_no_micro_batches_is_refused_before_any_run() -> None:
    script = Path(__file__).resolve().parent.parent / "jobs" / "bench_memory.py"
    done = subprocess.run(
        [sys.executable, str(script), "--grad-accum", "0"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and "--grad-accum must be at least 1, got 0" in done.stderr, done.stderr
