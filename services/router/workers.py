"""The workers the router may send requests to, and one gRPC channel per address.

The pool is fed membership events (from the bootstrap's Watch stream through
`MembershipWatcher`, or a static list in tests). A worker that leaves is no longer
offered to any policy, the requests running on it move on (the dispatcher listens for
removals), and its channel is closed once no remaining worker uses that address.

A worker whose address refuses a connection is *suspended* at once (`suspend`): out of
every policy's choices and out of `/health`'s counts, before its lease lapses. It returns
when it registers again (a new incarnation on the same address is a new worker, with a new
channel: nothing meant for the old process reaches the new one) or, still registered,
after `SUSPENSION_S`: its heartbeats kept reaching the registry, so it lives. For as long
as a suspension runs, even once the lease lapsed, the pool *expects a return*: a request
that finds no worker waits for one (`wait_usable`) rather than failing, since a worker
restarted at once on its port comes back within seconds.

A worker the registry drops (its lease lapsed) while requests run on it is *lapsed*: out of
every choice and count at once, but its streams go on while it answers a probe, since a
live worker's heartbeats can miss their lease (a starved host, a registry outage) and it
registers again as soon as the registry hears it; the pool then has it serve again with
nothing moved. It is removed when it stops answering, or once nothing runs on it.

A worker changing role (`roles.py`) is *held*: out of every choice and of `/health`'s
counts like a suspended one, but listed in `changing()` with its state (draining, then
switching), until the change ends; its new role arrives as a registration update.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import grpc
import grpc.aio

from baton.common.rpc import baton_pb2 as pb
from baton.common.rpc import baton_pb2_grpc as pb_grpc
from baton.common.rpc.auth import make_channel
from baton.common.rpc.layout import layout_mismatch
from baton.services.router.worker_handle import WorkerHandle

log = logging.getLogger(__name__)

ROLE_NAMES: dict[int, str] = {pb.BOTH: "both", pb.PREFILL: "prefill", pb.DECODE: "decode"}

# Seconds a departed worker's channel stays open for calls still on it.
_CHANNEL_CLOSE_GRACE = 5.0

# Seconds a worker that refused a connection stays out of the choices unless it registers
# again: past a lease (5 s by default), so that a dead worker has left by then, and past a
# tiny-model decode worker's restart on a loaded 2-core machine (14 s from SIGKILL to its
# new registration, tests/integration/test_fault_decode_restart.py), so that requests wait
# for a worker restarted at once rather than fail.
SUSPENSION_S = 30.0

# A lapsed worker is probed this often, each probe (`Health`) answered within the timeout:
# past a starved worker's answer, and soon enough that a dead one's streams move on.
PROBE_INTERVAL_S = 1.0
PROBE_TIMEOUT_S = 1.0


class WorkerPool:
    def __init__(
        self,
        cluster_token: str | None,
        suspension_s: float = SUSPENSION_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._token = cluster_token
        self._suspension_s = suspension_s
        self._clock = clock
        # worker id -> when its suspension ends; kept after the worker leaves, so that
        # requests wait for its return until then.
        self._suspended: dict[str, float] = {}
        self._held: dict[str, str] = {}  # worker id -> its role change's state
        self._lapsed: dict[str, WorkerHandle] = {}  # dropped by the registry, still serving
        self._probes: set[asyncio.Task[None]] = set()
        self._joined = asyncio.Event()  # set (and replaced) whenever a worker joins
        self._workers: dict[str, WorkerHandle] = {}
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._compatible: dict[tuple[str, str], bool] = {}
        self._removal_listeners: list[Callable[[str], None]] = []
        self._join_listeners: list[Callable[[], None]] = []
        self._lapse_listeners: list[Callable[[str], None]] = []
        self._closing: set[asyncio.Task[None]] = set()

    def on_removed(self, listener: Callable[[str], None]) -> None:
        """Call `listener(worker_id)` whenever a worker leaves the pool."""
        self._removal_listeners.append(listener)

    def on_lapse_ended(self, listener: Callable[[str], None]) -> None:
        """Call `listener(outcome)` when a lapse ends: "returned", "not_answering", "idle"."""
        self._lapse_listeners.append(listener)

    def on_joined(self, listener: Callable[[], None]) -> None:
        """Call `listener()` whenever a worker joins or its registration changes."""
        self._join_listeners.append(listener)

    def apply(self, event: pb.MembershipEvent) -> None:
        """Follow one membership change (MembershipWatcher's on_change)."""
        if event.type == pb.MembershipEvent.REMOVED:
            self.lapse(event.worker.worker_id)
        elif event.type in (pb.MembershipEvent.ADDED, pb.MembershipEvent.UPDATED):
            self.upsert(event.worker)

    def upsert(self, info: pb.WorkerInfo) -> None:
        if info.role not in ROLE_NAMES:
            log.warning("ignoring worker %s with unknown role %s", info.worker_id, info.role)
            return
        handle = self._workers.get(info.worker_id) or self._come_back(info)
        if handle is not None and _same_process(handle.info, info):
            if handle.info.layout != info.layout or handle.info.role != info.role:
                self._forget_compatibility(info.worker_id)
            handle.info = info
            self._notify_joined()
            return
        # A restarted worker (same id, or a new id on the same address) is a new peer:
        # whatever ran on the old process fails now.
        stale = [
            w.worker_id
            for w in self._known()
            if w.worker_id == info.worker_id
            or (w.info.grpc_address == info.grpc_address and not _same_process(w.info, info))
        ]
        for worker_id in stale:
            self.remove(worker_id)
        channel = self._channels.get(info.grpc_address)
        if channel is None:
            channel = make_channel(info.grpc_address, self._token)
            self._channels[info.grpc_address] = channel
        self._workers[info.worker_id] = WorkerHandle(info, pb_grpc.WorkerStub(channel), channel)
        self._suspended.pop(info.worker_id, None)  # registered again: it answers
        log.info(
            "worker %s joined: %s at %s",
            info.worker_id,
            ROLE_NAMES[info.role],
            info.grpc_address,
        )
        self._notify_joined()

    def _notify_joined(self) -> None:
        joined, self._joined = self._joined, asyncio.Event()
        joined.set()
        for listener in self._join_listeners:
            listener()

    def suspend(self, handle: WorkerHandle) -> bool:
        """Take `handle`'s worker out of the choices: its address refused a connection.
        False when it is no longer the pool's (it left, or a new incarnation replaced it)
        or is already suspended."""
        if not _holds(self._workers, handle) or self._is_suspended(handle):
            return False
        self._suspended[handle.worker_id] = self._clock() + self._suspension_s
        log.warning(
            "worker %s refused a connection at %s: suspended until it registers again "
            "(at most %.0fs)",
            handle.worker_id,
            handle.info.grpc_address,
            self._suspension_s,
        )
        return True

    def suspended(self) -> list[str]:
        """Worker ids (registered or not) whose suspension runs."""
        now = self._clock()
        self._suspended = {w: until for w, until in self._suspended.items() if until > now}
        return sorted(self._suspended)

    def expects_return(self) -> bool:
        """A worker suspended lately may come back (restarted at once on its port)."""
        return bool(self.suspended())

    async def wait_usable(self) -> bool:
        """Wait until the pool is usable, while a suspended worker may return; False when
        none is expected back any more and the pool is still unusable."""
        while not self.usable():
            ends = max(self._suspended.values(), default=0.0) - self._clock()
            if ends <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._joined.wait(), ends)
        return True

    def hold(self, worker_id: str, state: str) -> None:
        """Keep the worker out of every choice (a role change under way, in `state`)."""
        self._held[worker_id] = state

    def release(self, worker_id: str) -> None:
        """The role change ended: the worker serves again (in whatever role it has)."""
        self._held.pop(worker_id, None)
        self._notify_joined()

    def changing(self) -> dict[str, str]:
        """Held workers still registered, by id: the state of their role change."""
        return {w: state for w, state in sorted(self._held.items()) if w in self._workers}

    def state(self, handle: WorkerHandle) -> str:
        """'serving', a role change's state ('draining', 'switching') or 'suspended'."""
        if handle.worker_id in self._held:
            return self._held[handle.worker_id]
        return "suspended" if self._is_suspended(handle) else "serving"

    def members(self) -> list[WorkerHandle]:
        """Every registered worker, serving or not, by worker_id."""
        return [w for _, w in sorted(self._workers.items())]

    def _is_suspended(self, handle: WorkerHandle) -> bool:
        return self._suspended.get(handle.worker_id, 0.0) > self._clock()

    def lapse(self, worker_id: str) -> None:
        """The registry dropped the worker: its lease lapsed, or it deregistered (having
        drained: nothing runs on it). Removed at once when nothing runs on it; else lapsed
        (the module's docstring) while it answers."""
        handle = self._workers.get(worker_id)
        if handle is None or not handle.in_flight:
            self.remove(worker_id)
            return
        self._lapsed[worker_id] = self._workers.pop(worker_id)
        log.warning(
            "worker %s left the registry with %d requests running: out of every choice; "
            "they go on while it answers",
            worker_id,
            handle.in_flight,
        )
        task = asyncio.get_running_loop().create_task(self._probe_lapsed(handle))
        self._probes.add(task)
        task.add_done_callback(self._probes.discard)

    async def _probe_lapsed(self, handle: WorkerHandle) -> None:
        outcome, why = "idle", "nothing runs on it any more"
        while _holds(self._lapsed, handle) and handle.in_flight:
            try:
                await handle.stub.Health(pb.HealthRequest(), timeout=PROBE_TIMEOUT_S)
            except (grpc.aio.AioRpcError, grpc.aio.UsageError) as e:
                code = e.code().name if isinstance(e, grpc.aio.AioRpcError) else str(e)
                outcome, why = "not_answering", f"it does not answer ({code})"
                break
            await asyncio.sleep(PROBE_INTERVAL_S)
        if _holds(self._lapsed, handle):
            log.warning("worker %s lapsed: %s", handle.worker_id, why)
            self.remove(handle.worker_id)
            self._lapse_ended(outcome)

    def _lapse_ended(self, outcome: str) -> None:
        for listener in self._lapse_listeners:
            listener(outcome)

    def _come_back(self, info: pb.WorkerInfo) -> WorkerHandle | None:
        """The lapsed worker `info` registers again: the same process serves on."""
        handle = self._lapsed.get(info.worker_id)
        if handle is None or not _same_process(handle.info, info):
            return None
        self._workers[info.worker_id] = self._lapsed.pop(info.worker_id)
        log.info(
            "worker %s registered again: its %d running requests stayed on it",
            info.worker_id,
            handle.in_flight,
        )
        self._lapse_ended("returned")
        return handle

    def lapsed(self) -> list[str]:
        """Workers the registry dropped whose running requests go on (`lapse`)."""
        return sorted(self._lapsed)

    def _known(self) -> list[WorkerHandle]:
        return [*self._workers.values(), *self._lapsed.values()]

    def remove(self, worker_id: str) -> None:
        handle = self._workers.pop(worker_id, None) or self._lapsed.pop(worker_id, None)
        if handle is None:
            return
        log.info("worker %s left", worker_id)
        self._forget_compatibility(worker_id)
        address = handle.info.grpc_address
        if all(w.info.grpc_address != address for w in self._known()):
            channel = self._channels.pop(address, None)
            if channel is not None:
                self._spawn_close(channel, _CHANNEL_CLOSE_GRACE)
        for listener in self._removal_listeners:
            listener(worker_id)

    def workers(self, role: int) -> list[WorkerHandle]:
        """Workers of `role` not suspended, ordered by worker_id (stable order for
        round-robin)."""
        return [w for w in self._serving() if w.role == role]

    def _serving(self) -> list[WorkerHandle]:
        """Every worker neither suspended nor changing role, by worker_id."""
        return [
            w
            for _, w in sorted(self._workers.items())
            if not self._is_suspended(w) and w.worker_id not in self._held
        ]

    def get(self, worker_id: str) -> WorkerHandle | None:
        return self._workers.get(worker_id)

    def compatible(self, prefill: WorkerHandle, decode: WorkerHandle) -> bool:
        """Whether `prefill` can write KV into `decode`'s pages (the mismatch is logged
        once per pair)."""
        key = (prefill.worker_id, decode.worker_id)
        known = self._compatible.get(key)
        if known is None:
            mismatch = layout_mismatch(prefill.info.layout, decode.info.layout)
            if mismatch is not None:
                log.warning(
                    "not pairing prefill %s with decode %s: KV layout mismatch: %s",
                    *key,
                    mismatch,
                )
            known = self._compatible[key] = mismatch is None
        return known

    def pd_pairs_exist(self) -> bool:
        decodes = self.workers(pb.DECODE)
        return any(self.compatible(p, d) for p in self.workers(pb.PREFILL) for d in decodes)

    def usable(self) -> bool:
        """At least one aggregated worker or one compatible prefill/decode pair."""
        return bool(self.workers(pb.BOTH)) or self.pd_pairs_exist()

    def channel_addresses(self) -> set[str]:
        """Addresses with an open channel (one per address, shared by its workers)."""
        return set(self._channels)

    def worker_ids(self) -> list[str]:
        """The workers requests may go to (suspended ones and those changing role are not)."""
        return [w.worker_id for w in self._serving()]

    def counts_by_role(self) -> dict[str, int]:
        counts = dict.fromkeys(ROLE_NAMES.values(), 0)
        for handle in self._serving():
            counts[ROLE_NAMES[handle.role]] += 1
        return counts

    async def close(self) -> None:
        for task in self._probes:
            task.cancel()
        self._workers.clear()
        self._lapsed.clear()
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            self._spawn_close(channel, None)
        if self._closing or self._probes:
            await asyncio.gather(*self._closing, *self._probes, return_exceptions=True)

    @property
    def capacity(self) -> int:
        """Requests the known workers run at once, by their registrations: the decode and
        aggregated workers' max_running_requests (0 when none reports it)."""
        return sum(
            w.info.capacity.max_running_requests
            for w in self._workers.values()
            if w.role in (pb.BOTH, pb.DECODE)
        )

    def _forget_compatibility(self, worker_id: str) -> None:
        self._compatible = {k: v for k, v in self._compatible.items() if worker_id not in k}

    def _spawn_close(self, channel: grpc.aio.Channel, grace: float | None) -> None:
        task = asyncio.get_running_loop().create_task(channel.close(grace))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)


def _holds(handles: dict[str, WorkerHandle], handle: WorkerHandle) -> bool:
    """Whether `handle` is the one `handles` has for its worker id (not another incarnation)."""
    return handles.get(handle.worker_id) is handle


def _same_process(known: pb.WorkerInfo, update: pb.WorkerInfo) -> bool:
    return known.grpc_address == update.grpc_address and known.incarnation == update.incarnation


def prefer(workers: list[WorkerHandle], avoid: set[str]) -> list[WorkerHandle]:
    """`workers` without those in `avoid`, unless that leaves none."""
    return [w for w in workers if w.worker_id not in avoid] or workers
