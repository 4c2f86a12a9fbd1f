"""gpt2_platform.bench.memory: the loss-parity table (the runs themselves need a GPU, or time: see docs/training.md)."""

from __future__ import annotations

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
