"""How long a worker's engine steps take: counted by the scheduler, fitted where decided.

A step's time is close to a line in its size: `a + b * tokens` for a step that computes
prompt tokens (decode rows riding along count as tokens), `a + b * rows` for a step of
decode rows only. The scheduler counts both kinds (`StepClock`) and fits them online: a
decode worker bounds the prompt tokens it computes itself by its own fit, so that its
decode steps stay under the TPOT SLO. The worker reports the cumulative counts in its
load (`StepTimes`); the router fits each worker's line from the differences between
heartbeats (`services/router/placement.py`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import msgspec

__all__ = ["LinearFit", "StepClock", "StepTimes"]

# A fit forgets old samples at this rate per sample (a worker's speed changes with its
# context lengths and its neighbours on the device); about the last 200 steps count.
_DECAY = 0.995


class StepTimes(msgspec.Struct):
    """Cumulative counts of a worker's steps (pb.StepTimes on the wire)."""

    prefill_steps: float = 0.0  # steps that computed prompt tokens
    prefill_tokens: float = 0.0  # every token of those steps, decode rows included
    prefill_seconds: float = 0.0
    decode_steps: float = 0.0  # steps of decode rows only
    decode_rows: float = 0.0
    decode_seconds: float = 0.0


@dataclass
class LinearFit:
    """Weighted least squares of `seconds = intercept + slope * size`, forgetting old
    samples geometrically. Until two different sizes are seen, the line goes through the
    origin and the one mean point (a step is then predicted proportional to its size)."""

    n: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0
    decay: float = _DECAY

    def add(self, size: float, seconds: float, weight: float = 1.0) -> None:
        d = self.decay
        self.n = self.n * d + weight
        self.sx = self.sx * d + weight * size
        self.sy = self.sy * d + weight * seconds
        self.sxx = self.sxx * d + weight * size * size
        self.sxy = self.sxy * d + weight * size * seconds

    @property
    def ready(self) -> bool:
        return self.n > 0 and self.sx > 0

    def coefficients(self) -> tuple[float, float]:
        """(intercept, slope), both >= 0; (0, 0) before any sample."""
        if not self.ready:
            return 0.0, 0.0
        det = self.n * self.sxx - self.sx * self.sx
        if det > 1e-9 * self.n * self.sxx:
            slope = (self.n * self.sxy - self.sx * self.sy) / det
            intercept = (self.sy - slope * self.sx) / self.n
            if slope >= 0 and intercept >= 0:
                return intercept, slope
        # One size only, or a line that would predict negative times: proportional.
        return 0.0, self.sy / self.sx

    def predict(self, size: float) -> float:
        intercept, slope = self.coefficients()
        return intercept + slope * size

    def largest_within(self, seconds: float) -> float:
        """The largest size predicted to take at most `seconds` (0 when none does)."""
        intercept, slope = self.coefficients()
        if slope <= 0:
            return float("inf") if intercept <= seconds else 0.0
        return max(0.0, (seconds - intercept) / slope)


class StepClock:
    """The scheduler's count of its steps: cumulative `times`, and a fit of each kind."""

    def __init__(self) -> None:
        self.times = StepTimes()
        self.prefill = LinearFit()  # seconds vs. tokens of a step with prompt tokens
        self.decode = LinearFit()  # seconds vs. rows of a step of decode rows only
        self._last_end = 0.0  # time.perf_counter() when the last step's results came

    def step_done(self, tokens: int, rows: int, launched: float) -> None:
        """A step's results came now. It took from its launch (`time.perf_counter()`), or from
        the previous step's end when it waited behind that one (the overlap loop launches a
        step while the one before runs)."""
        done = time.perf_counter()
        self.record(tokens, rows, done - max(launched, self._last_end))
        self._last_end = done

    def record(self, tokens: int, rows: int, seconds: float) -> None:
        t = self.times
        if tokens > rows:  # some row computed more than one token: a prompt's chunk
            t.prefill_steps += 1
            t.prefill_tokens += tokens
            t.prefill_seconds += seconds
            self.prefill.add(tokens, seconds)
        elif rows:
            t.decode_steps += 1
            t.decode_rows += rows
            t.decode_seconds += seconds
            self.decode.add(rows, seconds)
