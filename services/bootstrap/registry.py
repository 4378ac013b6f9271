"""The membership registry: who is alive, in which role, at which addresses.

Pure logic over protobuf messages (no gRPC, no I/O); `server.py` puts it on the wire.
Members live under a lease: each heartbeat pushes the lease's deadline `lease_ttl` seconds
into the future, and a lease whose deadline has passed is gone - whether or not the periodic
`expire()` has swept it yet, every read sweeps first. The registry is soft state: after a
restart it is empty, heartbeats answer "unknown", and workers register again.

Time the registry itself did not run is nobody's fault: a bootstrap frozen past the ttl (a VM
pause, a swap storm, SIGSTOP) heard no heartbeat, though every worker sent them. Given a
`sweep_period` (the server's sweep calls `expire()` that often), the registry notices such a
stall as a gap in its own clock between sweeps, and before it expires anything it gives every
lease a full ttl from the resume, in which the heartbeats the workers keep sending arrive.

Watchers get an asyncio.Queue: first one ADDED per current member, then SYNCED, then every
change. A watcher that falls more than `MAX_PENDING_EVENTS` behind is dropped: its queue is
emptied and gets `None`, which tells the stream to end so the client resubscribes and
resyncs from a fresh snapshot.
"""

from __future__ import annotations

import asyncio
import builtins
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from baton.common.rpc import baton_pb2 as pb
from baton.common.rpc.layout import layout_conflict
from baton.services.registry.records import RecordError, to_record

log = logging.getLogger(__name__)

MAX_PENDING_EVENTS = 10_000

EventQueue = asyncio.Queue[pb.MembershipEvent | None]


class RegistrationError(ValueError):
    """The registry refuses this worker: its record does not validate (records.py)."""


class LayoutMismatchError(RegistrationError):
    """The worker's KV layout differs from that of a registered worker it would pair with."""


@dataclass
class _Member:
    info: pb.WorkerInfo
    lease_id: str
    deadline: float


class Registry:
    def __init__(
        self,
        lease_ttl: float,
        clock: Callable[[], float] = time.monotonic,
        sweep_period: float | None = None,
    ) -> None:
        """`sweep_period`: how often something calls `expire()` while the registry runs;
        None when nothing does (then no stall can be told from a quiet spell)."""
        if lease_ttl <= 0:
            raise ValueError(f"lease_ttl must be > 0, got {lease_ttl}")
        if sweep_period is not None and sweep_period <= 0:
            raise ValueError(f"sweep_period must be > 0, got {sweep_period}")
        self.lease_ttl = lease_ttl
        self.sweep_period = sweep_period
        self.stalls = 0  # stalls noticed (and forgiven) so far
        self._clock = clock
        self._last_ran = clock()
        self._members: dict[str, _Member] = {}
        self._watchers: list[EventQueue] = []

    # -- membership -------------------------------------------------------------------------

    def register(self, info: pb.WorkerInfo) -> str:
        """Add `info` under a new lease and return the lease id. A worker registering again
        with the same worker_id replaces its old entry (and old lease): UPDATED, not ADDED.
        Raises RegistrationError for a worker that could never be used."""
        self.expire()
        self._validate(info)
        lease_id = uuid.uuid4().hex
        stored = pb.WorkerInfo()
        stored.CopyFrom(info)
        replaced = info.worker_id in self._members
        self._members[info.worker_id] = _Member(stored, lease_id, self._clock() + self.lease_ttl)
        log.info(
            "%s %s worker %s (grpc %s)",
            "re-registered" if replaced else "registered",
            pb.Role.Name(info.role),
            info.worker_id,
            info.grpc_address,
        )
        self._publish(pb.MembershipEvent.UPDATED if replaced else pb.MembershipEvent.ADDED, stored)
        return lease_id

    def heartbeat(self, lease_id: str, worker_id: str, load: pb.Load | None = None) -> bool:
        """Renew the lease; False when it is unknown or lapsed (the worker must register)."""
        self.expire()
        member = self._members.get(worker_id)
        if member is None or member.lease_id != lease_id:
            return False
        member.deadline = self._clock() + self.lease_ttl
        if load is not None and load != member.info.load:
            member.info.load.CopyFrom(load)
            self._publish(pb.MembershipEvent.UPDATED, member.info)
        return True

    def deregister(self, lease_id: str, worker_id: str) -> bool:
        """Remove the worker if `lease_id` is its current lease (a stale process cannot
        remove its successor). True when something was removed."""
        member = self._members.get(worker_id)
        if member is None or member.lease_id != lease_id:
            return False
        del self._members[worker_id]
        log.info("deregistered worker %s", worker_id)
        self._publish(pb.MembershipEvent.REMOVED, member.info)
        return True

    def list(self, role: int | None = None) -> builtins.list[pb.WorkerInfo]:
        """Current members (all roles when `role` is None or ROLE_UNSPECIFIED), by worker_id."""
        self.expire()
        return [m.info for _, m in sorted(self._members.items()) if not role or m.info.role == role]

    def expire(self) -> builtins.list[str]:
        """Remove every member whose lease has lapsed; return their worker ids."""
        now = self._clock()
        self._forgive_stall(now)
        lapsed = [wid for wid, m in self._members.items() if m.deadline <= now]
        for worker_id in lapsed:
            member = self._members.pop(worker_id)
            log.warning("worker %s: lease lapsed, removed", worker_id)
            self._publish(pb.MembershipEvent.REMOVED, member.info)
        return lapsed

    def _forgive_stall(self, now: float) -> None:
        """After a stall (no sweep for two periods: the process was not running), give every
        lease a full ttl from now: the heartbeats sent meanwhile found nobody to hear them."""
        if self.sweep_period is None:
            return
        gap, self._last_ran = now - self._last_ran, now
        if gap <= 2 * self.sweep_period:
            return
        self.stalls += 1
        for member in self._members.values():
            member.deadline = max(member.deadline, now + self.lease_ttl)
        log.warning(
            "the registry did not run for %.1fs (a stall); %d leases renewed for %.1fs",
            gap,
            len(self._members),
            self.lease_ttl,
        )

    def _validate(self, info: pb.WorkerInfo) -> None:
        try:
            to_record(info)
        except RecordError as e:
            raise RegistrationError(str(e)) from None
        conflict = layout_conflict(info, (m.info for m in self._members.values()))
        if conflict:
            raise LayoutMismatchError(conflict)

    # -- watchers ---------------------------------------------------------------------------

    def subscribe(self) -> EventQueue:
        """A queue holding one ADDED per current member, then SYNCED, then every change."""
        self.expire()
        queue: EventQueue = asyncio.Queue()
        for info in self.list():
            queue.put_nowait(pb.MembershipEvent(type=pb.MembershipEvent.ADDED, worker=info))
        queue.put_nowait(
            pb.MembershipEvent(type=pb.MembershipEvent.SYNCED, lease_ttl_seconds=self.lease_ttl)
        )
        self._watchers.append(queue)
        return queue

    def unsubscribe(self, queue: EventQueue) -> None:
        if queue in self._watchers:
            self._watchers.remove(queue)

    def close_watchers(self) -> None:
        """End every watch stream (shutdown): each queue gets `None`."""
        for queue in self._watchers:
            queue.put_nowait(None)
        self._watchers.clear()

    def _publish(self, event_type: pb.MembershipEvent.Type, info: pb.WorkerInfo) -> None:
        # The event owns a copy: later heartbeats mutate the stored info in place.
        event = pb.MembershipEvent(type=event_type, worker=info)
        for queue in list(self._watchers):
            if queue.qsize() >= MAX_PENDING_EVENTS:
                self._drop(queue)
            else:
                queue.put_nowait(event)

    def _drop(self, queue: EventQueue) -> None:
        while not queue.empty():
            queue.get_nowait()
        queue.put_nowait(None)
        self._watchers.remove(queue)
