"""GPU monitoring: nvidia-ml-py samples per GPU (`nvml`), exported as Ray metrics per node (`exporter`)."""
