"""Fine-tuning on Ray Train: data, the per-worker loop, and the driver."""
