"""A worker in the cluster's membership: what it registers (`worker_info`), its
registration with heartbeats that carry its load (`register`), and the watch of its peers
that tells its scheduler when one is lost (`watch_peers`)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time

from baton.common.config import ModelConfig
from baton.common.protocol import ReadyOut
from baton.common.rpc import baton_pb2 as pb
from baton.common.rpc.convert import load_to_proto
from baton.services.registry.base import Registry
from baton.services.registry.membership import WorkerRegistration
from baton.services.registry.watcher import MembershipWatcher
from baton.services.worker.config import WorkerConfig
from baton.services.worker.metrics import WorkerMetrics
from baton.services.worker.scheduler_link import SchedulerGone, SchedulerLink

__all__ = ["PB_ROLE", "first_stats", "register", "watch_peers", "worker_info"]

PB_ROLE = {"both": pb.Role.BOTH, "prefill": pb.Role.PREFILL, "decode": pb.Role.DECODE}


def worker_info(
    config: WorkerConfig,
    model_cfg: ModelConfig,
    worker_id: str,
    addresses: tuple[str, str],
    ready: ReadyOut,
    incarnation: str,
) -> pb.WorkerInfo:
    """What the worker registers: its (gRPC, HTTP) `addresses`, its KV planes' (from its
    scheduler's `ready`), its capacity and its KV layout."""
    cfg = config.engine
    return pb.WorkerInfo(
        worker_id=worker_id,
        role=PB_ROLE[config.role],
        grpc_address=addresses[0],
        http_address=addresses[1],
        kv_control_address=ready.kv_control_address,
        transfer_address=ready.transfer_address,
        transfer_backend=config.transfer.backend,
        incarnation=incarnation,
        capacity=pb.Capacity(
            max_running_requests=cfg.max_running_requests,
            num_pages=ready.num_pages,
            page_size=cfg.page_size,
        ),
        layout=pb.KVLayout(
            model=os.path.basename(os.path.normpath(cfg.model_path)),
            page_size=cfg.page_size,
            dtype=cfg.dtype,
            num_layers=model_cfg.num_layers,
            num_kv_heads=model_cfg.num_kv_heads,
            head_dim=model_cfg.head_dim,
            tp_size=cfg.tp_size,
        ),
    )


async def register(
    registry: Registry,
    info: pb.WorkerInfo,
    config: WorkerConfig,
    link: SchedulerLink,
    metrics: WorkerMetrics,
) -> tuple[WorkerRegistration, MembershipWatcher]:
    """Registered, once the scheduler's first stats give a load to report, with heartbeats
    carrying its latest; and the watch of its peers."""

    def load() -> pb.Load:
        s = link.stats
        return pb.Load() if s is None else load_to_proto(s)

    await first_stats(link)
    registration = WorkerRegistration(registry, info, config.heartbeat_interval, load)
    await registration.start()
    metrics.registry_registered.set_function(lambda: float(registration.registered))
    # Every role watches its peers: an aggregated worker may become a prefill or a
    # decode worker in place (SetRole); the aggregated role ignores lost peers.
    watcher = watch_peers(registry, link)
    await watcher.start()
    return registration, watcher


async def first_stats(link: SchedulerLink, timeout: float = 2.0) -> None:
    """Wait (bounded) for the scheduler's first stats, so that the registration carries
    the worker's load and what it has (its prefix cache): a router that pre-copies a
    migration only to a target with a prefix cache would otherwise see none until the
    first heartbeat."""
    deadline = time.monotonic() + timeout
    while link.stats is None and time.monotonic() < deadline:
        await asyncio.sleep(0.02)


def watch_peers(registry: Registry, link: SchedulerLink) -> MembershipWatcher:
    """Tell the scheduler when a peer is lost, so rooms bound to it fail at once: its lease
    lapsed, or its KV-control address now belongs to a new incarnation (a restart)."""
    from baton.common.protocol import PeerLostReq

    incarnations: dict[str, str] = {}  # KV-control address -> incarnation seen there
    addresses: dict[str, str] = {}  # worker id -> its KV-control address

    async def tell(address: str) -> None:
        with contextlib.suppress(SchedulerGone):
            await link.send(PeerLostReq(address))

    def lost(address: str) -> None:
        task = asyncio.create_task(tell(address))
        _peer_tasks.add(task)
        task.add_done_callback(_peer_tasks.discard)

    def on_change(event: pb.MembershipEvent) -> None:
        address = event.worker.kv_control_address
        worker_id = event.worker.worker_id
        before = addresses.pop(worker_id, None)
        if before and before != address:  # it changed role in place: its old manager is gone
            incarnations.pop(before, None)
            lost(before)
        if not address:
            return
        if event.type == pb.MembershipEvent.Type.REMOVED:
            incarnations.pop(address, None)
            lost(address)
            return
        addresses[worker_id] = address
        previous = incarnations.get(address)
        incarnations[address] = event.worker.incarnation
        if previous is not None and previous != event.worker.incarnation:
            lost(address)

    return MembershipWatcher(registry, on_change)


_peer_tasks: set[asyncio.Task[None]] = set()
