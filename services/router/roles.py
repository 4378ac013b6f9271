"""Changing a worker's role under load (issue 41), and the admin endpoints that do it.

    POST /admin/workers/{worker_id}/role  {"role": "prefill" | "decode" | "both",
                                           "drain_timeout_s": 60}  (admin key)
        404 unknown worker; 400 bad role; 409 the other workers could not serve meanwhile
        (the last decode worker while prefill workers remain, ...), another change of this
        worker is under way, or its requests outlasted the wait; 504 the worker changed
        but its new registration did not reach the router in time
    GET  /admin/workers                   every worker: role, state, load (admin key)

A change, in order:

    hold ── out of every choice at once (`WorkerPool.hold`: state "draining")
      ── its requests move away (`move_requests_away`: a decode or aggregated worker's
         generations migrate to other workers that decode with room for them,
         `Dispatcher.migrate`, again as room frees; a prefill worker's rooms end on the
         worker itself, which waits for them)
      ── Worker.SetRole ("switching"): the worker refuses new requests, waits for what is
         left, swaps its scheduler's role and registers again under the new role
      ── the registry's watch brings the new role (within one lease)
      ── release: the worker serves in its new role

Whatever happens, the hold ends: a refused change leaves the worker serving in its old
role. Each ends with one log line; `baton_router_role_changes_total` counts them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import grpc.aio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from baton.common.rpc import baton_pb2 as pb
from baton.services.router.dispatch import Dispatcher
from baton.services.router.errors import APIError, bad_request
from baton.services.router.metrics import RouterMetrics
from baton.services.router.migration import NoTarget, UnknownWorker
from baton.services.router.utility import admin_body, check_admin
from baton.services.router.worker_handle import WorkerHandle
from baton.services.router.workers import ROLE_NAMES, WorkerPool

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "both")
DRAIN_TIMEOUT_S = 60.0  # requests on the worker end (or move away) within this by default
REGISTERED_TIMEOUT_S = 15.0  # the new role reaches the router: three 5 s leases
_SETROLE_MARGIN_S = 30.0  # past the drain: the worker starting its new role and registering
_POLL_S = 0.02
RETRY_MOVES_S = 1.0  # between asks to move what no target had room for (load reports lag)


class RoleBody(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a field the router does not honor is a 400

    role: str
    drain_timeout_s: float = DRAIN_TIMEOUT_S


def serves(counts: dict[str, int]) -> bool:
    """Whether workers in these numbers serve requests: an aggregated one, or P and D."""
    return bool(counts.get("both") or (counts.get("prefill") and counts.get("decode")))


def refusal(others: dict[str, int]) -> str:
    """Why a worker may not change role now ('' when it may): `others` counts the serving
    workers by role without it, and they must serve while it changes. A prefill or decode
    worker left without its partner beside an aggregated one is allowed: the aggregated
    workers serve meanwhile (an aggregated cluster becomes a P/D one a worker at a time)."""
    if serves(others):
        return ""
    have = ", ".join(f"{n} {role}" for role, n in others.items() if n) or "none"
    return f"the other workers ({have}) could not serve while this one changes role"


async def move_requests_away(dispatcher: Dispatcher, worker: WorkerHandle, deadline: float) -> None:
    """Empty a decode or aggregated worker of the router's requests before its role
    changes: each running generation moves to another worker that decodes
    (`Dispatcher.migrate`, its stream going on without a gap or a repeat). Those no target
    had room for stay, and are asked to move again every `RETRY_MOVES_S` as room frees;
    where none can take one, or the move is late, it is waited for, bounded by `deadline`
    (time.monotonic()); what is left then is the worker's own wait (SetRole) to refuse."""
    stayed = bool(worker.in_flight)
    while stayed and worker.in_flight and time.monotonic() < deadline:
        try:
            report = await asyncio.wait_for(
                dispatcher.migrate(worker_id=worker.worker_id, reason="role_change"),
                max(0.0, deadline - time.monotonic()),
            )
        except (NoTarget, UnknownWorker, TimeoutError) as e:
            log.warning("worker %s: its requests finish there instead: %s", worker.worker_id, e)
            break
        log.info(
            "worker %s: %d requests moved away, %d finished first, %d stay (no room elsewhere)",
            worker.worker_id,
            len(report.moved),
            len(report.finished),
            len(report.stayed),
        )
        stayed = bool(report.stayed)
        if stayed:
            await asyncio.sleep(max(0.0, min(RETRY_MOVES_S, deadline - time.monotonic())))
    while worker.in_flight and time.monotonic() < deadline:
        await asyncio.sleep(_POLL_S)


class RoleChanger:
    """Role changes, one at a time per worker (any number of workers at once)."""

    def __init__(
        self,
        pool: WorkerPool,
        dispatcher: Dispatcher,
        metrics: RouterMetrics | None = None,
        on_changed: Callable[[str, str], None] = lambda previous, now: None,
    ) -> None:
        self.pool = pool
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.on_changed = on_changed  # (previous role, new role) once a change is done
        self.under_way: dict[str, tuple[str, str]] = {}  # worker id -> (its role, the new one)

    async def change(self, worker_id: str, to: str, drain_timeout: float) -> dict[str, Any]:
        """Change `worker_id`'s role to `to`; the answer's body, or APIError."""
        if to not in ROLES:
            raise bad_request(f"role must be one of {', '.join(ROLES)}, not {to!r}", "role")
        if not drain_timeout > 0:
            raise bad_request("drain_timeout_s must be > 0", "drain_timeout_s")
        worker = self.pool.get(worker_id)
        if worker is None:
            raise APIError(404, f"no worker {worker_id!r}", param="worker_id", code="not_found")
        current = ROLE_NAMES[worker.role]
        if worker_id in self.pool.changing():
            raise _conflict(f"worker {worker_id} is already changing role")
        if current == to:
            return {"worker_id": worker_id, "role": to, "previous_role": to, "seconds": 0.0}
        others = self.pool.counts_by_role()
        if self.pool.state(worker) == "serving":
            others[current] -= 1
        if why := refusal(others):
            self._count(to, "refused")
            log.warning("worker %s stays %s (asked: %s): %s", worker_id, current, to, why)
            raise _conflict(f"worker {worker_id} stays {current}: {why}")
        started = time.monotonic()
        self.pool.hold(worker_id, "draining")  # no await since the check: no race with another
        self.under_way[worker_id] = (current, to)
        try:
            await self._run(worker, current, to, started + drain_timeout)
        except APIError as e:  # 504: the worker changed, its registration is late
            self._count(to, "unconfirmed" if e.status == 504 else "refused")
            raise
        finally:
            self.pool.release(worker_id)
            del self.under_way[worker_id]
        seconds = time.monotonic() - started
        self.on_changed(current, to)
        self._count(to, "done")
        if self.metrics is not None:
            self.metrics.role_change_seconds.observe(seconds)
        log.info("worker %s changed role %s -> %s in %.2fs", worker_id, current, to, seconds)
        return {"worker_id": worker_id, "role": to, "previous_role": current, "seconds": seconds}

    async def _run(self, worker: WorkerHandle, current: str, to: str, deadline: float) -> None:
        log.info(
            "worker %s: %s -> %s: draining %d requests",
            worker.worker_id,
            current,
            to,
            worker.in_flight,
        )
        if current != "prefill":  # a prefill worker's rooms end on the worker
            await move_requests_away(self.dispatcher, worker, deadline)
        self.pool.hold(worker.worker_id, "switching")
        left = max(0.1, deadline - time.monotonic())
        request = pb.SetRoleRequest(role=to, drain_timeout_seconds=left)
        try:
            await worker.stub.SetRole(request, timeout=left + _SETROLE_MARGIN_S)
        except grpc.aio.AioRpcError as e:
            log.warning("worker %s stays %s: %s", worker.worker_id, current, e.details())
            status = 400 if e.code() == grpc.StatusCode.INVALID_ARGUMENT else 409
            raise APIError(
                status,
                f"worker {worker.worker_id} stays {current}: {e.details()}",
                type="conflict" if status == 409 else "invalid_request_error",
            ) from None
        await self._registered(worker.worker_id, to)

    async def _registered(self, worker_id: str, to: str) -> None:
        """Wait until the registry's watch shows the worker in its new role."""
        wanted = {name: role for role, name in ROLE_NAMES.items()}[to]
        end = time.monotonic() + REGISTERED_TIMEOUT_S
        while time.monotonic() < end:
            worker = self.pool.get(worker_id)
            if worker is None:
                raise _conflict(f"worker {worker_id} left the cluster while changing role")
            if worker.role == wanted:
                return
            await asyncio.sleep(_POLL_S)
        raise APIError(
            504,
            f"worker {worker_id} changed role to {to}, but its registration did not reach "
            f"the router within {REGISTERED_TIMEOUT_S:g}s",
            type="timeout",
        )

    def _count(self, to: str, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.role_changes.labels(to, outcome).inc()

    def listing(self) -> list[dict[str, Any]]:
        """Every registered worker: its role, state and load."""
        return [
            {
                "worker_id": w.worker_id,
                "role": ROLE_NAMES.get(w.role, "unknown"),
                "state": self.pool.state(w),
                "grpc_address": w.info.grpc_address,
                "load": {
                    "in_flight": w.in_flight,
                    "running": w.info.load.running,
                    "queued": w.info.load.queued,
                },
            }
            for w in self.pool.members()
        ]


def _conflict(message: str) -> APIError:
    return APIError(409, message, type="conflict", code="conflict")


def add_role_routes(app: FastAPI, changer: RoleChanger, admin_api_key: str | None) -> None:
    @app.get("/admin/workers")
    async def list_workers(request: Request) -> JSONResponse:
        check_admin(request, admin_api_key)
        return JSONResponse({"workers": changer.listing()})

    @app.post("/admin/workers/{worker_id}/role")
    async def set_role(worker_id: str, request: Request) -> JSONResponse:
        body = await admin_body(request, admin_api_key, RoleBody)
        return JSONResponse(await changer.change(worker_id, body.role, body.drain_timeout_s))
