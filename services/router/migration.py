"""Moving running generations to another worker on purpose (issue 41): the plan, the moves.

The endpoint (`admin_migrate.py`):

    POST /admin/migrate  {"request_ids": [...]} | {"worker_id": "..."}, optional "to"
                         (admin key)
        400 a field the router does not know, neither or both of request_ids and
            worker_id, an empty or malformed id; 404 an unknown worker (worker_id or to);
        409 no worker could take a generation (none other of a role that decodes, or `to`
            is the source, not serving, or a prefill worker)
        200 {"moved": [{"request_id", "from", "to", "kind", "tokens"}, ...],
             "finished": [...], "not_running": [...], "stayed": [...]}

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
and aggregated, the source's own role first), never the source, that have room for it
(`Room`): a free running slot (max_running_requests less what runs and waits there) and
free KV pages for its context. Each move planned counts toward the load the next choice
sees and takes from its target's room, so a worker's streams spread over the others and
a burst of them does not overflow one into its waiting queue. A generation that fits on
no target stays where it is, listed under `stayed`: on a full target it would wait in the
queue, a stall of many of that worker's steps, while where it is it decodes on at full
speed (a role change asks again as room frees, and otherwise waits for it to end). A named
`to` takes every generation named, room or not: the operator chose it. A generation whose
last token was already passed on (only its finish was pending) ends where it stands and is
listed under `finished`, as one that ends before its move takes effect.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, TypeVar

from baton.common.rpc import baton_pb2 as pb
from baton.services.router.worker_handle import WorkerHandle
from baton.services.router.workers import WorkerPool

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
    stayed: list[str] = field(default_factory=list)  # request ids no target had room for

    def as_dict(self) -> dict[str, Any]:
        return {
            "moved": [m.as_dict() for m in self.moved],
            "finished": self.finished,
            "not_running": self.not_running,
            "stayed": self.stayed,
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


@dataclass
class Room:
    """What a target can still take while a plan is made: running slots and KV pages free
    by its registration (`Capacity`) and its last load report, less the moves planned onto
    it so far. A worker that reports no capacity (an older worker, a fake) has room for
    any number."""

    slots: float
    pages: float
    page_size: int

    @classmethod
    def of(cls, worker: WorkerHandle) -> Room:
        capacity, load = worker.info.capacity, worker.info.load
        page_size = capacity.page_size or worker.info.layout.page_size or 1
        if not capacity.max_running_requests:
            return cls(math.inf, math.inf, page_size)
        # the router's own count is ahead of the worker's report for what it just placed
        busy = max(worker.in_flight, load.running + load.queued)
        pages = capacity.num_pages * (1.0 - load.token_usage) if capacity.num_pages else math.inf
        return cls(capacity.max_running_requests - busy, pages, page_size)

    def pages_for(self, tokens: int) -> int:
        """The pages a generation of `tokens` tokens of context needs to go on: its context
        and its next token's."""
        return -(-(tokens + 1) // self.page_size)

    def fits(self, tokens: int) -> bool:
        return self.slots >= 1 and self.pages >= self.pages_for(tokens)

    def take(self, tokens: int) -> None:
        self.slots -= 1
        self.pages -= self.pages_for(tokens)


class Movable(Protocol):
    @property
    def request_id(self) -> str: ...
    @property
    def input_ids(self) -> list[int]: ...
    @property
    def context_tokens(self) -> int:
        """The prompt and the tokens passed on: the KV a target takes over."""

    @property
    def worker(self) -> WorkerHandle | None: ...


G = TypeVar("G", bound=Movable)


def plan_moves(
    pool: WorkerPool,
    generations: Sequence[G],
    to: WorkerHandle | None,
    choose: Callable[[list[WorkerHandle], list[int]], WorkerHandle],
) -> tuple[list[tuple[G, WorkerHandle]], list[G]]:
    """Each generation's target: `to`, else `choose(options, input_ids)` among the
    `candidates` of its worker that have `Room` for it; and the generations that fit on
    none (they stay). NoTarget when one has no candidate at all: nothing moves then.

    The moves planned so far count toward each next choice's load and room: the workers'
    loads do not change while a plan is made, so a policy that prefers the least loaded
    would send every stream of a worker to the same one (a role flip on 1P3D moved 31
    streams to one decode worker and none to the other)."""
    plans, stay = [], []
    planned: list[WorkerHandle] = []
    rooms: dict[str, Room] = {}  # by worker id, as first seen in this plan
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
                continue
            if not options:
                where = source.worker_id if source is not None else "the router"
                raise NoTarget(f"no other worker could continue request {request_id} of {where}")
            tokens = generation.context_tokens
            roomy = [w for w in options if _room(rooms, w).fits(tokens)]
            if not roomy:
                stay.append(generation)
                continue
            target = choose(roomy, generation.input_ids)
            rooms[target.worker_id].take(tokens)
            # (no await until the finally: no other task sees the count)
            target.in_flight += 1
            planned.append(target)
            plans.append((generation, target))
    finally:
        for target in planned:
            target.in_flight -= 1
    return plans, stay


def _room(rooms: dict[str, Room], worker: WorkerHandle) -> Room:
    room = rooms.get(worker.worker_id)
    if room is None:
        room = rooms[worker.worker_id] = Room.of(worker)
    return room


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
