"""Batch-generation benchmark: our job against a naive Ray Data `map_batches` over transformers' `generate`.

Both read the same Parquet prompts and write Parquet completions through Ray Data,
one GPU actor each, greedy, a fixed number of new tokens per prompt, timed end to
end (model load and warm-up included) in the same process.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

logger = logging.getLogger(__name__)

# Printable ASCII: one token per character in the byte tokenizer, so prompt lengths are exact.
_ALPHABET = [chr(c) for c in range(32, 127)]


def write_prompts(
    path: Path,
    num_prompts: int,
    min_tokens: int,
    max_tokens: int,
    seed: int = 0,
    new_tokens_range: tuple[int, int] | None = None,
) -> Path:
    """Prompts of min_tokens..max_tokens characters; with `new_tokens_range`, a `max_tokens` column drawn
    from it per row, so that rows finish at different steps."""
    rng = random.Random(seed)
    prompts = ["".join(rng.choices(_ALPHABET, k=rng.randint(min_tokens, max_tokens))) for _ in range(num_prompts)]
    columns: dict[str, list[str] | list[int]] = {"prompt": prompts}
    if new_tokens_range is not None:
        columns["max_tokens"] = [rng.randint(*new_tokens_range) for _ in range(num_prompts)]
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path)
    return path


class HFGenerate:
    """What a newcomer writes: transformers' generate on each batch, left-padded."""

    def __init__(self, model_dir: str, new_tokens: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.tokenizer.padding_side = "left"
        self.tokenizer.pad_token = self.tokenizer.eos_token
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = torch.bfloat16 if self.device == "cuda" else torch.float32
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(self.device).eval()
        self.new_tokens = new_tokens

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        inputs = self.tokenizer(list(batch["prompt"]), return_tensors="pt", padding=True).to(self.device)
        with self.torch.inference_mode():
            out = self.model.generate(
                **inputs,
                max_new_tokens=self.new_tokens,
                min_new_tokens=self.new_tokens,
                do_sample=False,
                pad_token_id=self.tokenizer.eos_token_id,
            )
        texts = self.tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1] :])
        return {"prompt": batch["prompt"], "completion": np.array(texts, dtype=object)}


def naive_job(prompts: Path, model_dir: Path, output: Path, new_tokens: int, batch_size: int) -> dict:
    import ray
    import ray.data
    from ray.data import ActorPoolStrategy

    started = time.perf_counter()
    ds = ray.data.read_parquet(str(prompts))
    ds = ds.map_batches(
        HFGenerate,
        fn_constructor_kwargs={"model_dir": str(model_dir), "new_tokens": new_tokens},
        batch_size=batch_size,
        num_gpus=1 if ray.cluster_resources().get("GPU", 0) >= 1 else 0,
        compute=ActorPoolStrategy(size=1),
    )
    ds.write_parquet(str(output))
    wall_s = time.perf_counter() - started
    rows = pq.read_table(output).num_rows
    return {
        "job": f"naive map_batches + transformers generate (batch {batch_size})",
        "rows": rows,
        "wall_s": wall_s,
        "first_row_s": None,
        "completion_tokens": rows * new_tokens,
        "generated_tokens_per_s": rows * new_tokens / wall_s,
    }


class FirstFile:
    """Watches a directory from construction on; `seconds` is when the first Parquet file appeared under it
    (the batch job's first finished block of rows), or None."""

    def __init__(self, directory: Path, poll_s: float = 0.05) -> None:
        self.directory, self.poll_s = directory, poll_s
        self.started = time.perf_counter()
        self.seconds: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.is_set():
            if self.directory.exists() and next(self.directory.rglob("*.parquet"), None) is not None:
                self.seconds = time.perf_counter() - self.started
                return
            self._stop.wait(self.poll_s)

    def stop(self) -> float | None:
        self._stop.set()
        self._thread.join()
        return self.seconds


COMPILE_LABELS = {None: "", True: ", compiled", False: ", not compiled"}


def our_job(
    prompts: Path,
    model_dir: Path,
    output: Path,
    new_tokens: int,
    max_batch_size: int,
    max_seq_len: int,
    compile_step: bool | None = None,
    per_row_max_tokens: bool = False,
    label: str = "",
    overrides: list[str] | None = None,
) -> dict:
    """The batch job on `prompts`, timed from the call to its summary. `per_row_max_tokens`: the prompts'
    `max_tokens` column sets each row's budget (`new_tokens` is then only the default); `overrides`: more
    of the job's `KEY=VALUE` settings, applied last."""
    from gpt2_platform.batch import load, run_generation

    settings = [
        f"input.paths=[{prompts}]",
        f"output.path={output}",
        f"model.path={model_dir}",
        f"generation.max_tokens={new_tokens}",
        "generation.temperature=0",
        "generation.ignore_eos=true",
        f"engine.max_batch_size={max_batch_size}",
        f"engine.max_seq_len={max_seq_len}",
        # A block of rows per map_batches call at least as large as the engine's batch, and two of them in
        # flight, so the next block's prompts fill the slots the current one frees.
        f"scaling.batch_size={max(1024, max_batch_size)}",
        "output.progress_bars=false",
    ]
    if compile_step is not None:  # None: the job's own default (the token pick compiled on CUDA)
        settings.append(f"engine.compile={str(compile_step).lower()}")
    if per_row_max_tokens:
        settings.append("input.max_tokens_column=max_tokens")
    config = load(None, settings + list(overrides or ()))
    watcher = FirstFile(output)
    started = time.perf_counter()
    summary = run_generation(config)
    wall_s = time.perf_counter() - started
    first_row_s = watcher.stop()
    return {
        "job": f"gpt2-platform generate (engine batch {max_batch_size}{COMPILE_LABELS[compile_step]}{label})",
        "rows": summary["rows"],
        "wall_s": wall_s,
        "first_row_s": first_row_s,
        "completion_tokens": summary["completion_tokens"],
        "generated_tokens_per_s": summary["completion_tokens"] / wall_s,
    }
