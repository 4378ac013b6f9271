"""The router's `GET /health`: whether the cluster can serve, and how it stands against the
shape it expects (`--expect-workers`).

503 only while nothing can be served; a usable cluster short of the workers it expects
answers 200 with status "partial", so that load balancers keep it while clients that
measure it (`baton up`, `bench serve`) can tell. The expected shape follows role changes
(`Expected.role_changed`): a worker that changed role leaves no gap."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from baton.services.registry.watcher import MembershipWatcher
from baton.services.router.config import WorkerCounts
from baton.services.router.workers import WorkerPool

__all__ = ["Expected", "add_health_route"]


class Expected:
    """The workers the cluster expects by role (None: it expects none in particular)."""

    def __init__(self, counts: WorkerCounts | None) -> None:
        self.counts = counts

    def role_changed(self, previous: str, now: str) -> None:
        """A worker changed role: the cluster lacks no worker for it."""
        if self.counts is not None and getattr(self.counts, previous) > 0:
            counts = self.counts.as_dict()
            counts[previous] -= 1
            counts[now] += 1
            self.counts = WorkerCounts(**counts)

    def missing(self, joined: dict[str, int], changing: int) -> dict[str, int]:
        """Workers expected and not joined, by role; none while no more are missing than
        are changing role (they joined long ago; whether the registry has told the router
        their new role yet or not, the expected shape follows once they serve)."""
        missing = self.counts.missing(joined) if self.counts is not None else {}
        return {} if sum(missing.values()) <= changing else missing


def add_health_route(
    app: FastAPI,
    cluster_id: str,
    pool: WorkerPool,
    expected: Expected,
    under_way: dict[str, tuple[str, str]],
    watcher: Callable[[], MembershipWatcher | None],
) -> None:
    """`under_way`: the role changes in progress (worker id -> (from, to))."""

    @app.get("/health")
    async def health() -> JSONResponse:
        joined = pool.counts_by_role()
        body: dict[str, object] = {
            "cluster_id": cluster_id,
            "workers": joined,
            "expected": expected.counts.as_dict() if expected.counts is not None else None,
            "worker_ids": pool.worker_ids(),
        }
        changing = pool.changing()
        if changing:  # out of `workers` until their role change ends
            body["changing"] = {
                w: {"state": state, "from": frm, "to": to}
                for w, state in changing.items()
                for frm, to in [under_way.get(w, ("?", "?"))]
            }
        lapsed = pool.lapsed()
        if lapsed:  # out of `workers`: dropped by the registry, their streams go on
            body["lapsed"] = lapsed
        membership = watcher()
        if membership is not None:
            # Unreachable: the router routes to the members it last knew.
            state = "connected" if membership.connected else "unreachable"
            body["registry"] = {"address": membership.address, "state": state}
        if not pool.usable():
            return JSONResponse(
                {"status": "unavailable", **body, "detail": "no usable worker or pair"},
                status_code=503,
                headers={"Retry-After": "1"},
            )
        if missing := expected.missing(joined, len(changing)):
            waiting = ", ".join(f"{n} {role}" for role, n in missing.items())
            return JSONResponse(
                {"status": "partial", **body, "detail": f"workers not joined yet: {waiting}"}
            )
        return JSONResponse({"status": "ok", **body})
