"""Training metrics as Ray metrics (Prometheus, the dashboard's Metrics view), set by rank 0.

`ray.train.report` keeps the history for Ray Train; these gauges put the same
numbers next to the per-GPU and serving metrics in Grafana, tagged by run.
"""

from __future__ import annotations

from ray.util import metrics

# Reported key -> (metric name, description). Names must match [a-zA-Z_:][a-zA-Z0-9_:]* or Ray drops them.
GAUGES = {
    "loss": ("gpt2_train_loss", "Training loss, mean over the last log interval."),
    "val_loss": ("gpt2_train_val_loss", "Validation loss at the last evaluation."),
    "lr": ("gpt2_train_learning_rate", "Learning rate of the last step."),
    "grad_norm": ("gpt2_train_grad_norm", "Gradient norm before clipping, last step."),
    "tokens_per_s": ("gpt2_train_tokens_per_second", "Training tokens per second, all workers."),
    "mfu": ("gpt2_train_mfu", "Model FLOPs utilization per GPU, 0..1."),
    "peak_mem_gib": ("gpt2_train_peak_memory_gib", "Peak GPU memory allocated on any worker, GiB."),
    "step": ("gpt2_train_step", "Optimizer steps completed."),
}


class TrainMetrics:
    def __init__(self, run_name: str) -> None:
        self.tags = {"run": run_name}
        self.gauges = {
            key: metrics.Gauge(name, description=description, tag_keys=("run",))
            for key, (name, description) in GAUGES.items()
        }

    def record(self, reported: dict) -> None:
        for key, gauge in self.gauges.items():
            value = reported.get(key)
            if value is not None:
                gauge.set(float(value), tags=self.tags)
