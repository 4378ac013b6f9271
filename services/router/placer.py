"""Placing a PD attempt: the rule of `--placement` (`placement.py`) on the pool's workers.

The placer builds what the rules read from the pool: each worker's predicted cache hit
(whole pages of a prefix index's `match`, where the worker keeps a prefix cache), its
queues, the step lines, decode steps now and transfer rate `ClusterMeter` measures from
the workers' load reports. It also feeds the approximate prefix tree with what it sends where, and counts
each placement.
"""

from __future__ import annotations

from collections.abc import Callable

from baton.common.rpc import baton_pb2 as pb
from baton.services.router.kv_index import CombinedIndex, KVIndex, PrefixIndex
from baton.services.router.measurements import ClusterMeter, bytes_per_token
from baton.services.router.metric_collectors import WorkerInputs
from baton.services.router.metrics import RouterMetrics
from baton.services.router.placement import (
    DELTA,
    FULL,
    LOCAL,
    Cluster,
    Placement,
    Slo,
    WorkerState,
    choose_by_cost,
    threshold_says_local,
)
from baton.services.router.prefix_tree import PrefixTree
from baton.services.router.worker_handle import WorkerHandle
from baton.services.router.workers import WorkerPool, prefer

PickPair = Callable[[list[int], set[str]], "tuple[WorkerHandle, WorkerHandle] | None"]


class Placer:
    def __init__(
        self,
        pool: WorkerPool,
        pick_pair: PickPair,
        rule: str = "always-disagg",
        slo: Slo = Slo(),
        exact: KVIndex | None = None,
        metrics: RouterMetrics | None = None,
    ) -> None:
        """`pick_pair`: the routing policies' P and D (always-disagg, and the fallback of
        the other rules)."""
        self.pool = pool
        self.pick_pair = pick_pair
        self.metrics = metrics
        self._rule = rule
        self._slo = slo
        # What each worker caches of a prompt: exactly, from its KV events where they are
        # fresh (`exact`), else guessed from the prompts and answers the router sent it.
        self._sent = PrefixTree()
        self._prefix_index: PrefixIndex = (
            self._sent if exact is None else CombinedIndex(exact, self._sent)
        )
        self.meter = ClusterMeter()
        pool.on_joined(self._measure)
        pool.on_removed(self.meter.forget)
        pool.on_removed(self._sent.remove_worker)
        if metrics is not None:
            metrics.watch_placement(self.inputs)

    def place(
        self, input_ids: list[int], avoid: set[str], no_local: frozenset[str] = frozenset()
    ) -> tuple[Placement, WorkerHandle | None, WorkerHandle] | None:
        """Where a PD attempt runs: the placement, P (None: local) and D; None when no
        prefill/decode pair exists. Never local on a D of `no_local` (it handed this
        request back)."""
        matched = self._prefix_index.match(input_ids)
        placement = None
        if self._rule == "cost":
            cluster = self._cluster(input_ids, matched, avoid)
            placement = choose_by_cost(len(input_ids), cluster, self._slo, no_local)
        elif self._rule == "threshold":
            placement = self._threshold(input_ids, matched, avoid, no_local)
        placement = placement or self._paired(input_ids, matched, avoid)
        if placement is None:
            return None
        decode = self.pool.get(placement.decode)
        prefill = self.pool.get(placement.prefill) if placement.prefill is not None else None
        if decode is None or (prefill is None and placement.kind != LOCAL):
            return None  # (a worker chosen from the pool is in the pool)
        self._record(input_ids, placement, prefill, decode)
        return placement, prefill, decode

    def _paired(
        self, input_ids: list[int], matched: dict[str, int], avoid: set[str]
    ) -> Placement | None:
        """The policy's pair, where no rule placed the request (or none could yet)."""
        pair = self.pick_pair(input_ids, avoid)
        if pair is None:
            return None
        prefill, decode = pair
        why = "no step times measured yet" if self._rule == "cost" else self._rule
        kind = DELTA if self._cached(decode, matched, len(input_ids)) else FULL
        return Placement(kind, decode.worker_id, prefill.worker_id, why)

    def placed(
        self, input_ids: list[int], prefill: WorkerHandle | None, decode: WorkerHandle, why: str
    ) -> Placement:
        """The placement of an attempt whose workers were chosen elsewhere (a migration's
        target, `prefill` None: local), counted and remembered as `place`'s are."""
        matched = self._prefix_index.match(input_ids)
        cached = self._cached(decode, matched, len(input_ids))
        if prefill is None:
            placement = Placement(LOCAL, decode.worker_id, None, why, len(input_ids) - cached)
        else:
            kind = DELTA if cached else FULL
            placement = Placement(kind, decode.worker_id, prefill.worker_id, why)
        self._record(input_ids, placement, prefill, decode)
        return placement

    def _record(
        self,
        input_ids: list[int],
        placement: Placement,
        prefill: WorkerHandle | None,
        decode: WorkerHandle,
    ) -> None:
        if self.metrics is not None:
            self.metrics.placements.labels(placement.kind).inc()
        self._sent.insert(input_ids, decode.worker_id)
        if prefill is not None:
            self._sent.insert(input_ids, prefill.worker_id)

    def remember(self, tokens: list[int], decode: WorkerHandle) -> None:
        """D finished a request: its cache may hold the prompt and the answer."""
        self._sent.insert(tokens, decode.worker_id)

    def _threshold(
        self,
        input_ids: list[int],
        matched: dict[str, int],
        avoid: set[str],
        no_local: frozenset[str],
    ) -> Placement | None:
        """Local on the D holding the most of the prompt, when the rule says so."""
        decodes = [
            d
            for d in prefer(self.pool.workers(pb.DECODE), avoid)
            if self._partnered(d) and d.worker_id not in no_local
        ]
        if not decodes:
            return None
        n = len(input_ids)
        decode = max(decodes, key=lambda d: (self._cached(d, matched, n), -d.load))
        cached = self._cached(decode, matched, n)
        if not threshold_says_local(n, WorkerState(decode.worker_id, cached)):
            return None
        why = f"threshold: {n - cached} of {n} tokens uncached on D"
        return Placement(LOCAL, decode.worker_id, None, why, n - cached, self._slo.start_within)

    def _cluster(self, input_ids: list[int], matched: dict[str, int], avoid: set[str]) -> Cluster:
        n = len(input_ids)
        prefills = prefer(self.pool.workers(pb.PREFILL), avoid)
        decodes = prefer(self.pool.workers(pb.DECODE), avoid)
        pairs = frozenset(
            (p.worker_id, d.worker_id)
            for p in prefills
            for d in decodes
            if self.pool.compatible(p, d)
        )
        decodes = [d for d in decodes if any(d.worker_id == pd[1] for pd in pairs)]
        return Cluster(
            tuple(self._state(p, matched, n) for p in prefills),
            tuple(self._state(d, matched, n) for d in decodes),
            pairs,
            bytes_per_token(decodes[0].info.layout) if decodes else 0.0,
            self.meter.transfer_rate,
        )

    def _state(self, worker: WorkerHandle, matched: dict[str, int], n: int) -> WorkerState:
        load = worker.info.load
        prefill, decode = self.meter.lines(worker.worker_id)
        now = self.meter.decode_now(worker.worker_id)
        return WorkerState(
            worker.worker_id,
            self._cached(worker, matched, n),
            load.running,
            max(load.queued, worker.in_flight - load.running),
            prefill,
            decode,
            load.step_times.decode_slack,
            load.step_times.slack_tokens,
            step=now.seconds if now is not None else 0.0,
            step_rows=now.rows if now is not None else 0.0,
            context=now.pairs if now is not None else 0.0,
            owed_prompts=tuple(worker.owed_prompts),
        )

    @staticmethod
    def _cached(worker: WorkerHandle, matched: dict[str, int], n: int) -> int:
        """Tokens of an n-token prompt the worker is predicted to reuse: whole pages, and
        never the last token (its logits are computed)."""
        if not worker.info.load.prefix_cache:
            return 0
        page = max(1, worker.info.layout.page_size)
        return min(matched.get(worker.worker_id, 0), n - 1) // page * page

    def _partnered(self, decode: WorkerHandle) -> bool:
        return any(self.pool.compatible(p, decode) for p in self.pool.workers(pb.PREFILL))

    def inputs(self) -> tuple[dict[str, WorkerInputs], float | None]:
        """What the cost rule reads of each worker now, and the KV transfer rate."""
        workers = {}
        for worker in self._serving():
            prefill, decode = self.meter.lines(worker.worker_id)
            now = self.meter.decode_now(worker.worker_id)
            step = now.seconds if now is not None else None
            workers[worker.worker_id] = WorkerInputs(
                prefill, decode, step, worker.prompt_tokens_owed
            )
        return workers, self.meter.transfer_rate

    def _measure(self) -> None:
        for worker in self._serving():
            self.meter.observe(worker.worker_id, worker.info.load)

    def _serving(self) -> list[WorkerHandle]:
        return [w for role in (pb.PREFILL, pb.DECODE, pb.BOTH) for w in self.pool.workers(role)]
