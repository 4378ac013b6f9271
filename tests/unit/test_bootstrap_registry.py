"""The membership registry's lease logic, driven by a fake clock (no gRPC, no sleeping)."""

from __future__ import annotations

import asyncio

import pytest

from baton.common.rpc import baton_pb2 as pb
from baton.common.rpc.layout import layout_mismatch
from baton.services.bootstrap import registry as registry_module
from baton.services.bootstrap.registry import (
    LayoutMismatchError,
    RegistrationError,
    Registry,
)

TTL = 1.0
ADDED, UPDATED, REMOVED, SYNCED = (
    pb.MembershipEvent.ADDED,
    pb.MembershipEvent.UPDATED,
    pb.MembershipEvent.REMOVED,
    pb.MembershipEvent.SYNCED,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def layout(**overrides: object) -> pb.KVLayout:
    fields: dict[str, object] = {
        "model": "tiny",
        "page_size": 16,
        "dtype": "bfloat16",
        "num_layers": 2,
        "num_kv_heads": 4,
        "head_dim": 8,
        "tp_size": 1,
    }
    fields.update(overrides)
    return pb.KVLayout(**fields)  # type: ignore[arg-type]


def worker(worker_id: str, role: pb.Role = pb.PREFILL, **layout_overrides: object) -> pb.WorkerInfo:
    return pb.WorkerInfo(
        worker_id=worker_id,
        role=role,
        grpc_address=f"127.0.0.1:{9000 + len(worker_id)}",
        layout=layout(**layout_overrides),
    )


def drain(queue: asyncio.Queue[pb.MembershipEvent | None]) -> list[tuple[int, str]]:
    events = []
    while not queue.empty():
        event = queue.get_nowait()
        events.append((-1, "") if event is None else (event.type, event.worker.worker_id))
    return events


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def registry(clock: FakeClock) -> Registry:
    return Registry(lease_ttl=TTL, clock=clock)


def test_registered_worker_is_listed_and_filtered_by_role(registry: Registry) -> None:
    registry.register(worker("p0", pb.PREFILL))
    registry.register(worker("d0", pb.DECODE))
    assert [w.worker_id for w in registry.list()] == ["d0", "p0"]
    assert [w.worker_id for w in registry.list(pb.DECODE)] == ["d0"]
    assert [w.worker_id for w in registry.list(pb.ROLE_UNSPECIFIED)] == ["d0", "p0"]


def test_lapsed_lease_removes_worker_and_tells_watchers(
    registry: Registry, clock: FakeClock
) -> None:
    registry.register(worker("p0"))
    watcher = registry.subscribe()
    assert drain(watcher) == [(ADDED, "p0"), (SYNCED, "")]

    clock.advance(TTL * 0.9)
    assert registry.expire() == []
    clock.advance(TTL * 0.2)
    assert registry.expire() == ["p0"]
    assert registry.list() == []
    assert drain(watcher) == [(REMOVED, "p0")]


def test_heartbeats_keep_a_worker_alive_past_its_ttl(registry: Registry, clock: FakeClock) -> None:
    lease = registry.register(worker("p0"))
    for _ in range(10):
        clock.advance(TTL * 0.6)
        assert registry.heartbeat(lease, "p0", pb.Load(running=1))
    assert registry.expire() == []
    assert [w.worker_id for w in registry.list()] == ["p0"]


def test_heartbeat_after_lapse_is_unknown_even_before_a_sweep(
    registry: Registry, clock: FakeClock
) -> None:
    lease = registry.register(worker("p0"))
    clock.advance(TTL * 1.5)
    assert not registry.heartbeat(lease, "p0")
    assert registry.list() == []


def test_a_stalled_registry_expires_nobody_when_it_resumes(clock: FakeClock) -> None:
    # A bootstrap frozen (SIGSTOP, a VM pause) past the ttl: its sweeps stop, the workers'
    # heartbeats go unheard. On resume, the first call (a heartbeat here) must not expire
    # anyone; each lease gets a full ttl for the heartbeats the workers keep sending.
    sweep = TTL / 4
    registry = Registry(lease_ttl=TTL, clock=clock, sweep_period=sweep)
    first, second = registry.register(worker("p0")), registry.register(worker("d0", pb.DECODE))
    watcher = registry.subscribe()
    drain(watcher)
    clock.advance(sweep)
    registry.expire()  # the sweep ran on time
    clock.advance(TTL * 10)  # frozen
    assert registry.heartbeat(first, "p0")
    for _ in range(3):  # the sweep runs again; d0's heartbeat comes late in its ttl
        clock.advance(sweep)
        assert registry.heartbeat(first, "p0")
        assert registry.expire() == []
    assert registry.heartbeat(second, "d0")
    assert drain(watcher) == []
    assert registry.stalls == 1
    # A worker that died during the stall is removed a ttl after the resume, not never.
    for _ in range(5):
        clock.advance(sweep)
        registry.heartbeat(first, "p0")
    assert [w.worker_id for w in registry.list()] == ["p0"]
    assert drain(watcher) == [(REMOVED, "d0")]
    assert registry.stalls == 1


def test_without_a_sweep_a_quiet_spell_is_no_stall(registry: Registry, clock: FakeClock) -> None:
    # No sweep_period: nothing runs between calls, so a long gap proves no stall.
    registry.register(worker("p0"))
    clock.advance(TTL * 10)
    assert registry.expire() == ["p0"]


def test_heartbeat_load_change_is_published(registry: Registry) -> None:
    lease = registry.register(worker("p0"))
    watcher = registry.subscribe()
    drain(watcher)
    registry.heartbeat(lease, "p0", pb.Load(running=3, queued=1, token_usage=0.5))
    registry.heartbeat(lease, "p0", pb.Load(running=3, queued=1, token_usage=0.5))
    assert drain(watcher) == [(UPDATED, "p0")]  # unchanged load: no second event
    assert registry.list()[0].load.running == 3


def test_reregistering_replaces_the_old_entry_and_lease(registry: Registry) -> None:
    old_lease = registry.register(worker("p0"))
    watcher = registry.subscribe()
    drain(watcher)
    moved = worker("p0")
    moved.grpc_address = "127.0.0.1:1234"
    new_lease = registry.register(moved)

    assert drain(watcher) == [(UPDATED, "p0")]
    assert [w.grpc_address for w in registry.list()] == ["127.0.0.1:1234"]
    assert not registry.heartbeat(old_lease, "p0")
    # A stale process holding the old lease cannot remove its successor.
    assert not registry.deregister(old_lease, "p0")
    assert registry.heartbeat(new_lease, "p0")
    assert registry.deregister(new_lease, "p0")
    assert registry.list() == []
    assert drain(watcher) == [(REMOVED, "p0")]


def test_unknown_lease_heartbeat_is_not_known(registry: Registry) -> None:
    assert not registry.heartbeat("nope", "p0")


@pytest.mark.parametrize(
    "info",
    [
        pb.WorkerInfo(role=pb.PREFILL, grpc_address="h:1"),
        pb.WorkerInfo(worker_id="x", grpc_address="h:1"),
        pb.WorkerInfo(worker_id="x", role=pb.DECODE),
        pb.WorkerInfo(worker_id="x" * 300, role=pb.DECODE, grpc_address="h:1"),
    ],
)
def test_incomplete_registration_is_refused(registry: Registry, info: pb.WorkerInfo) -> None:
    with pytest.raises(RegistrationError):
        registry.register(info)


def test_decode_with_a_different_kv_layout_than_prefill_is_refused(registry: Registry) -> None:
    registry.register(worker("p0", pb.PREFILL, page_size=16))
    with pytest.raises(LayoutMismatchError, match=r"p0: page_size 1 != 16"):
        registry.register(worker("d0", pb.DECODE, page_size=1))
    # Tensor parallelism may differ; aggregated workers exchange no KV.
    registry.register(worker("d1", pb.DECODE, tp_size=4))
    registry.register(worker("b0", pb.BOTH, page_size=1))
    assert [w.worker_id for w in registry.list()] == ["b0", "d1", "p0"]


def test_layout_mismatch_names_every_differing_field_but_tp_size() -> None:
    a = layout(page_size=16, dtype="float32", tp_size=1)
    b = layout(page_size=1, dtype="bfloat16", tp_size=2)
    assert layout_mismatch(a, b) == "page_size 16 != 1; dtype float32 != bfloat16"
    assert layout_mismatch(a, layout(dtype="float32", tp_size=8)) is None


def test_watcher_far_behind_is_dropped(registry: Registry, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry_module, "MAX_PENDING_EVENTS", 3)
    slow = registry.subscribe()  # holds SYNCED
    for i in range(4):
        registry.register(worker(f"p{i}"))
    # Emptied and told to end: the client resubscribes and gets a fresh snapshot.
    assert drain(slow) == [(-1, "")]
    fresh = registry.subscribe()
    assert len(drain(fresh)) == 5  # 4 ADDED + SYNCED


def test_unsubscribed_watcher_gets_nothing(registry: Registry) -> None:
    watcher = registry.subscribe()
    drain(watcher)
    registry.unsubscribe(watcher)
    registry.register(worker("p0"))
    assert drain(watcher) == []
