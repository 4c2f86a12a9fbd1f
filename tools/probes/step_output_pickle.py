"""Probe: host time to send one engine step's output over the token link, the old shape against the new.

    python tools/probes/step_output_pickle.py

One step's output for 1, 64 and 256 sequences (one token each, few finishing), pickled and
unpickled as multiprocessing's Connection does (ForkingPickler.dumps, pickle.loads):

- records: the old message, a list with a (key, token, finish reason, error) tuple per sequence;
- step output: engine/messages.py's StepOutput as it travels (a plain tuple of columns), rebuilt on
  arrival; "+ build" adds building it from the engine's records on the engine's thread (the Outlet's
  work each step);
- step output as a class: the same StepOutput pickled as a NamedTuple instance, what `wire()` avoids.

Also the ingress's loop over the rows (RemoteEngine._take's iteration, without its per-token work).
Prints microseconds per step, the best of several repeats.
"""

from __future__ import annotations

import pickle
import sys
import timeit
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "platform"))

from gpt2_platform.engine.messages import StepOutput  # noqa: E402

NUMBER, REPEAT = 2000, 7
GOING_ON, NONE_FINISHED = (None, None, None), {}


def best_us(function) -> float:
    return min(timeit.repeat(function, number=NUMBER, repeat=REPEAT)) / NUMBER * 1e6


def records_of(num_sequences: int) -> tuple[list[tuple], dict]:
    """A step's token records as the engine leaves them in an Outlet: of sequences that generate 128 tokens
    each, one in 128 finishes at a step (none at 1 and 64 sequences, two at 256)."""
    records = [(1000 + i, 50 + i % 200, None, None) for i in range(num_sequences)]
    finished = {}
    for row in range(0, num_sequences // 128):
        records[row] = (*records[row][:2], "length", None)
        finished[row] = ("length", None, None)
    return records, finished


def loop_records(records: list[tuple]) -> None:
    for _key, _token, _reason, _error, *_logprobs in records:
        pass


def loop_output(output: StepOutput) -> None:
    keys, tokens, finished, logprobs = output
    finished = finished or NONE_FINISHED
    for row, (_key, _token) in enumerate(zip(keys, tokens, strict=True)):
        finished.get(row, GOING_ON)
        if logprobs is not None and row in logprobs:
            pass


def main() -> int:
    print(f"{'sequences':>9} {'records':>8} {'step output':>12} {'+ build':>8} {'as a class':>10}   "
          f"{'loop records':>12} {'loop output':>11}   bytes: records / step output")  # fmt: skip
    for num_sequences in (1, 64, 256):
        records, finished = records_of(num_sequences)
        output = StepOutput.of_records(records, finished, with_logprobs=False)
        old = best_us(lambda: pickle.loads(ForkingPickler.dumps(records)))  # noqa: B023
        new = best_us(lambda: StepOutput.of_wire(pickle.loads(ForkingPickler.dumps(output.wire()))))  # noqa: B023
        built = best_us(
            lambda: StepOutput.of_wire(
                pickle.loads(ForkingPickler.dumps(StepOutput.of_records(records, finished, False).wire()))  # noqa: B023
            )
        )
        as_class = best_us(lambda: pickle.loads(ForkingPickler.dumps(output)))  # noqa: B023
        loop_old = best_us(lambda: loop_records(records))  # noqa: B023
        loop_new = best_us(lambda: loop_output(output))  # noqa: B023
        sizes = f"{len(ForkingPickler.dumps(records))} / {len(ForkingPickler.dumps(output.wire()))}"
        print(f"{num_sequences:>9} {old:>8.2f} {new:>12.2f} {built:>8.2f} {as_class:>10.2f}   "
              f"{loop_old:>12.2f} {loop_new:>11.2f}   {sizes}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
