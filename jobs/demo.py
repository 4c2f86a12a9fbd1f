"""The demo: fine-tune the tiny preset with 2 Ray workers on a corpus the project makes itself, serve it, batch-generate.

    make demo          (or: python jobs/demo.py)

Runs on an embedded local Ray on a laptop CPU in a few minutes: trains, evaluates the
perplexity on held-out stories before and after fine-tuning, loads the exported model
with plain transformers, then serves it with Ray Serve
(OpenAI-compatible HTTP), sends a few requests (one streamed), shuts it down,
and finally generates completions for a Parquet file of prompts with Ray Data.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "platform"))

from gpt2_platform import demo_data, quiet  # noqa: E402
from gpt2_platform.jobs_common import run_main  # noqa: E402
from gpt2_platform.train import config as config_lib  # noqa: E402

logger = logging.getLogger("demo")

# A story cut before its second count: what follows is set by the story's frame, who was given and what,
# and the sum; a tiny model learns the first two well before the sums.
PROMPT = "carol has 4 pens. bob gives carol 3"
EXPECTED = " pens. now carol has 7 pens."
TRAIN_STEPS = 600
"""Long enough for the tiny model to carry the name and the thing through a story (tiny.yaml's 300 are not)."""


def banner(text: str) -> None:
    print(f"\n=== {text} ===", flush=True)


def tiny_config() -> config_lib.Config:
    corpus = demo_data.write_text(ROOT / "data" / "demo" / "corpus.txt", num_stories=20000)
    return config_lib.load(
        ROOT / "jobs" / "configs" / "tiny.yaml",
        [f"data.paths=[{corpus}]", f"run.storage_path={ROOT / 'runs'}", f"train.max_steps={TRAIN_STEPS}"],
    )


def train(config: config_lib.Config) -> Path:
    from gpt2_platform.train.trainer import fit

    corpus = Path(config.data.paths[0])
    run_dir = Path(config.run.storage_path) / config.run.name
    if run_dir.exists():
        # The demo starts fresh each time; a real run of the same name would resume instead.
        shutil.rmtree(run_dir)
    banner(
        f"fine-tuning the {config.model.preset} preset: {config.scaling.num_workers} Ray workers, {config.train.max_steps} steps"
    )
    print(
        f"corpus: {corpus} ({corpus.stat().st_size / 1e6:.1f} MB of generated stories, e.g. {demo_data.stories(1)[0]!r})"
    )
    start = time.perf_counter()
    result = fit(config)
    history = [json.loads(line) for line in (result.run_dir / "history.jsonl").read_text().splitlines()]
    steps = [h for h in history if "loss" in h]
    banner(f"trained in {time.perf_counter() - start:.0f} s")
    print(
        f"loss: {steps[0]['loss']:.3f} at step {steps[0]['step']} -> {steps[-1]['loss']:.3f} at step {steps[-1]['step']}"
    )
    val = [h for h in steps if "val_loss" in h]
    if val:
        print(
            f"validation loss {val[-1]['val_loss']:.3f} (perplexity {val[-1]['val_ppl']:.2f}) at step {val[-1]['step']}"
        )
    print(f"checkpoint: {result.checkpoint_dir}")
    print(f"model:      {result.model_dir}")
    return result.model_dir


def initial_model(config: config_lib.Config) -> Path:
    """The weights the fine-tuning starts from (a worker seeds with train.seed, then builds the model), saved
    as a model directory, to evaluate before fine-tuning."""
    import torch

    from gpt2_platform import checkpoint
    from gpt2_platform.tokenizer import load_tokenizer
    from gpt2_platform.train.loading import build_model

    torch.manual_seed(config.train.seed)
    directory = ROOT / "runs" / "demo-tiny-initial"
    extra = lambda d: load_tokenizer(config.data.tokenizer).save_pretrained(d)  # noqa: E731
    checkpoint.save_pretrained(build_model(config.model), directory, overwrite=True, extra=extra)
    return directory


def evaluate(before: Path, after: Path, block_size: int) -> None:
    """Perplexity and bits per byte on held-out stories, before and after fine-tuning (jobs/evaluate.py's path)."""
    from gpt2_platform.batch.evaluate import load, run_evaluation

    held_out = demo_data.write_text(ROOT / "data" / "demo" / "held_out.txt", num_stories=300, seed=1)
    banner(f"evaluating on held-out stories ({held_out}): blocks of {block_size} + 1 tokens, as training packs them")
    for label, model_dir in (("before fine-tuning:", before), ("after fine-tuning:", after)):
        overrides = [f"model.path={model_dir}", f"data.paths=[{held_out}]", f"data.block_size={block_size}"]
        result = run_evaluation(load(None, overrides))
        print(
            f"{label:<20} perplexity {result['perplexity']:7.3f}, {result['bits_per_byte']:.3f} bits per byte "
            f"({result['scored_tokens']} tokens in {result['wall_s']:.1f} s)"
        )
    print(
        "the same from the command line: "
        f"python jobs/evaluate.py --model {after} --data {held_out} --block-size {block_size}"
    )


def complete(model_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as transformers_logging

    banner("loading the model with transformers and completing a prompt")
    # Its "Loading weights" bar redraws with carriage returns, which a log or pipe shows as one garbled line.
    transformers_logging.disable_progress_bar()
    # Loading imports torchao (installed for the low-bit optimizers; this step does not use it), which warns
    # that its CUDA kernel libraries do not load on a machine without CUDA, and registers its enums with torch's
    # pytree the way torch now calls deprecated: warnings about a library's own set-up that no user acts on here.
    logging.getLogger("torchao").setLevel(logging.ERROR)
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=32, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    completion = tokenizer.decode(out[0, ids.shape[1] :]).split("\n")[0]  # the story, not the next one
    print(f"prompt:     {PROMPT!r}\ncompletion: {completion!r}")
    print(f"the story:  {EXPECTED!r} (frame, name and thing come first in training; the sums much later)")


def serve_and_query(model_dir: Path) -> None:
    import json as json_lib
    import socket

    import httpx
    from ray import serve

    from gpt2_platform.engine.config import EngineConfig
    from gpt2_platform.serve.app import build_app
    from gpt2_platform.serve.schemas import AppArgs

    banner("serving it with Ray Serve (OpenAI-compatible HTTP)")
    quiet.quiet_serve_driver()
    logging.getLogger("httpx").setLevel(logging.WARNING)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port}, logging_config=quiet.SERVE_LOGGING)
    try:
        start = time.perf_counter()
        engine = EngineConfig(max_batch_size=8, max_seq_len=256)
        args = AppArgs(model=str(model_dir), served_model_name="demo-tiny", engine=engine)
        serve.run(build_app(args), name="demo", route_prefix="/", logging_config=quiet.SERVE_LOGGING)
        url = f"http://127.0.0.1:{port}"
        print(f"app ready at {url} in {time.perf_counter() - start:.1f} s (engine warmed before it reported healthy)")
        with httpx.Client(base_url=url, timeout=60) as client:
            for prompt in (PROMPT, "ivan has 2 keys. judy gives ivan 5 keys. now"):
                start = time.perf_counter()
                body = {"model": "demo-tiny", "prompt": prompt, "max_tokens": 32, "temperature": 0, "stop": ["\n"]}
                reply = client.post("/v1/completions", json=body).json()
                print(
                    f"POST /v1/completions {prompt!r} -> {reply['choices'][0]['text']!r} "
                    f"({1000 * (time.perf_counter() - start):.0f} ms, {reply['usage']['completion_tokens']} tokens)"
                )
            body = {
                "model": "demo-tiny",
                "prompt": "bob has",
                "max_tokens": 24,
                "temperature": 0.8,
                "seed": 1,
                "stream": True,
            }
            print("streamed:  ", end="", flush=True)
            start = time.perf_counter()
            first = None
            with client.stream("POST", "/v1/completions", json=body) as response:
                for line in response.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        first = first or time.perf_counter()
                        text = json_lib.loads(line[6:])["choices"][0]["text"]
                        print(text.replace("\n", "\\n"), end="", flush=True)
            print(
                f"\n            (first token after {1000 * (first - start):.0f} ms, all in {1000 * (time.perf_counter() - start):.0f} ms)"
            )
            reply = client.post(
                "/generate", json={"prompt": "grace has 7", "max_length": 40, "temperature": 0.0}
            ).json()
            print(f"POST /generate -> {reply['generated_text']!r} ({1000 * reply['inference_time']:.0f} ms)")
    finally:
        # Not serve.shutdown(): Serve's controller ends by being killed while its caller still waits on it,
        # and Ray logs that call's failure. The controller and proxy use no CPU, and stop with Ray at exit.
        serve.delete("demo")
        print("app shut down")


def batch_generate(model_dir: Path) -> None:
    """A Parquet file of prompts -> completions with Ray Data and the engine; a few rows and the summary."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from gpt2_platform.batch import load, run_generation
    from gpt2_platform.batch.output import part_files

    banner("batch generation over a Parquet file of prompts (Ray Data)")
    work = ROOT / "runs" / "demo-batch"
    if work.exists():
        shutil.rmtree(work)  # the demo starts fresh; a rerun of a real job resumes instead
    work.mkdir(parents=True)
    names = ("alice", "bob", "carol", "dave")
    prompts = [f"{name} has {n} apples. {names[n % 4]} gives" for n in range(1, 51) for name in names]
    pq.write_table(pa.table({"prompt": prompts}), work / "prompts.parquet")
    overrides = [
        f"input.paths=[{work / 'prompts.parquet'}]",
        f"output.path={work / 'out'}",
        f"model.path={model_dir}",
        "generation.max_tokens=24",
        "generation.stop=['.']",
    ]
    summary = run_generation(load(ROOT / "jobs" / "configs" / "generate-tiny.yaml", overrides))
    for row in pq.read_table([str(p) for p in part_files(work / "out")]).slice(0, 4).to_pylist():
        print(f"{row['id']}: {row['prompt']!r} -> {row['completion']!r} ({row['finish_reason']})")
    keys = ("rows", "errors", "completion_tokens", "completion_tokens_per_s", "wall_s")
    print("summary:", json.dumps({k: summary[k] for k in keys}))
    print(f"output: {work / 'out'}")


def main() -> int:
    if os.environ.get(quiet.RELAYED_VAR) != "1":
        return quiet.run_relaying_stderr([sys.executable, __file__, *sys.argv[1:]])

    def run() -> None:
        config = tiny_config()
        model_dir = train(config)
        evaluate(initial_model(config), model_dir, config.data.block_size)
        complete(model_dir)
        serve_and_query(model_dir)
        batch_generate(model_dir)

    return run_main(run)


if __name__ == "__main__":
    sys.exit(main())
