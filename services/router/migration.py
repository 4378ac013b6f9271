"""Moving running generations to another worker on purpose (issue 41): the plan, the moves.

The endpoint (`admin_migrate.py`):

    POST /admin/migrate  {"request_ids": [...]} | {"worker_id": "..."}, optional "to"
                         (admin key)
        400 a field the router does not know, neither or both of request_ids and
            worker_id, an empty or malformed id; 404 an unknown worker (worker_id or to);
        409 no worker could take a generation (none other of a role that decodes, or `to`
            is the source, not serving, or a prefill worker)
        200 {"moved": [{"request_id", "from", "to", "kind", "tokens"}, ...],
             "finished": [...], "not_running": [...]}

A move is a *planned migration*, of one of two kinds (docs/ARCHITECTURE.md, Migration):
"live" between decode workers of one KV layout (once planned, each source opens its KV data
connections to its targets, `handoff.connect_ahead`; the source hands the request off at its
next token, `Worker.Migrate`, and sends its pages to the target, which continues from the
next token) and "recompute" otherwise or when live fails: the current attempt stops at its
next output (`Attempt.move`), the source is sent `Abort`, and the next attempt resumes on
the target as a migration after a failure does (`Generation._resumed`: the prompt plus every
token passed on, the same seed's position). Either way the client's stream sees no gap,
repeat or loss.

The target is `to`, or the policy's choice among the serving workers that decode (decode
and aggregated, the source's own role first), never the source; each move planned counts
toward the load the next choice sees, so a worker's streams spread over the others. A
generation whose last token was already passed on (only its finish was pending) ends where
it stands and is listed under `finished`, as one that ends before its move takes effect.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol, TypeVar

from baton.common.rpc import baton_pb2 as pb
from baton.services.router.workers import WorkerHandle, WorkerPool

DECODING_ROLES = (pb.DECODE, pb.BOTH)
MOVE_TIMEOUT_S = 30.0  # a move that has not started on its target by then is reported late
KINDS = ("live", "recompute")
REASONS = ("admin", "role_change", "worker_failed")


class UnknownWorker(LookupError):
    """A worker id the pool does not know."""


class NoTarget(Exception):
    """No worker could take the generation."""


@dataclass(frozen=True)
class Move:
    """One generation moved: from which worker to which, how, after how many tokens."""

    request_id: str
    source: str  # worker id
    target: str  # worker id
    kind: str  # one of KINDS
    tokens: int  # tokens the client had been given when the new worker took over

    def as_dict(self) -> dict[str, Any]:
        fields = asdict(self)
        fields["from"], fields["to"] = fields.pop("source"), fields.pop("target")
        return fields


@dataclass(frozen=True)
class MigrationReport:
    moved: list[Move]
    finished: list[str]  # request ids that ended before their move took effect
    not_running: list[str]  # request ids the router is not generating

    def as_dict(self) -> dict[str, Any]:
        return {
            "moved": [m.as_dict() for m in self.moved],
            "finished": self.finished,
            "not_running": self.not_running,
        }


def candidates(pool: WorkerPool, source: WorkerHandle) -> list[WorkerHandle]:
    """The serving workers that could continue a generation of `source`: those that decode,
    of the source's role first, never the source."""
    same = [w for w in pool.workers(source.role) if w.worker_id != source.worker_id]
    if source.role not in DECODING_ROLES:
        same = []
    others = [
        w
        for role in DECODING_ROLES
        if role != source.role
        for w in pool.workers(role)
        if w.worker_id != source.worker_id
    ]
    return same or others


def check_target(pool: WorkerPool, to: str) -> WorkerHandle:
    """The worker named by `to`, if it may take generations; UnknownWorker or NoTarget."""
    target = pool.get(to)
    if target is None:
        raise UnknownWorker(f"no worker {to!r}")
    if target.role not in DECODING_ROLES:
        raise NoTarget(f"worker {to} is a prefill worker: it does not decode")
    if all(w is not target for w in pool.workers(target.role)):
        raise NoTarget(f"worker {to} is not serving ({pool.state(target)})")
    return target


def check_request(request_ids: list[str] | None, worker_id: str | None) -> None:
    """ValueError unless exactly one of them names what to move."""
    if (request_ids is None) == (worker_id is None):
        raise ValueError("give exactly one of request_ids and worker_id")
    if request_ids is not None and (not request_ids or not all(request_ids)):
        raise ValueError("request_ids must be a non-empty list of request ids")
    if worker_id is not None and not worker_id:
        raise ValueError("worker_id must not be empty")


class Movable(Protocol):
    @property
    def request_id(self) -> str: ...
    @property
    def input_ids(self) -> list[int]: ...
    @property
    def worker(self) -> WorkerHandle | None: ...


G = TypeVar("G", bound=Movable)


def plan_moves(
    pool: WorkerPool,
    generations: Sequence[G],
    to: WorkerHandle | None,
    choose: Callable[[list[WorkerHandle], list[int]], WorkerHandle],
) -> list[tuple[G, WorkerHandle]]:
    """Each generation's target: `to`, else `choose(options, input_ids)` among the
    `candidates` of its worker. NoTarget when one has none: nothing moves then.

    The moves planned so far count toward each next choice's load: the workers' loads do
    not change while a plan is made, so a policy that prefers the least loaded would send
    every stream of a worker to the same one (a role flip on 1P3D moved 31 streams to one
    decode worker and none to the other)."""
    plans = []
    planned: list[WorkerHandle] = []
    try:
        for generation in generations:
            request_id = generation.request_id
            source = generation.worker
            if source is None:  # between attempts: placed anew anyway
                options = pool.workers(pb.DECODE) + pool.workers(pb.BOTH)
            else:
                options = candidates(pool, source)
            if to is not None:
                if source is not None and to.worker_id == source.worker_id:
                    raise NoTarget(f"request {request_id} runs on {source.worker_id} already")
                plans.append((generation, to))
            elif not options:
                where = source.worker_id if source is not None else "the router"
                raise NoTarget(f"no other worker could continue request {request_id} of {where}")
            else:
                target = choose(options, generation.input_ids)
                # (no await until the finally: no other task sees the count)
                target.in_flight += 1
                planned.append(target)
                plans.append((generation, target))
    finally:
        for target in planned:
            target.in_flight -= 1
    return plans


async def wait_moves(
    moves: dict[str, asyncio.Future[Move | None]], timeout: float = MOVE_TIMEOUT_S
) -> tuple[list[Move], list[str]]:
    """The moves done (in `moves`' order) and the request ids that ended first."""
    if moves:
        await asyncio.wait(list(moves.values()), timeout=timeout)
    moved, finished = [], []
    for request_id, future in moves.items():
        if not future.done():
            future.cancel()
            raise TimeoutError(f"request {request_id} did not start on its target in time")
        if (move := future.result()) is not None:
            moved.append(move)
        else:
            finished.append(request_id)
    return moved, finished
