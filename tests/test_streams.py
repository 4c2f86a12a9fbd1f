"""When a stream's chunks go out (serve/streams.py); the rest of the path is tested over HTTP in test_serve."""

from __future__ import annotations

from gpt2_platform.serve.streams import ChunkPacer


def test_chunk_pacer_sends_first_and_last_at_once_and_the_rest_at_most_every_interval():
    now = [0.0]
    pacer = ChunkPacer(0.020, clock=lambda: now[0])
    assert not pacer.ready(more_waiting=True, finished=False)  # more events queued: keep collecting
    assert pacer.ready(more_waiting=False, finished=False)  # the first chunk: time to first token
    now[0] = 0.005
    assert not pacer.ready(more_waiting=False, finished=False)  # within the interval: held
    now[0] = 0.021
    assert pacer.ready(more_waiting=False, finished=False)
    now[0] = 0.022
    assert pacer.ready(more_waiting=True, finished=True)  # the end is never held back
    every_token = ChunkPacer(0.0, clock=lambda: now[0])
    assert every_token.ready(False, False) and every_token.ready(False, False)
