"""Choosing the workers an attempt runs on: an aggregated worker, a prefill/decode pair, a
decode worker's prefill partner, a migration's target; and waiting while none serves.

Each choice is a routing policy's (`policies.py`: one for aggregated workers, one each for
P and D) among the pool's serving workers, away from those to avoid when others exist
(`workers.prefer`). Only prefill workers with a compatible decode partner (one KV layout,
`WorkerPool.compatible`) are candidates, and D is chosen among P's partners. The placer
(`placer.py`, `--placement`) decides whether a PD attempt is computed on D alone or split
between P and D; it asks `pick_pair` for the policies' pair. A worker whose address refused
the connection is suspended in the pool (`workers.py`); while no worker serves but a
suspended one may return, an attempt waits (`wait_for_worker`), bounded by the suspension.
"""

from __future__ import annotations

from collections.abc import Sequence

from baton.common.rpc import baton_pb2 as pb
from baton.services.router.kv_index import KVIndex
from baton.services.router.metrics import RouterMetrics
from baton.services.router.placement import Placement, Slo
from baton.services.router.placer import Placer
from baton.services.router.policies import Policy
from baton.services.router.worker_handle import WorkerHandle
from baton.services.router.workers import WorkerPool, prefer

Placed = tuple[Placement, WorkerHandle | None, WorkerHandle]  # a PD attempt's: P None if local


class NoWorkersAvailable(Exception):
    """No aggregated worker and no compatible prefill/decode pair is known."""


class WorkerChoice:
    """The routing policies over the pool's workers, and the placer that uses them."""

    def __init__(
        self,
        pool: WorkerPool,
        policy: Policy,
        prefill_policy: Policy,
        decode_policy: Policy,
        metrics: RouterMetrics | None = None,
        placement: str = "always-disagg",
        slo: Slo = Slo(),
        exact: KVIndex | None = None,
    ) -> None:
        self.pool = pool
        self.metrics = metrics
        self.placer = Placer(pool, self.pick_pair, placement, slo, exact, metrics)
        self._policy = policy
        self._prefill_policy = prefill_policy
        self._decode_policy = decode_policy
        for p in (policy, prefill_policy, decode_policy):
            pool.on_removed(p.forget)

    def worker_refused(self, worker: WorkerHandle) -> None:
        if self.pool.suspend(worker) and self.metrics is not None:
            self.metrics.worker_suspensions.inc()

    async def wait_for_worker(self) -> None:
        """Wait while no worker can serve but a suspended one may return; raises
        NoWorkersAvailable when none came."""
        served = await self.pool.wait_usable()
        if self.metrics is not None:
            self.metrics.waits_for_worker.labels("served" if served else "gave_up").inc()
        if not served:
            raise NoWorkersAvailable("no worker is available")

    async def place(
        self,
        input_ids: list[int],
        avoid: set[str],
        target: WorkerHandle | None = None,
        no_local: frozenset[str] = frozenset(),
    ) -> tuple[Placed | None, WorkerHandle | None]:
        """An attempt's workers: a PD placement or else an aggregated worker. On `target` (a
        move's) when given, else the placer's pair (never local on a D of `no_local`), else
        the policy's aggregated worker, waiting while none serves but a suspended one may
        return (`wait_for_worker`)."""
        placed = worker = None
        if target is not None and target.role == pb.DECODE:
            placed = self.placed_on(input_ids, target, "migration")
        elif target is not None:
            worker = target
        while placed is None and worker is None:
            placed = self.placer.place(input_ids, avoid, no_local)
            worker = None if placed else self.pick_single(input_ids, avoid)
            if placed is None and worker is None:
                await self.wait_for_worker()
        return placed, worker

    def remember(self, tokens: list[int], decode: WorkerHandle) -> None:
        """`decode` finished a request: its cache may hold `tokens` (the placer's to know)."""
        self.placer.remember(tokens, decode)

    def choose_target(self, options: list[WorkerHandle], input_ids: list[int]) -> WorkerHandle:
        policy = self._policy if options[0].role == pb.BOTH else self._decode_policy
        return policy.choose(options, input_ids)

    def placed_on(self, input_ids: Sequence[int], decode: WorkerHandle, why: str) -> Placed:
        """A PD attempt on `decode` (a migration's target): P chosen by the prefill policy
        among D's compatible partners, else local on D."""
        prefills = [p for p in self.pool.workers(pb.PREFILL) if self.pool.compatible(p, decode)]
        prefill = self._prefill_policy.choose(prefills, input_ids) if prefills else None
        return self.placer.placed(list(input_ids), prefill, decode, why), prefill, decode

    def pick_single(self, input_ids: Sequence[int], avoid: set[str]) -> WorkerHandle | None:
        workers = prefer(self.pool.workers(pb.BOTH), avoid)
        return self._policy.choose(workers, input_ids) if workers else None

    def pick_pair(
        self, input_ids: Sequence[int], avoid: set[str]
    ) -> tuple[WorkerHandle, WorkerHandle] | None:
        decodes = self.pool.workers(pb.DECODE)
        partners = {
            p.worker_id: [d for d in decodes if self.pool.compatible(p, d)]
            for p in self.pool.workers(pb.PREFILL)
        }
        prefills = [p for p in self.pool.workers(pb.PREFILL) if partners[p.worker_id]]
        if not prefills:
            return None
        # Only P with at least one compatible D are candidates; D among P's partners.
        prefill = self._prefill_policy.choose(prefer(prefills, avoid), input_ids)
        decode = self._decode_policy.choose(prefer(partners[prefill.worker_id], avoid), input_ids)
        return prefill, decode
