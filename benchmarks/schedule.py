"""Arrival schedules for open-loop load, computed before the first request is sent.

A schedule is a list of offsets in seconds from the start of the run, ascending. The
benchmark launches request i at offset i whatever the server is doing: a slow server
makes requests pile up, it never slows the arrivals down (that would be a closed loop,
which hides queueing).
"""

from __future__ import annotations

import math

import numpy as np

# Refuse schedules that would not fit in memory, whatever the flags say.
MAX_SCHEDULED_REQUESTS = 10_000_000


def arrival_offsets(
    rate: float,
    *,
    num_requests: int | None,
    duration_s: float | None = None,
    burstiness: float = 1.0,
    seed: int = 0,
) -> list[float]:
    """When each request is sent: offsets (s) from the start, the first at 0.

    Inter-arrival gaps are gamma-distributed with shape `burstiness` and mean `1/rate`:
    shape 1 is a Poisson process, below 1 arrivals come in bursts (variance of the gaps
    is `1 / (burstiness * rate**2)`), above 1 they are more regular. `rate = inf` sends
    every request at offset 0. The schedule ends after `num_requests` entries or before
    the first arrival at or past `duration_s`, whichever comes first. The same arguments
    always give the same schedule.
    """
    if num_requests is None and duration_s is None:
        raise ValueError("a schedule needs num_requests or duration_s")
    if not rate > 0 or not burstiness > 0:
        raise ValueError("rate and burstiness must be > 0")
    limit = MAX_SCHEDULED_REQUESTS if num_requests is None else num_requests
    if math.isinf(rate):
        if num_requests is None:
            raise ValueError("an infinite rate needs num_requests")
        return [0.0] * num_requests

    rng = np.random.default_rng(seed)
    scale = 1.0 / (rate * burstiness)
    horizon = math.inf if duration_s is None else duration_s
    # Draw in batches sized to the expected count, so duration-bounded runs need ~one draw.
    batch = 1024 if duration_s is None else int(rate * duration_s * 1.2) + 64
    offsets: list[float] = []
    origin: float | None = None
    elapsed = 0.0
    while len(offsets) < limit:
        gaps = rng.gamma(burstiness, scale, size=min(batch, limit - len(offsets)))
        arrivals = elapsed + np.cumsum(gaps)
        elapsed = float(arrivals[-1])
        if origin is None:
            origin = float(arrivals[0])  # shift so that the first request goes at 0
        arrivals -= origin
        kept = arrivals[arrivals < horizon]
        offsets.extend(kept.tolist())
        if len(kept) < len(arrivals):
            break
    return offsets


def trace_offsets(
    timestamps: list[float],
    *,
    time_scale: float = 1.0,
    num_requests: int | None = None,
    duration_s: float | None = None,
) -> list[float]:
    """Replay recorded arrival times: offsets from the first timestamp, times `time_scale`.

    `timestamps` must be ascending; the schedule is cut like `arrival_offsets`.
    """
    if not timestamps:
        return []
    start = timestamps[0]
    offsets = [(t - start) * time_scale for t in timestamps]
    if duration_s is not None:
        offsets = [t for t in offsets if t < duration_s]
    if num_requests is not None:
        offsets = offsets[:num_requests]
    return offsets
