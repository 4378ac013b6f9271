"""How long a worker's engine steps take: counted by the scheduler, fitted where decided.

A step that computes prompt tokens takes about `a + b * tokens + c * pairs`: `pairs` are
the (query, key) pairs its attention computes, `n * context + n * (n + 1) / 2` for a chunk
of n tokens after `context` earlier ones (a decode row riding along is one token and its
context). Without the attention term, a line fitted on short chunks under-predicts a late
chunk of a long prompt. A step of decode rows only is close to `a + b * rows + c * pairs`,
its pairs its rows' contexts: reading their KV makes a decode step of long contexts slow,
whatever its rows. The scheduler counts both kinds (`StepClock`) and fits them online
(`LinearFit`): a decode worker sizes the prompt chunks it computes itself by its own fit,
and predicts its decode step from its last steps moved along the fit (`decode_role.py`,
`StepClock.decode_step`), planned to the answers it sees (`AnswerLengths`). The worker
reports the cumulative counts in its load (`StepTimes`), with the TPOT slack its running
requests have left; the router fits each worker's lines from the differences between
heartbeats (`services/router/measurements.py`) and predicts with them
(`services/router/placement.py`).
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

__all__ = [
    "AnswerLengths",
    "Line",
    "LinearFit",
    "SlowStep",
    "StepBudget",
    "StepClock",
    "StepTimes",
    "chunk_pairs",
]

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
# A decode step is predicted from the median of this many last decode steps, moved along
# the fit to the rows and contexts asked about (`StepClock.decode_step`).
_RECENT_DECODE_STEPS = 16
# A running request's slack is planned to the answer it likely gives: the lower quartile of
# the lengths of this many last answers (once there are _ANSWERS_NEEDED), within its
# max_new_tokens (`AnswerLengths`).
_ANSWERS_KEPT = 200
_ANSWERS_NEEDED = 8
# Attention pairs enter the fit in millions, so that its sums stay well conditioned.
_PAIRS_UNIT = 1e6
# A step at least this long and this many times what its kind's fit predicts is a stall,
# not load (a kernel compiled for a shape not met before, the host paused): the scheduler
# says so (`StepClock.step_done`). Six local prompts on an idle decode worker took 1 s
# where its fit, right for its other 114, said 0.1-0.2 (2x H200, s35), and nothing said why.
SLOW_STEP_S = 0.5
SLOW_STEP_X = 4.0


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


@dataclass
class StepBudget:
    """What the next step may still compute of prompts, chunk by chunk: at most `tokens`,
    and (with a measured `line`) chunks the line predicts to take at most `seconds` in all.
    A decode worker passes its line's `marginal` and the seconds its slack rule allows on
    top of the decode step its running rows take anyway.

    Where the step replays graphs for padded token counts (`engine/piecewise_graph.py`:
    `padded_sizes`, ascending, beside `rows` decode rows), a granted chunk grows into the
    padding of its size, within `want` and `tokens`: those rows are computed either way."""

    seconds: float = math.inf
    line: Line | None = None
    tokens: float = math.inf
    padded_sizes: Sequence[int] = ()
    rows: int = 0
    _tokens_in: int = 0  # of this step's earlier chunks
    _pairs_in: float = 0.0

    def take(self, want: int, context: int) -> int:
        """Tokens granted to a chunk of at most `want` after `context`; spent from here."""
        most = int(min(want, self.tokens))
        n = most
        if self.line is not None and n > 0:
            fits = self.line.largest_chunk(self.seconds, context, self._tokens_in, self._pairs_in)
            n = min(n, fits)
        n = max(0, n)
        if n > 0:
            n = self._into_padding(n, most)
        self.tokens -= n
        self._tokens_in += n
        self._pairs_in += chunk_pairs(n, context)
        return n

    def _into_padding(self, n: int, most: int) -> int:
        before = self.rows + self._tokens_in
        size = next((s for s in self.padded_sizes if s >= before + n), None)
        return n if size is None else max(n, min(most, size - before))

    @property
    def empty(self) -> bool:
        """Not one more token fits (at the least context)."""
        if self.tokens < 1:
            return True
        return (
            self.line is not None
            and self.line.largest_chunk(self.seconds, 0, self._tokens_in, self._pairs_in) < 1
        )


class AnswerLengths:
    """The output tokens of a worker's last finished answers, and the total a running
    request's TPOT is planned to (`planned_total`).

    A decode worker spends its running requests' TPOT slack on prompt steps of its own,
    planned to the tokens they will still decode. Planned to max_new_tokens, an answer that
    stops long before (a chat client's max_tokens of 4,096 for a 343-token answer) would
    spend slack on tokens that never come, and end past its SLO. Planned to the lower
    quartile of the worker's recent answers that could stop early (those that ran to
    their max_new_tokens count at that length), it stays within it for three answers in
    four. An answer that cannot stop early (no stop token, as with a benchmark's
    `ignore_eos`, and no grammar) is planned to its max_new_tokens, and not counted."""

    def __init__(self) -> None:
        self._lengths: deque[int] = deque(maxlen=_ANSWERS_KEPT)
        self._typical: int | None = None

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(self._lengths)

    @property
    def typical(self) -> int:
        """The length answers that can stop early are planned to; 0 until enough are known."""
        return self._typical or 0

    def add(self, tokens: int) -> None:
        self._lengths.append(tokens)
        if len(self._lengths) >= _ANSWERS_NEEDED:
            ordered = sorted(self._lengths)
            self._typical = ordered[(len(ordered) - 1) // 4]

    def planned_total(
        self, max_new: int, produced: int, min_new: int = 0, can_stop: bool = True
    ) -> int:
        """The output tokens a request `produced` tokens in, allowed `max_new` (and made to
        give `min_new`), is planned to: max_new where it cannot stop before (no stop token:
        `ignore_eos`, no grammar) or until enough answers are known; never fewer than
        produced + 1."""
        total = max_new
        if can_stop and self._typical is not None:
            total = min(max_new, max(min_new, self._typical))
        return max(total, produced + 1)


@dataclass(frozen=True)
class SlowStep:
    """A step that took far longer than its fit predicted (`StepClock.step_done`)."""

    tokens: int  # computed in it (prompt tokens and decode rows)
    rows: int
    seconds: float
    predicted: float


class StepClock:
    """The scheduler's count of its steps: cumulative `times`, and a fit of each kind."""

    def __init__(self) -> None:
        self.times = StepTimes()
        self.prefill = LinearFit()  # seconds vs. tokens and pairs of a step with prompt tokens
        # seconds vs. rows and pairs of a step of decode rows only: reading each row's KV
        # (its context) is most of a decode step of long contexts
        self.decode = LinearFit()
        # the last decode steps as measured, (rows, pairs, seconds): `decode_step`'s anchor
        self._recent: deque[tuple[int, float, float]] = deque(maxlen=_RECENT_DECODE_STEPS)
        self.answers = AnswerLengths()  # (the scheduler's finished answers)
        self._last_end = 0.0  # time.perf_counter() when the last step's results came

    def step_done(
        self, tokens: int, rows: int, launched: float, pairs: float = 0.0
    ) -> SlowStep | None:
        """A step's results came now. It took from its launch (`time.perf_counter()`), or from
        the previous step's end when it waited behind that one (the overlap loop launches a
        step while the one before runs). The step, when it was a stall (`SLOW_STEP_S`,
        `SLOW_STEP_X` times its fit's prediction), else None."""
        done = time.perf_counter()
        seconds = done - max(launched, self._last_end)
        # (the fit asked only of a long step, and before this step joins it)
        predicted = self._predicted(tokens, rows, pairs) if seconds >= SLOW_STEP_S else None
        self.record(tokens, rows, seconds, pairs)
        self._last_end = done
        if predicted is None or seconds < SLOW_STEP_X * predicted:
            return None
        return SlowStep(tokens, rows, seconds, predicted)

    def _predicted(self, tokens: int, rows: int, pairs: float) -> float | None:
        """Seconds the step's kind's fit predicts for it; None before it has one."""
        if tokens > rows:
            return self.prefill.predict(tokens, pairs) if self.prefill.ready else None
        if rows and self.decode.ready:
            return self.decode_step(rows, pairs)
        return None

    def report(self) -> StepTimes:
        """A copy of `times` to report, with the prompt-step line as fitted here."""
        if not self.prefill.ready:
            return msgspec.structs.replace(self.times)
        line = self.prefill.line()
        return msgspec.structs.replace(
            self.times,
            prefill_intercept=line.intercept,
            prefill_slope=line.slope,
            prefill_attention=line.attention,
        )

    def record(self, tokens: int, rows: int, seconds: float, pairs: float = 0.0) -> None:
        t = self.times
        if tokens > rows:  # some row computed more than one token: a prompt's chunk
            t.prefill_steps += 1
            t.prefill_tokens += tokens
            t.prefill_seconds += seconds
            t.prefill_pairs += pairs
            self.prefill.add(tokens, seconds, pairs=pairs)
        elif rows:
            t.decode_steps += 1
            t.decode_rows += rows
            t.decode_seconds += seconds
            t.decode_pairs += pairs
            self.decode.add(rows, seconds, pairs=pairs)
            self._recent.append((rows, pairs, seconds))

    def decode_step(self, rows: int, pairs: float) -> float:
        """Seconds of the next decode step of `rows` rows over contexts of `pairs` in all; 0
        before any decode step.

        The median of the last decode steps, moved along the fit from their median rows
        and contexts to these. The fit alone is a mean over ~200 steps, which one step
        measured long (its scheduler thread paused with the step in flight: a collection,
        a long piece of Python, a first launch) holds high for a hundred steps: where a
        decode worker's slack is a millisecond a step, a prediction 30% high leaves it no
        prompt token at all (an H200 at 128 rows, after one 2 s pause: 16.4 ms predicted
        for 12.4 ms steps)."""
        if not self.decode.ready:
            return 0.0
        line = self.decode.line()
        if not self._recent:  # (a fit given its samples directly)
            return line.at(rows, pairs)
        anchor_rows = statistics.median(r for r, _, _ in self._recent)
        anchor_pairs = statistics.median(p for _, p, _ in self._recent)
        seconds = statistics.median(s for _, _, s in self._recent)
        return max(0.0, seconds + line.at(rows, pairs) - line.at(anchor_rows, anchor_pairs))
