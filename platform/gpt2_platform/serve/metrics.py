"""Serving metrics through `ray.util.metrics`, tagged by model, exported on Ray's Prometheus endpoint.

Per request: time to first token, time per output token, generated tokens, a
request count by route and status, and what moderation blocked. Per replica, sampled from the engine's own
counters once a second: running and waiting sequences, and the mean decode batch
size over the last interval.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from ray.util import metrics

logger = logging.getLogger(__name__)

# Seconds; decode steps run from ~0.5 ms (a GPU graph) to ~100 ms (a big model on CPU).
_TOKEN_LATENCY_BOUNDARIES_S = [0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0]
_FLUSH_S = 1.0
_FIRST_TOKEN_BOUNDARIES_S = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]


class ServeMetrics:
    """The metrics of one replica; every series carries the served model's name as the `model` tag."""

    def __init__(self, model_name: str) -> None:
        tags = {"model": model_name}
        self.time_to_first_token_s = metrics.Histogram(
            "gpt2_serve_time_to_first_token_s",
            description="Seconds from a request's admission to the engine to its first generated token.",
            boundaries=_FIRST_TOKEN_BOUNDARIES_S,
            tag_keys=("model",),
        )
        self.time_per_output_token_s = metrics.Histogram(
            "gpt2_serve_time_per_output_token_s",
            description="Seconds per generated token after the first, per sequence.",
            boundaries=_TOKEN_LATENCY_BOUNDARIES_S,
            tag_keys=("model",),
        )
        self.generated_tokens = metrics.Counter(
            "gpt2_serve_generated_tokens", description="Tokens generated.", tag_keys=("model",)
        )
        self.prompt_tokens = metrics.Counter(
            "gpt2_serve_prompt_tokens", description="Prompt tokens prefilled.", tag_keys=("model",)
        )
        self.requests = metrics.Counter(
            "gpt2_serve_requests",
            description="HTTP requests by route and status.",
            tag_keys=("model", "route", "status"),
        )
        self.running_sequences = metrics.Gauge(
            "gpt2_serve_running_sequences", description="Sequences holding an engine slot.", tag_keys=("model",)
        )
        self.waiting_sequences = metrics.Gauge(
            "gpt2_serve_waiting_sequences", description="Sequences waiting for an engine slot.", tag_keys=("model",)
        )
        self.batch_size = metrics.Gauge(
            "gpt2_serve_batch_size",
            description="Mean sequences per decode step over the last sampling interval.",
            tag_keys=("model",),
        )
        self.moderation_blocked = metrics.Counter(
            "gpt2_serve_moderation_blocked",
            description="Prompts refused and completions withheld by moderation, by kind (prompt, completion).",
            tag_keys=("model", "kind"),
        )
        for metric in list(vars(self).values()):  # every attribute so far is a metric
            metric.set_default_tags(tags)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_batch_sizes: dict[int, int] = {}
        # Counts gathered here and added to the counters at most once a second: each record into Ray's
        # metrics costs tens of microseconds, paid per request and per sequence on the event loop that
        # serves every stream of the replica.
        self._pending: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self._pending_lock = threading.Lock()
        threading.Thread(target=self._flush_loop, name="gpt2-serve-metrics-flush", daemon=True).start()

    def _count(self, counter: str, value: float, **tags: str) -> None:
        key = (counter, tuple(sorted(tags.items())))
        with self._pending_lock:
            self._pending[key] = self._pending.get(key, 0.0) + value

    def flush(self) -> None:
        """Add the gathered counts to Ray's counters."""
        with self._pending_lock:
            pending, self._pending = self._pending, {}
        for (counter, tags), value in pending.items():
            getattr(self, counter).inc(value, tags=dict(tags) or None)

    def _flush_loop(self) -> None:
        while not self._stop.wait(_FLUSH_S):
            try:
                self.flush()
            except Exception:  # a metrics hiccup must never take the replica down
                logger.exception("could not record serving counters")

    def record_request(self, route: str, status_code: int) -> None:
        self._count("requests", 1, route=route, status=str(status_code))

    def record_moderation_block(self, kind: str) -> None:
        self.moderation_blocked.inc(tags={"kind": kind})

    def record_first_token(self, seconds: float) -> None:
        self.time_to_first_token_s.observe(seconds)

    def record_sequence(self, prompt_tokens: int, completion_tokens: int, decode_s: float) -> None:
        """One finished sequence: its token counts and the time from its first token to its last."""
        # Ray's counters refuse 0, and a sequence the engine failed before it ran reports no tokens.
        if prompt_tokens > 0:
            self._count("prompt_tokens", prompt_tokens)
        if completion_tokens > 0:
            self._count("generated_tokens", completion_tokens)
        if completion_tokens > 1:
            self.time_per_output_token_s.observe(decode_s / (completion_tokens - 1))

    def start_sampling(self, engine_stats: Callable[[], dict], interval_s: float = 1.0) -> None:
        """Sample the engine's counters every `interval_s` on a daemon thread, until `stop()`."""
        self._thread = threading.Thread(
            target=self._sample_loop, args=(engine_stats, interval_s), name="gpt2-serve-metrics", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.flush()

    def _sample_loop(self, engine_stats: Callable[[], dict], interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                self.sample(engine_stats())
            except Exception:  # a metrics hiccup must never take the replica down
                logger.exception("could not sample engine stats")

    def sample(self, stats: dict) -> None:
        self.running_sequences.set(stats["running"])
        self.waiting_sequences.set(stats["waiting"])
        batch_sizes: dict[int, int] = stats["batch_sizes"]
        steps = {size: count - self._last_batch_sizes.get(size, 0) for size, count in batch_sizes.items()}
        self._last_batch_sizes = dict(batch_sizes)
        num_steps = sum(steps.values())
        self.batch_size.set(sum(size * count for size, count in steps.items()) / num_steps if num_steps else 0.0)
