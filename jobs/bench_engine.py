"""Benchmark generation: transformers' `generate` against our engine on the same model and prompts.

    python jobs/bench_engine.py --preset gpt2 --batch-sizes 1 32 64 256      # on a GPU
    python jobs/bench_engine.py --preset tiny --batch-sizes 1 4 --new-tokens 16   # CPU smoke run

Prints tokens/s for both at each batch size (same process, same prompts,
greedy, 128 prompt + 128 new tokens by default; each side's best of --runs timed runs) and the
engine's decode step time, with the bytes a step must read, the GB/s that makes and the peak memory.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "platform"))

import torch  # noqa: E402

from gpt2_platform.bench.generation import as_markdown, run  # noqa: E402
from gpt2_platform.jobs_common import configure_logging  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="gpt2")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32, 64, 256])
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--compile", action="store_true", help="torch.compile the engine's decode step")
    parser.add_argument(
        "--decode-kernels", default="auto", choices=["auto", "triton", "torch"], help="see EngineConfig.decode_kernels"
    )
    parser.add_argument("--engine-only", action="store_true", help="skip transformers' generate")
    parser.add_argument("--logprobs", action="store_true", help="also time the step with log-probabilities")
    parser.add_argument("--runs", type=int, default=3, help="timed runs per side and batch size; the best counts")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    configure_logging()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    result = run(
        args.preset,
        args.batch_sizes,
        args.prompt_tokens,
        args.new_tokens,
        args.dtype,
        device,
        args.compile,
        args.runs,
        args.decode_kernels,
        args.engine_only,
        args.logprobs,
    )
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"{args.preset}, {args.prompt_tokens} prompt + {args.new_tokens} new tokens, {name}, torch {torch.__version__}"
    )
    print(as_markdown(result))
    if args.json_out:
        args.json_out.write_text(
            json.dumps({"device": name, "torch": torch.__version__, **result}, indent=2, default=str)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
