"""Placement: where a request's prompt is computed, and how its KV reaches its decode worker.

Three kinds, for a prompt of L tokens of which D's cache holds c:

    local          D computes the L - c uncached tokens itself, chunked into its decode
                   steps (no P, no transfer), then decodes
    disagg-delta   P computes the prompt; only the pages D lacks travel (c > 0)
    disagg-full    P computes the prompt; every page travels (D holds none of it)

`--placement` picks the rule:

- `always-disagg`: P and D by the routing policies; delta when D is predicted to hold a
  prefix, else full. Never local.
- `threshold`: the rule of conditional disaggregation elsewhere: on the D holding the most
  of the prompt, local when its uncached part is under 2,048 tokens and under 70% of the
  prompt; else as `always-disagg`.
- `cost`: every local option (each D) and every compatible (P, D) pair is costed from the
  cluster's own measurements (`Cluster`: each worker's step-time lines, its prompt steps'
  as the worker fits them where it reports that line (a decode worker sizes its own
  chunks by it); queues, predicted cache hits, its TPOT slack, the transfer rate); the
  cheapest wins. Its cost, in seconds:

      TTFT (queue + prefill)  +  delay to the second token (a transfer that outlasts P's
      prefill, then D's decode step with this request in it)  +  delay added to other
      requests (local prefill stalls those decoding on D, weighted by the share of their
      TPOT slack it spends; a transfer keeps the link busy; its row lengthens each of
      D's steps)  +  a penalty of 10 x the TTFT SLO when the TTFT is predicted past it

  The decode terms are what tell two D's apart when P computes the prompt: the busier D
  costs more (`join_cost`).

  The cheapest option wins, even one predicted past the TTFT SLO: that miss costs one
  request, and the penalty prices it; a local prompt that spends most of a full batch's
  TPOT slack risks every stream in it (1P1D@cost on 2x H200, session 35: five prompts
  placed local because P's queue would have answered them a little past the SLO, each
  costing its D's streams 30 s in all by the model's own reckoning, drove those streams'
  TPOT p90 from 10 to 15 ms and goodput from 26.9 to 19.3 req/s). A step
  line has an attention term (`step_times.Line`): a chunk of a long prompt costs more the
  later it comes. A decode worker computes a prompt beside running requests in steps its
  running requests' TPOT slack allows (it enforces this itself: `decode_role.py`, the
  slack rule; each step at most `MAX_STALL_SLOS` TPOT SLOs); the model predicts the same
  steps from the slack D reported, and rules local out when the slack runs out before the
  prompt is done (the decoders' TPOT would miss). Before a worker's lines are measured,
  the mean of its role's measured lines stands in; with none measured at all, `cost`
  places as `always-disagg` ("no step times measured yet"). The local prompts placed on
  a D and not yet answered (`WorkerState.owed`, the router's own count: D's reports lag
  a second, in which prompts arrive by the dozen) come before a new one and spend D's
  slack first, so a burst of prompts is not all placed on one D's slack.

  P's queue is the prompts placed on it and not yet answered (`WorkerState.owed_prompts`,
  the same count), each costed by P's line: a long prompt behind a short one waits for
  the short one. Counted as P's queued requests times the new prompt's own prefill (as
  before, and still where the router owes P nothing: after a restart), a 22k-token
  prompt behind two short ones was predicted past the TTFT SLO and placed local, spending
  seconds of D's streams by the model's own reckoning (Mooncake x8 on 2x H200, session 38).

  D's decode step is the one it takes *now* (`decode_step_now`): its line at its rows and
  their contexts (reading their KV is most of a decode step of long contexts), plus what
  its latest measured steps took beyond the line. A mixed step is that decode step
  plus the chunk's cost on top (`Line.marginal`). Local is ruled out when D's decode step,
  with this prompt decoding beside the rest, leaves no TPOT room (`SLACK_MARGIN` x the
  SLO): D's decoders are at the SLO's pace already, and no slack their mean holds now
  survives that. Each token still to come of D's least-slack request (`slack_tokens`)
  costs the slack D reported the difference between the step once this prompt decodes
  too and the step the router's line predicts. D plans with its last steps (the median
  of 16, moved along its own line: `StepClock.decode_step`), so where those lag the
  router's line the lag is counted twice: kept so, on the safe side, since near the SLO
  local prompts slowed D's decoders (4x H200, session 23) and no GPU run has measured the
  rule since. While D computes a chunk, requests
  waiting to join it (transfers landing, rooms to reserve: its queue) wait through the
  longer step: that delay counts as a delay to others.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from baton.common.step_times import MAX_STALL_SLOS, SLACK_MARGIN, Line

PLACEMENT_NAMES = ("always-disagg", "threshold", "cost")
LOCAL, DELTA, FULL = "local", "disagg-delta", "disagg-full"
KINDS = (LOCAL, DELTA, FULL)

# The threshold rule (conditional disaggregation's defaults elsewhere).
THRESHOLD_TOKENS = 2048
THRESHOLD_FRACTION = 0.7
# A placement predicted past the TTFT SLO costs this many SLOs more.
SLO_MISS_PENALTY = 10.0
# A local prompt that D has not started within this share of the TTFT SLO is handed back
# (`decode_role.py`) and placed again, not local on that D: the rest of the SLO is P's.
START_WITHIN_SHARE = 0.25
# Local prefill predicted to take longer than this is ruled out (and the model stops
# counting its steps).
_LOCAL_HORIZON = 60.0


@dataclass(frozen=True)
class WorkerState:
    """One worker as the model sees it for one prompt."""

    worker_id: str
    cached: int = 0  # tokens of this prompt predicted in its cache (0 without a cache)
    running: int = 0  # requests decoding on it
    queued: int = 0  # requests waiting for it (its queues, and the router's not yet there)
    prefill: Line | None = None  # seconds of a step vs. its tokens and pairs; None: unmeasured
    decode: Line | None = None  # seconds of a decode step vs. its rows
    slack: float = 0.0  # seconds of stall its running requests' TPOT absorbs (the least)
    slack_tokens: float = 0.0  # tokens still to come of the request whose slack that is
    step: float = 0.0  # seconds of its latest decode steps (measured); 0: not measured
    step_rows: float = 0.0  # rows of those steps
    context: float = 0.0  # their rows' contexts, summed
    # prompt tokens of each request whose prompt it computes (P's; D's local ones), their
    # first token not yet back: the router's own count, ahead of the worker's reports
    owed_prompts: tuple[int, ...] = ()

    @property
    def owed(self) -> int:
        return sum(self.owed_prompts)


@dataclass(frozen=True)
class Cluster:
    """What the cost model knows: a plain value, so tests can fix it."""

    prefills: tuple[WorkerState, ...]
    decodes: tuple[WorkerState, ...]
    pairs: frozenset[tuple[str, str]]  # (P, D) that can hand KV over
    kv_bytes_per_token: float
    transfer_rate: float | None = None  # bytes/s of completed transfers; None: unmeasured


@dataclass(frozen=True)
class Slo:
    ttft: float = 2.0
    tpot: float = 0.02

    @property
    def start_within(self) -> float:
        """Seconds a decode worker has to start a prompt placed local on it."""
        return START_WITHIN_SHARE * self.ttft


@dataclass(frozen=True)
class Placement:
    kind: str  # one of KINDS
    decode: str  # worker id
    prefill: str | None  # worker id; None for local
    reason: str
    computes: int = 0  # the prompt tokens its P (local: its D) is predicted to compute
    start_within: float = 0.0  # local: seconds D has to start it, else it hands it back
    predicted_ttft: float = 0.0  # the cost rule's TTFT of the option (s); 0: not predicted


@dataclass(frozen=True)
class Estimate:
    """Predicted seconds of one option."""

    ttft: float
    second_token_delay: float = 0.0
    delay_to_others: float = 0.0

    def misses(self, slo: Slo) -> bool:
        return self.ttft > slo.ttft

    def cost(self, slo: Slo) -> float:
        miss = SLO_MISS_PENALTY * slo.ttft if self.misses(slo) else 0.0
        return self.ttft + self.second_token_delay + self.delay_to_others + miss


def disagg_kind(decode: WorkerState) -> str:
    return DELTA if decode.cached > 0 else FULL


def threshold_says_local(prompt_len: int, decode: WorkerState) -> bool:
    uncached = prompt_len - decode.cached
    return uncached < THRESHOLD_TOKENS and uncached < THRESHOLD_FRACTION * prompt_len


def local_estimate(prompt_len: int, d: WorkerState, slo: Slo) -> Estimate | None:
    """D computes the uncached suffix after its cached prefix, in the steps its slack rule
    allows beside its running requests (`decode_role.prefill_budget`): each its decode
    step plus a chunk that spends at most the slack left, and at most `MAX_STALL_SLOS`
    SLOs in all. The local prompts placed on D before it and not yet answered (`owed`)
    come first and spend the slack first. None when the slack (less what D's decode step
    now costs it) is spent before the prompt is done (the running requests' TPOT would
    miss), or D's decode step, with this prompt's row, reaches `SLACK_MARGIN` of the TPOT
    SLO."""
    if d.prefill is None:
        return None
    uncached = max(1, prompt_len - d.cached)
    own_step, others = join_cost(prompt_len, d)
    if d.running == 0:
        ahead = d.prefill.chunk(d.owed, 0) if d.owed else 0.0
        return Estimate(
            ttft=ahead + d.prefill.chunk(uncached, d.cached),
            second_token_delay=own_step,
            delay_to_others=others,
        )
    decode_step, planned = decode_step_now(d)
    joined = decode_step + _row(prompt_len, d)  # once this prompt decodes beside them
    if joined >= SLACK_MARGIN * slo.tpot:
        return None  # D's decoders are at the SLO's pace already
    slack = d.slack - d.slack_tokens * (joined - planned)
    chunk = d.prefill.marginal  # a chunk's seconds on top of the decode step
    ceiling = MAX_STALL_SLOS * slo.tpot - decode_step
    seconds, stalled, steps = 0.0, 0.0, 0  # stalled: slack spent by each running request
    for tokens, cached, ours in ((d.owed, 0, False), (uncached, d.cached, True)):
        computed = 0
        while computed < tokens:
            spend = min(ceiling, slack)
            if spend <= 0 or seconds > _LOCAL_HORIZON:
                return None  # the slack is spent before the prompt is done
            context = cached + computed
            n = min(tokens - computed, chunk.largest_chunk(spend, context))
            if n <= 0:
                return None
            extra = chunk.chunk(n, context)
            computed, seconds, slack = computed + n, seconds + decode_step + extra, slack - extra
            if ours:
                stalled, steps = stalled + extra, steps + 1
    # Each running request loses `stalled` seconds of its stream, which costs it only
    # through its TPOT SLO: weighted by the share of its slack spent, a short stall beside
    # plenty of slack is nearly free and one that spends it all counts in full.
    spent = min(1.0, stalled / (slack + stalled)) if stalled > 0 else 0.0
    # Each request waiting to join D waits through (about) one of its longer steps.
    admissions = d.queued * stalled / steps
    return Estimate(
        ttft=seconds,
        second_token_delay=own_step,
        delay_to_others=stalled * d.running * spent + admissions + others,
    )


def join_cost(prompt_len: int, d: WorkerState) -> tuple[float, float]:
    """What this request's decoding costs on D, whoever computes its prompt: its own step
    there (D's step now, with the requests headed for D and not yet in its batch, its
    `queued`, and this one decoding too) and the delay its row adds to one step of each
    of D's other requests, summed. Without it every D looked alike to a prompt computed
    on P, and all of them went to the first D (2P2D, 4x H200, session 34: 1,003 requests
    on one D, 19 on the other, TPOT 15 ms where always-disagg's was 7)."""
    if d.decode is None:
        return 0.0, 0.0
    step, _ = decode_step_now(d)
    row = _row(prompt_len, d)
    return step + (d.queued + 1) * row, (d.running + d.queued) * row


def _row(prompt_len: int, d: WorkerState) -> float:
    """A decode step's seconds for one more row of this prompt's context on D."""
    if d.decode is None:
        return 0.0
    return d.decode.slope + d.decode.attention * prompt_len


def decode_step_now(d: WorkerState) -> tuple[float, float]:
    """D's decode step at its running rows now, and the step its line predicts there
    (what the reported slack is charged against): the line at its rows and their contexts
    (each row's as in its latest measured steps), plus what those steps took beyond the
    line's prediction (a line fitted over smaller batches, shorter contexts or quieter
    neighbours lags)."""
    if d.decode is None:
        return d.step, d.step
    if d.step_rows <= 0:
        planned = d.decode.at(d.running)
        return planned, planned
    planned = d.decode.at(d.running, d.context / d.step_rows * d.running)
    lag = d.step - d.decode.at(d.step_rows, d.context)
    return planned + max(0.0, lag), planned


def disagg_estimate(
    prompt_len: int, p: WorkerState, d: WorkerState, cluster: Cluster
) -> Estimate | None:
    """P computes what its cache lacks; the pages D lacks travel while it does."""
    if p.prefill is None:
        return None
    prefill = p.prefill.chunk(max(1, prompt_len - p.cached), p.cached)
    if p.owed_prompts:
        wait = sum(p.prefill.chunk(n, 0) for n in p.owed_prompts)
    else:
        wait = p.queued * prefill  # (requests this router did not place: sizes unknown)
    transfer = 0.0
    if cluster.transfer_rate:
        transfer = (prompt_len - d.cached) * cluster.kv_bytes_per_token / cluster.transfer_rate
    # Pages travel as P computes them: only what outlasts the prefill delays token two;
    # all of it keeps the link busy, which later transfers wait for.
    own_step, others = join_cost(prompt_len, d)
    return Estimate(
        ttft=wait + prefill,
        second_token_delay=max(0.0, transfer - prefill) + own_step,
        delay_to_others=transfer + others,
    )


def choose_by_cost(
    prompt_len: int, cluster: Cluster, slo: Slo, no_local: frozenset[str] = frozenset()
) -> Placement | None:
    """The cheapest option; None when no step time is measured yet (or no worker). Its
    reason gives its cost's parts and the runner-up's cost (a run's records show why).
    `no_local`: D's that handed this request back (never local on them again)."""
    cluster = _with_stand_ins(cluster)
    options: list[tuple[float, Placement, Estimate]] = []
    for d in cluster.decodes:
        local = None if d.worker_id in no_local else local_estimate(prompt_len, d, slo)
        if local is not None:
            why = f"{d.cached} of {prompt_len} tokens cached on D, {d.owed} owed before"
            computes = max(1, prompt_len - d.cached)
            placement = Placement(LOCAL, d.worker_id, None, why, computes, slo.start_within)
            options.append((local.cost(slo), placement, local))
        for p in cluster.prefills:
            if (p.worker_id, d.worker_id) not in cluster.pairs:
                continue
            remote = disagg_estimate(prompt_len, p, d, cluster)
            if remote is None:
                continue
            why = f"{p.cached} of {prompt_len} tokens cached on P, {d.cached} on D"
            computes = max(1, prompt_len - p.cached)
            placement = Placement(disagg_kind(d), d.worker_id, p.worker_id, why, computes)
            options.append((remote.cost(slo), placement, remote))
    if not options:
        return None
    options.sort(key=lambda option: option[0])
    (_, best, estimate), runner_up = options[0], options[1:2]
    why = f"{_costs(estimate, slo)}: {best.reason}"
    for _, other, other_estimate in runner_up:
        why += f"; next {other.kind} {other_estimate.cost(slo):.3f}s"
    return replace(best, reason=why, predicted_ttft=estimate.ttft)


def _costs(estimate: Estimate, slo: Slo) -> str:
    return (
        f"cost {estimate.cost(slo):.3f}s (ttft {estimate.ttft:.3f}, "
        f"token 2 +{estimate.second_token_delay:.3f}, others +{estimate.delay_to_others:.3f})"
    )


def _with_stand_ins(cluster: Cluster) -> Cluster:
    """Workers not measured yet take the mean line of their role's measured workers; a
    decode worker that never computed a prompt, the prefill workers' (same model, and
    its prompt steps are measured once it computes one)."""
    everyone = cluster.prefills + cluster.decodes
    any_prefill = Line.mean([w.prefill for w in everyone if w.prefill is not None])

    def filled(workers: tuple[WorkerState, ...]) -> tuple[WorkerState, ...]:
        prefill = Line.mean([w.prefill for w in workers if w.prefill is not None]) or any_prefill
        decode = Line.mean([w.decode for w in workers if w.decode is not None])
        return tuple(
            replace(w, prefill=w.prefill or prefill, decode=w.decode or decode) for w in workers
        )

    return Cluster(
        filled(cluster.prefills),
        filled(cluster.decodes),
        cluster.pairs,
        cluster.kv_bytes_per_token,
        cluster.transfer_rate,
    )
