"""gpt2-platform: fine-tune, serve and batch-generate GPT-2 class models on Ray."""

__version__ = "0.1.0"
