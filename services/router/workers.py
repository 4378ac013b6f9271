"""The workers the router may send requests to, and one gRPC channel per address.

The pool is fed membership events (from the bootstrap's Watch stream through
`MembershipWatcher`, or a static list in tests). A worker that leaves is no longer
offered to any policy, and its channel is closed once no remaining worker uses that
address. Requests already running on it fail on their own (the worker is gone).

A worker whose address refuses a connection is *suspended* at once (`suspend`): out of
every policy's choices and out of `/health`'s counts, before its lease lapses. It returns
when it registers again (a new incarnation on the same address is a new worker, with a new
channel: nothing meant for the old process reaches the new one) or, still registered,
after `SUSPENSION_S`: its heartbeats kept reaching the registry, so it lives. For as long
as a suspension runs, even once the lease lapsed, the pool *expects a return*: a request
that finds no worker waits for one (`wait_usable`) rather than failing, since a worker
restarted at once on its port comes back within seconds.

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
from dataclasses import dataclass

import grpc
import grpc.aio

from baton.common.rpc import baton_pb2 as pb
from baton.common.rpc import baton_pb2_grpc as pb_grpc
from baton.common.rpc.auth import make_channel
from baton.common.rpc.layout import layout_mismatch

log = logging.getLogger(__name__)

ROLE_NAMES = {pb.BOTH: "both", pb.PREFILL: "prefill", pb.DECODE: "decode"}

# Seconds a departed worker's channel stays open for calls still on it.
_CHANNEL_CLOSE_GRACE = 5.0

# Seconds a worker that refused a connection stays out of the choices unless it registers
# again: past a lease (5 s by default), so that a dead worker has left by then, and past a
# tiny-model decode worker's restart on a loaded 2-core machine (14 s from SIGKILL to its
# new registration, tests/integration/test_fault_decode_restart.py), so that requests wait
# for a worker restarted at once rather than fail.
SUSPENSION_S = 30.0


@dataclass(eq=False)
class WorkerHandle:
    """One known worker: its registration, a stub on the shared channel, and the router's
    own count of requests running on it."""

    info: pb.WorkerInfo
    stub: pb_grpc.WorkerStub
    channel: grpc.aio.Channel | None = None  # the address's channel, shared (None in tests)
    in_flight: int = 0
    # prompt tokens of requests placed on it local whose first token is not back yet: the
    # slack they will spend, before the worker's reports can show it (`Attempt.owe`)
    prompt_tokens_owed: int = 0

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    @property
    def role(self) -> int:
        return self.info.role

    @property
    def load(self) -> float:
        """Router-side in-flight requests plus the worker's last reported running + queued."""
        return self.in_flight + self.info.load.running + self.info.load.queued

    def peer(self) -> pb.PeerInfo:
        return pb.PeerInfo(
            worker_id=self.info.worker_id,
            kv_control_address=self.info.kv_control_address,
            transfer_address=self.info.transfer_address,
        )

    def refused(self) -> bool:
        """Whether the worker's channel failed to connect: its address refuses connections
        (the process is gone), as opposed to a call the worker itself failed."""
        if self.channel is None:
            return False
        return self.channel.get_state() == grpc.ChannelConnectivity.TRANSIENT_FAILURE


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
        self._joined = asyncio.Event()  # set (and replaced) whenever a worker joins
        self._workers: dict[str, WorkerHandle] = {}
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._compatible: dict[tuple[str, str], bool] = {}
        self._removal_listeners: list[Callable[[str], None]] = []
        self._join_listeners: list[Callable[[], None]] = []
        self._closing: set[asyncio.Task[None]] = set()

    def on_removed(self, listener: Callable[[str], None]) -> None:
        """Call `listener(worker_id)` whenever a worker leaves the pool."""
        self._removal_listeners.append(listener)

    def on_joined(self, listener: Callable[[], None]) -> None:
        """Call `listener()` whenever a worker joins or its registration changes."""
        self._join_listeners.append(listener)

    def apply(self, event: pb.MembershipEvent) -> None:
        """Follow one membership change (MembershipWatcher's on_change)."""
        if event.type == pb.MembershipEvent.REMOVED:
            self.remove(event.worker.worker_id)
        elif event.type in (pb.MembershipEvent.ADDED, pb.MembershipEvent.UPDATED):
            self.upsert(event.worker)

    def upsert(self, info: pb.WorkerInfo) -> None:
        if info.role not in ROLE_NAMES:
            log.warning("ignoring worker %s with unknown role %s", info.worker_id, info.role)
            return
        handle = self._workers.get(info.worker_id)
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
            for w in self._workers.values()
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
        if self._workers.get(handle.worker_id) is not handle or self._is_suspended(handle):
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

    def remove(self, worker_id: str) -> None:
        handle = self._workers.pop(worker_id, None)
        if handle is None:
            return
        log.info("worker %s left", worker_id)
        self._forget_compatibility(worker_id)
        address = handle.info.grpc_address
        if all(w.info.grpc_address != address for w in self._workers.values()):
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
        self._workers.clear()
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            self._spawn_close(channel, None)
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)

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


def _same_process(known: pb.WorkerInfo, update: pb.WorkerInfo) -> bool:
    return known.grpc_address == update.grpc_address and known.incarnation == update.incarnation


def prefer(workers: list[WorkerHandle], avoid: set[str]) -> list[WorkerHandle]:
    """`workers` without those in `avoid`, unless that leaves none."""
    return [w for w in workers if w.worker_id not in avoid] or workers
