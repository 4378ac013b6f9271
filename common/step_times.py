"""How long a worker's engine steps take: counted by the scheduler, fitted where decided.

A step that computes prompt tokens takes about `a + b * tokens + c * pairs`: `pairs` are
the (query, key) pairs its attention computes, `n * context + n * (n + 1) / 2` for a chunk
of n tokens after `context` earlier ones (a decode row riding along is one token and its
context). Without the attention term, a line fitted on short chunks under-predicts a late
chunk of a long prompt. A step of decode rows only is close to `a + b * rows + c * pairs`,
its pairs its rows' contexts: reading their KV makes a decode step of long contexts slow,
whatever its rows. The scheduler counts both kinds and fits them online (`LinearFit`, in
its `StepClock`, `common/engine/step_clock.py`): a decode worker sizes the prompt chunks it
computes itself by its own fit, and predicts its decode step from its last steps moved
along the fit (`decode_role.py`), planned to the answers it sees. The worker reports the cumulative counts in its load (`StepTimes`), with the TPOT slack its running
requests have left; the router fits each worker's lines from the differences between
heartbeats (`services/router/measurements.py`) and predicts with them
(`services/router/placement.py`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

__all__ = ["Line", "LinearFit", "StepTimes", "chunk_pairs"]

# A fit forgets old samples at this rate per sample (a worker's speed changes with its
# context lengths and its neighbours on the device); about the last 200 steps count.
_DECAY = 0.995
# The slack rule of a decode worker's own prompt steps (`common/disagg/decode_role.py`),
# which the router's cost model predicts (`services/router/placement.py`): it plans up to
# this share of the TPOT SLO (the rest absorbs the error of the step line, and answers that
# stop before max_new_tokens) ...
SLACK_MARGIN = 0.9
# ... and no step beside running requests takes more than this many TPOT SLOs: 10 x 20 ms
# = 0.2 s, a pause a reader of a stream hardly notices, and room for ~2-4k prompt tokens
# of an 8B model on one H100.
MAX_STALL_SLOS = 10.0
# Attention pairs enter the fit in millions, so that its sums stay well conditioned.
_PAIRS_UNIT = 1e6


def chunk_pairs(tokens: float, context: float) -> float:
    """(query, key) pairs of causal attention for `tokens` new tokens after `context`."""
    return tokens * context + tokens * (tokens + 1) / 2


@dataclass(frozen=True)
class Line:
    """A step's seconds: `intercept + slope * size + attention * pairs` (size: tokens of a
    prompt step, or rows of a decode step; pairs: see `chunk_pairs`)."""

    intercept: float
    slope: float
    attention: float = 0.0  # seconds per (query, key) pair

    def at(self, size: float, pairs: float = 0.0) -> float:
        return self.intercept + self.slope * size + self.attention * pairs

    def chunk(self, tokens: float, context: float, rows: int = 0, row_pairs: float = 0.0) -> float:
        """Seconds of a step computing `tokens` prompt tokens after `context`, beside `rows`
        decode rows whose attention spans `row_pairs` pairs."""
        return self.at(tokens + rows, chunk_pairs(tokens, context) + row_pairs)

    def largest_chunk(
        self, seconds: float, context: float, rows: int = 0, row_pairs: float = 0.0
    ) -> int:
        """The most prompt tokens after `context` that a step (beside `rows` decode rows)
        computes within `seconds`; 0 when none fits."""
        left = seconds - self.at(rows, row_pairs)
        if left <= 0:
            return 0
        # attention/2 n^2 + (slope + attention (context + 1/2)) n <= left
        quad, lin = self.attention / 2, self.slope + self.attention * (context + 0.5)
        if quad <= 0:
            n = math.inf if lin <= 0 else left / lin
        else:
            n = (-lin + math.sqrt(lin * lin + 4 * quad * left)) / (2 * quad)
        return n if math.isinf(n) else int(n * (1 + 1e-12))  # type: ignore[return-value]

    @property
    def marginal(self) -> Line:
        """What computing a chunk adds to a step that runs anyway (no intercept)."""
        return Line(0.0, self.slope, self.attention)

    @staticmethod
    def mean(lines: Sequence[Line]) -> Line | None:
        if not lines:
            return None
        n = len(lines)
        return Line(
            sum(x.intercept for x in lines) / n,
            sum(x.slope for x in lines) / n,
            sum(x.attention for x in lines) / n,
        )


class StepTimes(msgspec.Struct):
    """Cumulative counts of a worker's steps (pb.StepTimes on the wire)."""

    prefill_steps: float = 0.0  # steps that computed prompt tokens
    prefill_tokens: float = 0.0  # every token of those steps, decode rows included
    prefill_seconds: float = 0.0
    decode_steps: float = 0.0  # steps of decode rows only
    decode_rows: float = 0.0
    decode_seconds: float = 0.0
    prefill_pairs: float = 0.0  # attention pairs of the prompt steps (`chunk_pairs`)
    decode_pairs: float = 0.0  # attention pairs of the decode steps: their rows' contexts
    # Not cumulative: seconds of stall the running requests' mean TPOT can still absorb
    # (the least of them, as of the last step a decode worker planned; 0: none running).
    decode_slack: float = 0.0
    # Not cumulative: tokens still to come of the request whose slack that is (the router
    # takes as much again from it for each second its steps grow past the planned step).
    slack_tokens: float = 0.0
    # Not cumulative: the worker's own fit of its prompt steps, step by step (`Line`; 0s
    # before it has one): what a decode worker sizes its own chunks by, so what the router
    # predicts them by. The router's fit of report-interval means loses the spread of step
    # sizes it needs to tell a token's cost from a step's (2x H200, s33: a local prompt's
    # chunk of 1,331 tokens predicted at ~5 ms beside the decode step, for ~30 ms).
    prefill_intercept: float = 0.0
    prefill_slope: float = 0.0
    prefill_attention: float = 0.0


@dataclass
class LinearFit:
    """Weighted least squares of `seconds = a + b * size + c * pairs`, forgetting old
    samples geometrically. Without samples that tell pairs from size (decode steps, or
    prompt chunks all at one context), `c` is 0; until two different sizes are seen, the
    line goes through the origin and the one mean point (proportional to its size)."""

    n: float = 0.0
    sx: float = 0.0
    sp: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxp: float = 0.0
    spp: float = 0.0
    sxy: float = 0.0
    spy: float = 0.0
    decay: float = _DECAY

    def add(self, size: float, seconds: float, weight: float = 1.0, pairs: float = 0.0) -> None:
        d, p = self.decay, pairs / _PAIRS_UNIT
        self.n = self.n * d + weight
        self.sx = self.sx * d + weight * size
        self.sp = self.sp * d + weight * p
        self.sy = self.sy * d + weight * seconds
        self.sxx = self.sxx * d + weight * size * size
        self.sxp = self.sxp * d + weight * size * p
        self.spp = self.spp * d + weight * p * p
        self.sxy = self.sxy * d + weight * size * seconds
        self.spy = self.spy * d + weight * p * seconds

    @property
    def ready(self) -> bool:
        return self.n > 0 and self.sx > 0

    def line(self) -> Line:
        """The fitted line, every coefficient >= 0; Line(0, 0) before any sample."""
        if not self.ready:
            return Line(0.0, 0.0)
        with_pairs = self._with_pairs()
        if with_pairs is not None:
            return with_pairs
        det = self.n * self.sxx - self.sx * self.sx
        if det > 1e-9 * self.n * self.sxx:
            slope = (self.n * self.sxy - self.sx * self.sy) / det
            intercept = (self.sy - slope * self.sx) / self.n
            if slope >= 0 and intercept >= 0:
                return Line(intercept, slope)
        # One size only, or a line that would predict negative times: proportional.
        return Line(0.0, self.sy / self.sx)

    def _with_pairs(self) -> Line | None:
        """The three-term fit, where the samples determine it and it is non-negative."""
        m = (
            (self.n, self.sx, self.sp),
            (self.sx, self.sxx, self.sxp),
            (self.sp, self.sxp, self.spp),
        )
        rhs = (self.sy, self.sxy, self.spy)
        det = _det3(m)
        if self.spp <= 0 or det <= 1e-9 * self.n * self.sxx * self.spp:
            return None
        a, b, c = (_det3(_with_column(m, i, rhs)) / det for i in range(3))
        if min(a, b, c) < 0:
            return None
        return Line(a, b, c / _PAIRS_UNIT)

    def predict(self, size: float, pairs: float = 0.0) -> float:
        return self.line().at(size, pairs)


def _det3(m: Sequence[Sequence[float]]) -> float:
    return (
        m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1])
        - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
        + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0])
    )


def _with_column(
    m: Sequence[Sequence[float]], i: int, column: Sequence[float]
) -> tuple[tuple[float, ...], ...]:
    return tuple(
        tuple(column[r] if j == i else row[j] for j in range(3)) for r, row in enumerate(m)
    )
