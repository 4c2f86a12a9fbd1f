"""Autoscaling policies: ingress replicas on the requests they work on (leaving out those whose clients
are still sending bodies), engine replicas on the sequences they hold (`sequences_policy`, at the end).

Serve counts a request as ongoing from the moment its headers reach a replica: Serve's proxy hands
the request on before the body has arrived, and the replica reads the body. A client that declares a
body and sends it slowly (or never) therefore looks like load, and enough of them scale the
deployment up for nothing. Each replica reports how many bodies it is still reading
(`GPT2Server.record_autoscaling_stats`), and this policy takes them off Serve's count.

    autoscaling_config:
      policy:
        policy_function: gpt2_platform.serve.autoscaling:working_requests_policy

Serve applies min/max_replicas, the up/downscale delays and factors around it, as for its own policy.
"""

from __future__ import annotations

import logging
from typing import Any

from ray.serve.config import AutoscalingContext

logger = logging.getLogger(__name__)

BODIES_IN_FLIGHT = "bodies_in_flight"
"""The custom metric: requests whose bodies a replica is still reading."""
POLICY_PATH = "gpt2_platform.serve.autoscaling:working_requests_policy"
ENGINE_SEQUENCES = "engine_sequences"
"""The engine replicas' custom metric: sequences running and waiting in the engine."""
ENGINE_POLICY_PATH = "gpt2_platform.serve.autoscaling:sequences_policy"


def working_requests_policy(ctx: AutoscalingContext) -> tuple[float, dict[str, Any]]:
    """Replicas for Serve's ongoing requests less the bodies still arriving, at target_ongoing_requests each.

    Both counts are averaged over look_back_period_s in the same way, so the difference is too.
    """
    reading = sum((ctx.aggregated_metrics or {}).get(BODIES_IN_FLIGHT, {}).values())
    working = max(ctx.total_num_requests - reading, 0.0)
    return working / ctx.config.get_target_ongoing_requests(), {}


def sequences_policy(ctx: AutoscalingContext) -> tuple[float, dict[str, Any]]:
    """Engine replicas for the sequences they hold, at target_ongoing_requests sequences each.

    Ingresses send sequences over their token links, not as Serve calls, so Serve's own count of an
    engine's ongoing requests misses most of its load; each engine reports its sequences itself.
    """
    sequences = sum((ctx.aggregated_metrics or {}).get(ENGINE_SEQUENCES, {}).values())
    return sequences / ctx.config.get_target_ongoing_requests(), {}
