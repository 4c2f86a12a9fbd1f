"""Training scalars for TensorBoard, in `<run>/tensorboard/` beside `history.jsonl`.

`tensorboard --logdir <run>/tensorboard` (or a folder of runs) shows the loss, validation loss and
perplexity, learning rate, gradient norm, tokens/s, MFU and peak memory by step. Written by rank 0
at every report, with tensorboardX (a dependency of Ray Train's, and light: no TensorBoard needed
to write). A resumed run purges the events past its checkpoint, so a curve never folds back on itself.
"""

from __future__ import annotations

from pathlib import Path

from tensorboardX import SummaryWriter

TENSORBOARD_DIR = "tensorboard"
TAGS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "val_loss": "val/loss",
    "val_ppl": "val/perplexity",
    "tokens_per_s": "perf/tokens_per_s",
    "mfu": "perf/mfu",
    "peak_mem_gib": "perf/peak_mem_gib",
}
"""history.jsonl's key -> TensorBoard's tag."""


class ScalarLog:
    def __init__(self, run_dir: Path, start_step: int) -> None:
        """`start_step`: the checkpoint's step a resumed run starts after (0 for a new run)."""
        purge_step = start_step + 1 if start_step else None
        self.writer = SummaryWriter(str(run_dir / TENSORBOARD_DIR), purge_step=purge_step)

    def record(self, metrics: dict) -> None:
        """One report's metrics at its step; flushed, so TensorBoard sees them while the run goes on."""
        step = metrics["step"]
        for key, tag in TAGS.items():
            if key in metrics:
                self.writer.add_scalar(tag, float(metrics[key]), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
