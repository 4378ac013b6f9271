"""The planner's decision: a pure function of one window's timings and what came before.

Each window (`Window`) says how the cluster did: TTFT and TPOT p90 at the router, the
mean waits of its two queues (P's prefill queue, D's admission for a room's pages), the
workers of each role and what each did a second. From them, each role's *pressure*:

    prefill  max((TTFT - D's admission wait) / ttft SLO, (P's queue - D's admission) / half the ttft SLO)
    decode   max(TPOT / tpot SLO, D's admission wait / half the ttft SLO)

(P's queue holds a request until D reserved its pages, so D's admission is taken out of
P's share and put on D's.) 1 is a role at its SLO. A role needs `workers x pressure`
workers' worth of capacity; the better split of the P/D workers gives each role its share
of the need (`target_prefill`).

A flip is proposed towards the role under the more pressure, when that one is past its SLO
by more than noise (`short_above`),
the other role keeps at least one worker, the split predicts more workers for it, and the
other role would stay within `donor_limit` of its SLO with one worker fewer (else moving
a worker only moves the violation). It is made once the same proposal held for
`hold_windows` windows in a row, never within `cooldown_windows` after a flip; a window with
fewer than `min_requests` finished requests decides nothing. So noise around the SLO, or
both roles short at once, flips nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

QUEUE_SHARE = 0.5  # a queue wait of half the TTFT SLO counts as its role at the SLO


@dataclass(frozen=True)
class Slo:
    ttft: float  # seconds
    tpot: float


@dataclass(frozen=True)
class Window:
    """What the cluster did over one window (`observe.py` measures it)."""

    seconds: float
    requests: int  # finished at the router
    ttft: float | None  # p90 seconds; None: no request in the window
    tpot: float | None
    prefill_queue: float  # mean seconds a request waited in P's queue
    decode_admission: float  # mean seconds a room waited for D's pages
    prefill_workers: int
    decode_workers: int
    prefill_tokens_per_worker: float  # prompt tokens a second, per prefill worker
    decode_tokens_per_worker: float  # output tokens a second, per decode worker


@dataclass(frozen=True)
class Policy:
    hold_windows: int = 3  # a proposal is made once it held this many windows in a row
    cooldown_windows: int = 5  # no flip within this many windows after one
    min_requests: int = 20  # a window with fewer finished requests decides nothing
    donor_limit: float = 0.9  # the giving role's predicted pressure with one worker fewer
    short_above: float = 1.1  # a role is short past this pressure: noise at the SLO is not


@dataclass(frozen=True)
class State:
    """What the planner remembers between windows."""

    proposal: str = ""  # "prefill" or "decode": the role the last window would grow
    streak: int = 0  # windows in a row with that proposal
    cooldown: int = 0  # windows left before another flip


@dataclass(frozen=True)
class Decision:
    flip_to: str  # "" (hold), or the role one worker of the other role becomes
    reason: str
    prefill_pressure: float
    decode_pressure: float
    target_prefill: int  # prefill workers the measured need asks for (of the P/D workers)
    state: State

    @property
    def flip_from(self) -> str:
        return {"prefill": "decode", "decode": "prefill"}.get(self.flip_to, "")


def pressures(window: Window, slo: Slo) -> tuple[float, float]:
    """(prefill, decode): each role's distance to its SLO, 1 = at it."""
    admission = window.decode_admission
    queue_budget = QUEUE_SHARE * slo.ttft
    prefill = max(
        max(0.0, (window.ttft or 0.0) - admission) / slo.ttft,
        max(0.0, window.prefill_queue - admission) / queue_budget,
    )
    decode = max((window.tpot or 0.0) / slo.tpot, admission / queue_budget)
    return prefill, decode


def target_prefill(window: Window, prefill: float, decode: float) -> int:
    """Prefill workers of the P/D workers that give each role its share of the need."""
    total = window.prefill_workers + window.decode_workers
    need_p, need_d = window.prefill_workers * prefill, window.decode_workers * decode
    if total < 2 or need_p + need_d <= 0:
        return window.prefill_workers
    return min(total - 1, max(1, math.floor(total * need_p / (need_p + need_d) + 0.5)))


def decide(window: Window, slo: Slo, policy: Policy, state: State) -> Decision:
    """The decision for `window`, given the state the previous one left."""
    prefill, decode = pressures(window, slo)
    target = target_prefill(window, prefill, decode)
    cooldown = max(0, state.cooldown - 1)

    def hold(reason: str, proposal: str = "", streak: int = 0) -> Decision:
        kept = State(proposal, streak, cooldown)
        return Decision("", reason, prefill, decode, target, kept)

    if window.requests < policy.min_requests:
        return hold(f"too few requests ({window.requests} < {policy.min_requests})")
    if max(prefill, decode) <= policy.short_above:
        return hold("within the SLO" if max(prefill, decode) <= 1.0 else "near the SLO")
    grow = "prefill" if prefill >= decode else "decode"
    give = "decode" if grow == "prefill" else "prefill"
    givers = window.decode_workers if give == "decode" else window.prefill_workers
    if givers <= 1:
        return hold(f"{grow} is short, but {give} has its last worker")
    if (target > window.prefill_workers) != (grow == "prefill") or target == window.prefill_workers:
        return hold(f"{grow} is short, but the measured need keeps the split")
    left = (decode if give == "decode" else prefill) * givers / (givers - 1)
    if left > policy.donor_limit:
        return hold(f"{grow} is short, but {give} would be at {left:.2f} of its SLO")
    streak = state.streak + 1 if state.proposal == grow else 1
    if streak < policy.hold_windows:
        return hold(f"{grow} is short ({streak}/{policy.hold_windows} windows)", grow, streak)
    if cooldown:
        return hold(f"{grow} is short, cooling down ({cooldown} windows)", grow, streak)
    flipped = State("", 0, policy.cooldown_windows)
    return Decision(grow, f"{grow} is short", prefill, decode, target, flipped)


def after_failed_flip(decision: Decision, policy: Policy) -> Decision:
    """The router refused the flip: cool down as after one, so it is not asked every window."""
    return replace(decision, state=State("", 0, policy.cooldown_windows))


def describe(window: Window, slo: Slo, decision: Decision) -> str:
    """The decision's one log line, with every number it was made from."""
    action = f"flip {decision.flip_from} -> {decision.flip_to}" if decision.flip_to else "hold"

    def ms(seconds: float | None) -> str:
        return "-" if seconds is None else f"{seconds * 1000:.0f}ms"

    s = decision.state
    return (
        f"{action} ({decision.reason}): P:D {window.prefill_workers}:{window.decode_workers} "
        f"-> predicted {decision.target_prefill}:"
        f"{window.prefill_workers + window.decode_workers - decision.target_prefill}; "
        f"{window.requests} requests in {window.seconds:.0f}s; "
        f"TTFT p90 {ms(window.ttft)} (SLO {ms(slo.ttft)}), TPOT p90 {ms(window.tpot)} "
        f"(SLO {ms(slo.tpot)}); P queue {ms(window.prefill_queue)}, D admission "
        f"{ms(window.decode_admission)}; pressure P {decision.prefill_pressure:.2f} "
        f"D {decision.decode_pressure:.2f}; per worker P "
        f"{window.prefill_tokens_per_worker:.0f} prompt tok/s, D "
        f"{window.decode_tokens_per_worker:.0f} output tok/s; streak {s.streak}, "
        f"cooldown {s.cooldown}"
    )
