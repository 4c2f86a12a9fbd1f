"""Offline batch generation: Parquet prompts -> engine actors on Ray Data -> Parquet completions, resumable."""

from gpt2_platform.batch.config import GenerateConfig, load
from gpt2_platform.batch.generate import run_generation

__all__ = ["GenerateConfig", "load", "run_generation"]
