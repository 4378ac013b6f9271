"""The slack rule: how much of a prompt a decode worker computes beside its running
requests.

A decode worker's local prefill (the router's `local` placement): a request without a
room or a peer is computed there, as the aggregated worker computes it (its cached prefix
reused), then decodes there; while it computes, no room is reserved. The running requests
decode in the same steps, so a prompt step stalls their streams. The TPOT they are held to is a mean,
(last token - first token) / (tokens - 1), so the bound is on slack, not on each step
(`DecodeRole.prefill_budget`, `tpot_slack`): a step may take X seconds when every running request's
projected mean TPOT,

    (its decode seconds so far + X + (tokens still to come - 1) x the decode step)
        / (tokens planned - 1),

stays within `SLACK_MARGIN` x `tpot_slo` (tokens planned: max_new_tokens, or fewer where
this worker's answers stop earlier, the lower quartile of its last 200: `AnswerLengths`),
and X is never more than `MAX_STALL_SLOS` x `tpot_slo` (one step must not freeze the
streams for seconds, whatever the slack). The chunk is the most prompt tokens whose cost
on top of the decode step (the measured step line's `marginal`: tokens and attention
pairs, so a late chunk of a long prompt is sized for its context) fits in X less the
decode step, grown into the padding of the step's piecewise-graph size (`StepBudget`);
with no slack, no prompt token. The decode step is predicted for the running rows and
those whose KV is on its way (rooms in transfer: they join within a transfer and decode
beside the others to their end), at their contexts (`StepClock.decode_step`: the median of the last decode steps, moved along the
fit, which counts each row's KV reads), so slack is not seen where long contexts already
spend it, nor lost for a hundred steps after one stalled step. The least slack is
reported to the router (`StepTimes.decode_slack`), whose cost model predicts the same
steps (`services/router/placement.py`).

The router predicts from reports up to a second old. A local prompt that the slack rule
has not let start within the request's `start_within` (a share of the TTFT SLO, set by
the router) is handed back: ended unstarted, finish reason `handed_back`, nothing of it
computed or held, and the router places it again, not local on this worker. Waiting on,
it might wait seconds for slack (the least-slack request's, until it ends).

Once started, a local prompt is not left waiting past its TTFT SLO (the router's
`start_within` is a quarter of it): from then on it gets at least `PROBE_TOKENS` a step
whatever the slack (`LatePrompts`). Its first token is late already; without the floor it
waited for the least-slack request to end while holding its pages (one took 36 s on the
Mooncake trace at x8 on 2x H200, session 37); 64 tokens add about 2 ms to an 8B model's
step on an H200.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from baton.common.engine.step_clock import AnswerLengths
from baton.common.state import Req

# Prompt tokens per step while running requests decode and no prompt step was measured yet:
# small steps, from which the step-time fit learns.
PROBE_TOKENS = 64


def tpot_slack(
    req: Req, now: float, decode_step: float, slo: float, answers: AnswerLengths
) -> float:
    """Seconds of stall `req`'s mean TPOT can absorb and still end within `slo`, if each of
    its tokens still to come takes `decode_step` (planned to the answer it likely gives,
    `AnswerLengths.planned_total`)."""
    first = req.times.get("first_token")
    produced = len(req.output_ids) + req.in_flight
    total = produced + tokens_to_come(req, answers)
    if first is None or total <= 1:
        return math.inf
    return slo * (total - 1) - (now - first) - (total - produced) * decode_step


def tokens_to_come(req: Req, answers: AnswerLengths) -> int:
    s = req.sampling
    before = s.output_offset  # (resumed here: the answer's tokens made elsewhere)
    produced = before + len(req.output_ids) + req.in_flight
    total = answers.planned_total(
        before + s.max_new_tokens, produced, before + s.min_new_tokens, req.can_stop
    )
    return total - produced


@dataclass
class SlackPlan:
    """What the slack rule saw at its latest step (the worker's metrics show it)."""

    decode_step: float = 0.0
    least_slack: float = 0.0
    answer_tokens: int = 0


class LatePrompts:
    """The local prompts placed with a `start_within`: one not started within it is
    handed back (`DecodeRole._hand_back`), and one started and past its TTFT SLO is late:
    the slack rule lets it go on whatever the slack."""

    SLO_PER_START_WITHIN = 4  # the router's start_within: a quarter of the TTFT SLO

    def __init__(self) -> None:
        self.start_by: dict[str, float] = {}  # rid -> time.monotonic() it must start by
        self._due: dict[str, float] = {}  # rid -> time.monotonic() of its TTFT SLO
        self._started: dict[str, Req] = {}

    def placed(self, rid: str, received: float, start_within: float) -> None:
        self.start_by[rid] = received + start_within
        self._due[rid] = received + self.SLO_PER_START_WITHIN * start_within

    def computed(self, req: Req, last: bool) -> None:
        """A chunk of `req`'s prompt was computed (`last`: its whole prompt)."""
        if last:
            self.forget(req.rid)
        elif req.rid in self._due:
            self._started[req.rid] = req

    def windows_passed(self, now: float) -> list[str]:
        """The prompts whose `start_within` passed by `now`: watched on only if they
        started (the others are handed back, or ended)."""
        passed = [rid for rid, deadline in self.start_by.items() if now >= deadline]
        for rid in passed:
            del self.start_by[rid]
            if rid not in self._started:
                self._due.pop(rid, None)
        return passed

    def forget(self, rid: str) -> None:
        self.start_by.pop(rid, None)
        self._due.pop(rid, None)
        self._started.pop(rid, None)

    def __len__(self) -> int:
        """Prompts watched: within their start window, or started and not complete."""
        return len(self._due)

    def late_context(self, now: float) -> int | None:
        """The context (tokens with KV) of a started prompt past its TTFT SLO; None when no
        started prompt is late."""
        for rid, req in list(self._started.items()):
            if req.finished:  # (aborted, failed)
                self.forget(rid)
            elif now >= self._due[rid]:
                return req.device_len
        return None
