"""Copies launched by the thread that sends the pages (ipc into a GPU pool, see workers):
they are queued at once, the final status waits until they landed, and a room that fails
while they run is released to D only after they landed.

On the CPU the ipc connection copies synchronously, so a connection stands in for a GPU
here: its `launch` records the calling thread and returns an "event" whose copy runs only
once the test opens a gate, as a copy queued behind a long step would.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from baton.common.transfer.backend import DataConnection, Outbound
from baton.common.transfer.base import Deadlines, KVPoll
from baton.common.transfer.control import ControlPlane
from baton.common.transfer.ipc import IpcBackend, IpcConnection
from baton.common.transfer.manager import TransferManager
from baton.common.transfer.messages import DataHello, KVLanded
from baton.common.transfer.regions import ByteBuffer
from baton.common.transfer.registry import register_backend
from baton.common.transfer.testing import kv_buffer, manager_pair, wait_for

pytestmark = pytest.mark.timeout(60)


class _Pending:
    """Stands in for a CUDA event: the copy happens once the gate opens."""

    def __init__(self, copy: Callable[[], None], gate: threading.Event):
        self._copy, self._gate, self._done = copy, gate, False
        self._lock = threading.Lock()

    def synchronize(self) -> None:
        assert self._gate.wait(20), "the test never opened the gate"
        with self._lock:
            if not self._done:
                self._copy()
                self._done = True


class _GatedConnection(IpcConnection):
    def __init__(self, plain: IpcConnection, owner: _GatedBackend):
        super().__init__(plain._target.bytes, plain._bells if owner.bells else None)
        self.launches = True
        self._owner = owner

    def launch(self, source: ByteBuffer, items: Sequence[Outbound], after: object) -> object:  # type: ignore[override]
        self._check(items)
        self._owner.launch_threads.append(threading.current_thread().name)
        if self._owner.launch_error is not None:
            raise self._owner.launch_error
        pending = _Pending(lambda: self._copy(source, items), self._owner.gate)
        self._owner.queued.append(pending)
        return pending

    def launch_ring(self, source: ByteBuffer, slot: int, room: int) -> bool:
        """As a copy stream would: ring once every copy queued before has run."""
        if not self.rings:
            return False
        before = list(self._owner.queued)

        def stream() -> None:
            for copy in before:
                copy.synchronize()
            self.ring(slot, room)

        threading.Thread(target=stream, daemon=True).start()
        return True


class _GatedBackend(IpcBackend):
    name = "gated-ipc"
    instances: list[_GatedBackend] = []

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.launch_threads: list[str] = []
        self.launch_error: Exception | None = None
        self.bells = False  # whether connections map D's doorbells
        self.queued: list[_Pending] = []  # every copy launched, in order
        _GatedBackend.instances.append(self)

    def connect(self, address: str, hello: DataHello) -> DataConnection:
        plain = super().connect(address, hello)
        assert isinstance(plain, IpcConnection)
        return _GatedConnection(plain, self)


@pytest.fixture
def gated() -> Iterator[None]:
    register_backend("gated-ipc", _GatedBackend)
    _GatedBackend.instances.clear()
    yield
    _GatedBackend.instances.clear()


DEADLINES = Deadlines(bootstrap_s=10, waiting_s=10, transferring_s=20)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte equality (random bytes make NaNs, which never equal themselves)."""
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _room(p, d, room: int, pages: list[int]):  # type: ignore[no-untyped-def]
    rx = d.create_receiver(room, p.control_address)
    rx.init(pages, prefix_pages=0)
    tx = p.create_sender(room, d.control_address)
    assert wait_for(lambda: tx.poll() == KVPoll.WaitingForInput)
    return tx, rx


@contextmanager
def _connected(
    bells: bool = False,
) -> Iterator[tuple[TransferManager, TransferManager, _GatedBackend, Any, Any]]:
    """A pair over the gated backend whose lane has connected: a first room went through
    it (pushed by the lane, nothing launched); later rooms' copies are the sender's."""
    src, page_bytes = kv_buffer(32, 4, seed=1)
    dst, _ = kv_buffer(32, 4, seed=None)
    with manager_pair("gated-ipc", src, dst, page_bytes, deadlines=DEADLINES, token="t") as (p, d):
        sender_side = _GatedBackend.instances[0]
        sender_side.bells = bells
        sender_side.gate.set()
        tx, rx = _room(p, d, 1, [0, 1])
        tx.send([4, 5], 0)
        tx.finish(b"a")
        assert wait_for(lambda: rx.poll() == KVPoll.Success)
        assert sender_side.launch_threads == []
        yield p, d, sender_side, src, dst


def test_the_sender_thread_launches_and_the_status_waits_for_the_copies(gated: None) -> None:
    with _connected() as (p, d, sender_side, src, dst):
        sender_side.gate.clear()
        tx, rx = _room(p, d, 2, [8, 9, 10])
        tx.send([12, 13], 0)
        tx.send([20], 2)
        tx.finish(b"b")
        # Both sends were launched here, in the caller's thread, as they were sent.
        assert sender_side.launch_threads == [threading.current_thread().name] * 2
        time.sleep(0.2)
        assert not rx.poll().terminal  # no final status before the copies landed
        assert same(dst[8:11], torch.zeros_like(dst[8:11]))  # nothing landed yet
        sender_side.gate.set()
        assert wait_for(lambda: rx.poll() == KVPoll.Success)
        assert same(dst[8:10], src[12:14]) and same(dst[10], src[20])
        assert rx.aux == b"b"
        assert p.stats()["sends_launched"] == 2


def test_a_room_failing_mid_copy_is_released_only_after_its_copies_landed(gated: None) -> None:
    with _connected() as (p, d, sender_side, src, dst):
        sender_side.gate.clear()
        tx, rx = _room(p, d, 2, [4, 5])
        tx.send([6, 7], 0)  # launched, not landed
        tx.abort("client went away")
        assert wait_for(lambda: rx.poll() == KVPoll.Failed)
        time.sleep(0.2)
        assert not rx.reusable  # P's copy may still land in these pages
        sender_side.gate.set()
        assert wait_for(lambda: rx.reusable)
        assert same(dst[4:6], src[6:8])  # what landed, landed before the release


def test_a_launch_that_fails_leaves_the_copies_to_the_lane(gated: None) -> None:
    """An error while launching is not the scheduler's: the lane pushes the pages itself."""
    with _connected() as (p, d, sender_side, src, dst):
        sender_side.launch_error = RuntimeError("CUDA error: out of resources")
        tx, rx = _room(p, d, 2, [4, 5])
        tx.send([6, 7], 0)  # does not raise here
        tx.finish(b"c")
        assert wait_for(lambda: rx.poll() == KVPoll.Success)
        assert same(dst[4:6], src[6:8])
        assert len(sender_side.launch_threads) == 1 and "sends_launched" not in p.stats()


def test_with_doorbells_the_status_leaves_at_once_and_the_bell_follows_the_copies(
    gated: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The final status reaches D while the copies wait; D succeeds only once they ran and
    the bell queued behind them rang (P's KVLanded is dropped: the bell alone says it)."""
    send = ControlPlane.send
    monkeypatch.setattr(
        ControlPlane,
        "send",
        lambda self, peer, m: None if isinstance(m, KVLanded) else send(self, peer, m),
    )
    with _connected(bells=True) as (p, d, sender_side, src, dst):
        sender_side.gate.clear()
        direct_before = d.stats().get("direct_rooms", 0)
        tx, rx = _room(p, d, 2, [8, 9, 10])
        tx.send([12, 13], 0)
        tx.send([20], 2)
        tx.finish(b"b")
        # The status arrived and its regions were checked, before any copy ran.
        assert wait_for(lambda: d.stats().get("direct_rooms", 0) == direct_before + 1)
        time.sleep(0.2)
        assert not rx.poll().terminal
        assert same(dst[8:11], torch.zeros_like(dst[8:11]))
        sender_side.gate.set()
        assert wait_for(lambda: rx.poll() == KVPoll.Success)
        assert same(dst[8:10], src[12:14]) and same(dst[10], src[20])
        assert rx.aux == b"b" and d.stats()["rooms_belled"] == 1
