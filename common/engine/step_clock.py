"""The scheduler's side of its step times (the model of a step's time is
`common/step_times.py`): its clock, which counts and fits each step as its results come and
says when one stalled (`StepClock`, `SlowStep`); what the next step may still compute of
prompts (`StepBudget`); and the lengths of the answers a decode worker plans its running
requests' TPOT slack to (`AnswerLengths`)."""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from baton.common.step_times import Line, LinearFit, StepTimes, chunk_pairs

__all__ = ["AnswerLengths", "SlowStep", "StepBudget", "StepClock"]

# A decode step is predicted from the median of this many last decode steps, moved along
# the fit to the rows and contexts asked about (`StepClock.decode_step`).
_RECENT_DECODE_STEPS = 16
# A running request's slack is planned to the answer it likely gives: the lower quartile of
# the lengths of this many last answers (once there are _ANSWERS_NEEDED), within its
# max_new_tokens (`AnswerLengths`).
_ANSWERS_KEPT = 200
_ANSWERS_NEEDED = 8
# A step at least this long and this many times what its kind's fit predicts is a stall,
# not load (a kernel compiled for a shape not met before, the host paused): the scheduler
# says so (`StepClock.step_done`). Six local prompts on an idle decode worker took 1 s
# where its fit, right for its other 114, said 0.1-0.2 (2x H200, s35), and nothing said why.
SLOW_STEP_S = 0.5
SLOW_STEP_X = 4.0


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
