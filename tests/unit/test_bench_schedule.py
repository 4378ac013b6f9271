"""The open-loop arrival schedule: right rate, right burstiness, reproducible."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from baton.benchmarks.schedule import arrival_offsets, trace_offsets

N = 20_000


def gaps(offsets: list[float]) -> np.ndarray:
    return np.diff(np.asarray(offsets))


@pytest.mark.parametrize("rate", [0.5, 4.0, 100.0])
def test_mean_gap_is_one_over_rate(rate: float) -> None:
    g = gaps(arrival_offsets(rate, num_requests=N, seed=1))
    mean, sigma = 1.0 / rate, 1.0 / rate  # exponential gaps: sd == mean
    assert abs(g.mean() - mean) < 5 * sigma / math.sqrt(len(g))


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_burstiness_sets_gap_variance(burstiness: float) -> None:
    rate = 10.0
    g = gaps(arrival_offsets(rate, num_requests=N, burstiness=burstiness, seed=2))
    # Gamma(shape k, mean 1/rate): variance 1/(k rate^2); the sample variance has
    # standard error ~ variance * sqrt((2 + 6/k) / n) (excess kurtosis 6/k).
    variance = 1.0 / (burstiness * rate**2)
    stderr = variance * math.sqrt((2 + 6 / burstiness) / len(g))
    assert abs(g.mean() - 1 / rate) < 5 * math.sqrt(variance / len(g))
    assert abs(g.var() - variance) < 5 * stderr


def test_lower_burstiness_means_burstier_arrivals() -> None:
    bursty = gaps(arrival_offsets(5.0, num_requests=N, burstiness=0.2, seed=3)).var()
    poisson = gaps(arrival_offsets(5.0, num_requests=N, burstiness=1.0, seed=3)).var()
    regular = gaps(arrival_offsets(5.0, num_requests=N, burstiness=5.0, seed=3)).var()
    assert bursty > 3 * poisson > 9 * regular


def test_same_seed_same_schedule_other_seed_other_schedule() -> None:
    a = arrival_offsets(3.0, num_requests=500, burstiness=0.5, seed=7)
    assert a == arrival_offsets(3.0, num_requests=500, burstiness=0.5, seed=7)
    assert a != arrival_offsets(3.0, num_requests=500, burstiness=0.5, seed=8)


def test_schedule_starts_at_zero_and_ascends() -> None:
    offsets = arrival_offsets(50.0, num_requests=1000, seed=0)
    assert offsets[0] == 0.0
    assert all(b >= a for a, b in itertools.pairwise(offsets))


def test_infinite_rate_sends_everything_at_once() -> None:
    assert arrival_offsets(math.inf, num_requests=7) == [0.0] * 7


def test_duration_bounds_the_schedule() -> None:
    rate, duration = 200.0, 30.0
    offsets = arrival_offsets(rate, num_requests=None, duration_s=duration, seed=4)
    assert offsets[-1] < duration
    expected = rate * duration  # Poisson count: sd = sqrt(expected)
    assert abs(len(offsets) - expected) < 5 * math.sqrt(expected)
    # Both bounds: whichever comes first.
    assert len(arrival_offsets(rate, num_requests=10, duration_s=duration, seed=4)) == 10
    capped = arrival_offsets(rate, num_requests=10**6, duration_s=1.0, seed=4)
    assert capped[-1] < 1.0 < len(capped)


def test_unbounded_schedules_are_refused() -> None:
    with pytest.raises(ValueError):
        arrival_offsets(1.0, num_requests=None)
    with pytest.raises(ValueError):
        arrival_offsets(math.inf, num_requests=None, duration_s=5.0)


def test_trace_replay_scales_recorded_gaps() -> None:
    stamps = [100.0, 100.5, 102.0, 110.0]
    assert trace_offsets(stamps, time_scale=2.0) == [0.0, 1.0, 4.0, 20.0]
    assert trace_offsets(stamps, time_scale=0.5, duration_s=1.5) == [0.0, 0.25, 1.0]
    assert trace_offsets(stamps, num_requests=2) == [0.0, 0.5]
