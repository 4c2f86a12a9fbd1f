"""A LoRA run's two ends: resuming only under the adapters it was started with, and exporting a peft adapter
(with its base, where the base exists nowhere else, and on request the merged model)."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

from gpt2_platform.adapter import export_lora
from gpt2_platform.config_loader import ConfigError
from gpt2_platform.lora import LoraConfig
from gpt2_platform.tokenizer import load_tokenizer
from gpt2_platform.train.config import Config

ADAPTER_DIR = "adapter"
"""The run's adapter export, beside its merged model (`model/`) when one is asked for."""
BASE_DIR = "base"
"""A preset run's frozen base (fresh weights), which its adapter applies to."""


def check_same_lora(lora: LoraConfig | None, saved_config: dict) -> None:
    """Refuse to resume a checkpoint written with other adapters (or none, or full fine-tuning) than
    `model.lora` asks for: its weights and optimizer state are laid out for those."""
    saved = saved_config.get("model", {}).get("lora")
    now = None if lora is None else dataclasses.asdict(lora)
    shape = ("r", "targets")
    if (saved is None) != (now is None) or (now is not None and any(saved.get(k) != now[k] for k in shape)):
        before = "full fine-tuning" if saved is None else f"model.lora r={saved.get('r')} on {saved.get('targets')}"
        asked = "full fine-tuning" if now is None else f"model.lora r={now['r']} on {now['targets']}"
        raise ConfigError(
            f"this run's checkpoint was written by {before}, and {asked} cannot resume it; set model.lora as the "
            "run started, or start a new run (model.init_from: its export)"
        )


def export_lora_run(checkpoint_dir: Path, config: Config, run_dir: Path, merged_dir: Path) -> Path:
    """The run's adapter directory (peft's format), and `merged_dir` when model.lora.export_merged; returns the
    directory the run's result names (the merged model if written, else the adapter)."""
    lora = config.model.lora
    assert lora is not None

    def fill(stage: Path) -> None:
        shutil.copy2(checkpoint_dir / "config.yaml", stage / "config.yaml")
        load_tokenizer(config.data.tokenizer).save_pretrained(stage)

    base: str | Path | None = config.model.init_from
    base_dir = None
    if base is None:
        base = base_dir = run_dir / BASE_DIR
    merged = merged_dir if lora.export_merged else None
    export_lora(checkpoint_dir, lora, run_dir / ADAPTER_DIR, base, merged, extra=fill, base_dir=base_dir)
    return merged or run_dir / ADAPTER_DIR
