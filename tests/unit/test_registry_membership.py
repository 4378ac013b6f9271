"""The registry loops (membership.py, watcher.py) against a scripted store: what the view and its
listeners see for each kind of watch item, and where a resumed watch starts."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from baton.common.rpc import baton_pb2 as pb
from baton.services.registry.base import (
    Change,
    Lease,
    Progress,
    Registry,
    RegistryUnavailable,
    Snapshot,
    WatchItem,
)
from baton.services.registry.membership import WorkerRegistration
from baton.services.registry.watcher import MembershipWatcher

ADDED, UPDATED, REMOVED = (
    pb.MembershipEvent.ADDED,
    pb.MembershipEvent.UPDATED,
    pb.MembershipEvent.REMOVED,
)


def worker(worker_id: str, kv: str = "") -> pb.WorkerInfo:
    return pb.WorkerInfo(worker_id=worker_id, role=pb.DECODE, kv_control_address=kv)


class ScriptedRegistry(Registry):
    """Each watch() call plays the next script, then loses the store."""

    address = "scripted://"

    def __init__(self, scripts: list[list[WatchItem]]) -> None:
        self.scripts = scripts
        self.watched_after: list[int] = []
        self.calls: list[str] = []
        self.known = True

    async def register(self, info: pb.WorkerInfo) -> Lease:
        self.calls.append("register")
        await asyncio.sleep(0.05)  # a call in flight when stop() comes
        return Lease("l1", info.worker_id, 3.0)

    async def keepalive(self, lease: Lease) -> bool:
        self.calls.append("keepalive")
        return self.known

    async def update(self, lease: Lease, info: pb.WorkerInfo) -> bool:
        self.calls.append(f"update running={info.load.running}")
        return self.known

    async def deregister(self, lease: Lease) -> None:
        self.calls.append(f"deregister {lease.id}")

    async def snapshot(self) -> Snapshot:
        raise NotImplementedError

    async def watch(self, after: int) -> AsyncIterator[WatchItem]:
        self.watched_after.append(after)
        if self.scripts:
            for item in self.scripts.pop(0):
                yield item
        await asyncio.sleep(0.01)
        raise RegistryUnavailable("scripted outage")

    async def close(self) -> None:
        pass


async def until(predicate, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.005)


async def test_a_watch_resumes_after_the_last_revision_and_keeps_the_view() -> None:
    registry = ScriptedRegistry(
        [
            [Snapshot((worker("a", "kv-a"), worker("b")), 10), Change(UPDATED, worker("b"), 12)],
            [Progress(12), Change(REMOVED, pb.WorkerInfo(worker_id="a"), 15)],
        ]
    )
    events: list[tuple[int, str, str]] = []
    watcher = MembershipWatcher(
        registry,
        lambda e: events.append((e.type, e.worker.worker_id, e.worker.kv_control_address)),
        max_backoff=0.01,
    )
    async with watcher:
        await until(lambda: len(registry.watched_after) >= 3)
    # after=0 first (a snapshot), then after the last revision delivered each time
    assert registry.watched_after[:3] == [0, 12, 15]
    # a REMOVED event carries the member as the view knew it (its KV address, for peers)
    assert events == [
        (ADDED, "a", "kv-a"),
        (ADDED, "b", ""),
        (UPDATED, "b", ""),
        (REMOVED, "a", "kv-a"),
    ]
    assert [w.worker_id for w in watcher.members()] == ["b"]  # the last view stays readable


async def test_a_snapshot_from_a_replaced_store_resets_the_revision() -> None:
    registry = ScriptedRegistry(
        [[Snapshot((worker("a"),), 500)], [Snapshot((worker("b"),), 3)], []]
    )
    events: list[tuple[int, str]] = []
    watcher = MembershipWatcher(
        registry, lambda e: events.append((e.type, e.worker.worker_id)), max_backoff=0.01
    )
    async with watcher:
        await until(lambda: len(registry.watched_after) >= 3)
    assert registry.watched_after[:3] == [0, 500, 3]
    assert events[0] == (ADDED, "a") and (ADDED, "b") in events


async def test_connected_only_while_the_watch_is_live() -> None:
    registry = ScriptedRegistry([[Snapshot((), 1)]])
    watcher = MembershipWatcher(registry, max_backoff=5.0)
    async with watcher:
        await watcher.wait_synced(timeout=5)
        await until(lambda: not watcher.connected)  # the scripted outage


async def test_registration_publishes_load_changes_and_renews_otherwise() -> None:
    registry = ScriptedRegistry([])
    loads = iter([0, 0, 1, 1, 1] + [1] * 1000)
    registration = WorkerRegistration(
        registry, worker("w"), 0.01, lambda: pb.Load(running=next(loads))
    )
    async with registration:
        await registration.wait_registered(timeout=5)
        await until(lambda: len(registry.calls) >= 5)
    assert registry.calls[:4] == ["register", "keepalive", "update running=1", "keepalive"]
    assert registry.calls[-1] == "deregister l1"


async def test_a_lost_lease_registers_again_and_stop_deregisters_a_call_in_flight() -> None:
    registry = ScriptedRegistry([])
    registration = WorkerRegistration(registry, worker("w"), 0.01)
    await registration.start()
    await registration.wait_registered(timeout=5)
    registry.known = False  # the store forgot the lease
    await until(lambda: registry.calls.count("register") == 2)
    registry.known = True
    await registration.stop()  # while that second register is in flight
    assert registry.calls[-1] == "deregister l1"
    assert registration.lease is None


class LeasingRegistry(ScriptedRegistry):
    """A store that grants a new lease at each registration and remembers the records."""

    def __init__(self) -> None:
        super().__init__([])
        self.records: dict[str, pb.WorkerInfo] = {}
        self.leases = 0

    async def register(self, info: pb.WorkerInfo) -> Lease:
        self.leases += 1
        self.calls.append(f"register {pb.Role.Name(info.role)} l{self.leases}")
        self.records[info.worker_id] = info
        return Lease(f"l{self.leases}", info.worker_id, 3.0)

    async def keepalive(self, lease: Lease) -> bool:
        self.calls.append(f"keepalive {lease.id}")
        return True


async def test_republish_registers_the_new_role_at_once_and_gives_the_old_lease_back() -> None:
    """A worker that changed role in place (SetRole): its new record is in the store now,
    under a new lease; the old lease is given back and the loop renews the new one."""
    registry = LeasingRegistry()
    registration = WorkerRegistration(registry, worker("w", kv="tcp://a:1"), 0.02)
    await registration.start()
    try:
        await registration.wait_registered(1.0)
        changed = pb.WorkerInfo()
        changed.CopyFrom(registration.info)
        changed.role, changed.kv_control_address = pb.PREFILL, "tcp://a:2"
        await registration.republish(changed)
        assert registration.lease is not None and registration.lease.id == "l2"
        assert registry.records["w"].role == pb.PREFILL
        assert registry.records["w"].kv_control_address == "tcp://a:2"
        assert registry.calls[:1] == ["register DECODE l1"]
        i = registry.calls.index("register PREFILL l2")
        assert registry.calls[i + 1] == "deregister l1"
        await asyncio.sleep(0.1)
        assert "keepalive l2" in registry.calls[i:] and "keepalive l1" not in registry.calls[i:]
    finally:
        await registration.stop()
    assert registry.calls[-1] == "deregister l2"
