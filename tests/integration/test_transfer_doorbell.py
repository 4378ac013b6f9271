"""Doorbells (ipc, same host): the final status leaves before the writes land, and D's room
succeeds once its bell rings, with no message after the copies (see transfer/doorbell).
Here P and D are two managers over memfd pools, as workers on one host without a GPU are."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch

from baton.common.transfer.base import Deadlines, KVPoll
from baton.common.transfer.control import ControlPlane
from baton.common.transfer.doorbell import Doorbells
from baton.common.transfer.ipc import IpcConnection
from baton.common.transfer.messages import ControlMessage, KVDone, KVInit, KVLanded
from baton.common.transfer.receiver import ReceiverRoom
from baton.common.transfer.room import RoomServices, TransferStats
from baton.common.transfer.testing import kv_buffer, manager_pair, wait_for

pytestmark = pytest.mark.timeout(60)

DEADLINES = Deadlines(bootstrap_s=10, waiting_s=10, transferring_s=20)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _drop_landed(monkeypatch: pytest.MonkeyPatch) -> None:
    """P's KVLanded never reaches D: only the bell can tell it the pages landed."""
    send = ControlPlane.send

    def without_landed(self: ControlPlane, peer: str, message: ControlMessage) -> None:
        if not isinstance(message, KVLanded):
            send(self, peer, message)

    monkeypatch.setattr(ControlPlane, "send", without_landed)


def _handoffs(backend: str, rooms: int) -> tuple[dict, dict, list[bool]]:  # type: ignore[type-arg]
    """`rooms` handoffs one after another, each of two page runs; returns both sides'
    statistics and whether each room's pages arrived intact."""
    src, page_bytes = kv_buffer(64, 4, seed=3)
    dst, _ = kv_buffer(64, 4, seed=None)
    intact = []
    with manager_pair(backend, src, dst, page_bytes, deadlines=DEADLINES, token="t") as (p, d):
        for r in range(rooms):
            rx = d.create_receiver(100 + r, p.control_address)
            pages = [2 * r, 2 * r + 1, 40 + r]
            rx.init(pages, prefix_pages=0)
            tx = p.create_sender(100 + r, d.control_address)
            assert wait_for(lambda tx=tx: tx.poll() == KVPoll.WaitingForInput)
            tx.send([10 + r, 11 + r], 0)
            tx.send([50], 2)
            tx.finish(b"tok%d" % r)
            assert wait_for(lambda rx=rx: rx.poll() == KVPoll.Success), rx.failure_reason
            assert rx.aux == b"tok%d" % r
            ok = same(dst[pages[0] : pages[1] + 1], src[10 + r : 12 + r])
            intact.append(ok and same(dst[40 + r], src[50]))
            rx.release()
            tx.release()
        return p.stats(), d.stats(), intact


@pytest.mark.parametrize("backend", ["ipc", "auto"])
def test_the_bell_alone_completes_rooms(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With every KVLanded dropped, rooms still succeed, with their pages intact: the bell
    said they landed. The first room goes the old way (its lane connects meanwhile)."""
    _drop_landed(monkeypatch)
    _p, d, intact = _handoffs(backend, rooms=5)
    assert all(intact)
    assert d["rooms_ok"] == 5
    assert d["rooms_belled"] >= 4


def test_without_a_bell_kvlanded_completes_rooms(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bell that never rings costs latency, never the room."""
    monkeypatch.setattr(IpcConnection, "ring", lambda self, slot, room: None)
    _p, d, intact = _handoffs("ipc", rooms=3)
    assert all(intact) and d["rooms_ok"] == 3
    assert "rooms_belled" not in d


def test_a_bell_that_never_rings_and_no_kvlanded_fail_the_room_by_its_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An early status whose landing is never confirmed does not hang D's room: once P no
    longer holds the room, its Transferring deadline fails it."""
    lost: list[bool] = []  # once set: no bell rings and no KVLanded arrives
    send = ControlPlane.send

    def maybe_lost(self: ControlPlane, peer: str, message: ControlMessage) -> None:
        if not (lost and isinstance(message, KVLanded)):
            send(self, peer, message)

    monkeypatch.setattr(ControlPlane, "send", maybe_lost)
    ring = IpcConnection.ring
    monkeypatch.setattr(IpcConnection, "ring", lambda c, s, r: None if lost else ring(c, s, r))
    src, page_bytes = kv_buffer(16, 4, seed=3)
    dst, _ = kv_buffer(16, 4, seed=None)
    short = Deadlines(bootstrap_s=10, waiting_s=10, transferring_s=1.0)
    with manager_pair("ipc", src, dst, page_bytes, deadlines=short, token="t") as (p, d):
        states = []
        for room in (1, 2):  # the first connects the lane; the second announces
            if room == 2:
                lost.append(True)
            rx = d.create_receiver(room, p.control_address)
            rx.init([2 * room, 2 * room + 1], prefix_pages=0)
            tx = p.create_sender(room, d.control_address)
            assert wait_for(lambda tx=tx: tx.poll() == KVPoll.WaitingForInput)
            tx.send([8, 9], 0)
            tx.finish(b"x")
            assert wait_for(lambda rx=rx: rx.poll().terminal, timeout=10)
            states.append((rx.poll(), rx.failure_reason))
        assert states[0] == (KVPoll.Success, None)
        assert p.stats()["rooms_announced"] >= 1
        assert states[1][0] == KVPoll.Failed
        assert "deadline in Transferring" in (states[1][1] or "")


def _services(send_control: Callable[[str, ControlMessage], None]) -> RoomServices:
    return RoomServices(
        token="t",
        page_bytes=16,
        num_pages=8,
        checksum=False,
        deadlines=DEADLINES,
        stats=TransferStats(),
        send_control=send_control,
        forget=lambda _room: None,
    )


def _receiver(doorbells: Doorbells | None) -> tuple[ReceiverRoom, list[ControlMessage]]:
    sent: list[ControlMessage] = []
    services = _services(lambda _peer, message: sent.append(message))
    rx = ReceiverRoom(7, "p:1", services, "ipc:x", accepts_direct=True, doorbells=doorbells)
    rx.init([2, 3])
    return rx, sent


def _early_done(room: int = 7) -> KVDone:
    return KVDone(room, "t", 2, b"a", [(32, 32, None)], landed=False)


def test_an_early_status_waits_for_the_rooms_own_bell() -> None:
    bells = Doorbells(slots=4)
    rx, sent = _receiver(bells)
    init = sent[0]
    assert isinstance(init, KVInit) and 0 <= init.bell < 4
    rx.on_done(_early_done())
    assert rx.poll() == KVPoll.Transferring  # every page claimed, none known landed
    bells._words[init.bell] = 9  # another room's ring (a reused slot): not ours
    time.sleep(0.01)
    assert rx.poll() == KVPoll.Transferring
    bells._words[init.bell] = 7
    assert rx.poll() == KVPoll.Success and rx.aux == b"a"


def test_kvlanded_completes_an_early_status_without_the_bell() -> None:
    rx, _sent = _receiver(Doorbells(slots=4))
    rx.on_done(_early_done())
    assert rx.poll() == KVPoll.Transferring
    rx.on_landed()
    assert rx.poll() == KVPoll.Success


@pytest.mark.parametrize(
    ("doorbells", "done"),
    [
        pytest.param(None, _early_done(), id="without-doorbells"),
        pytest.param(
            Doorbells(slots=4), KVDone(7, "t", 2, None, None, landed=False), id="without-regions"
        ),
    ],
)
def test_an_early_status_that_cannot_be_checked_fails_the_room(
    doorbells: Doorbells | None, done: KVDone
) -> None:
    rx, _sent = _receiver(doorbells)
    rx.on_done(done)
    assert rx.poll() == KVPoll.Failed
    assert "early final status" in (rx.failure_reason or "")


def test_a_final_status_that_answers_the_init_at_once_lands() -> None:
    """P may write the pages and send KVDone before D's thread returns from `init` (the
    control thread delivers it): the room was waiting for it, not bootstrapping."""
    rx: ReceiverRoom | None = None

    def answer_at_once(_peer: str, message: ControlMessage) -> None:
        if isinstance(message, KVInit) and rx is not None:
            rx.on_done(KVDone(7, "t", 2, b"a", [(32, 32, None)], landed=True))

    rx = ReceiverRoom(
        7, "p:1", _services(answer_at_once), "ipc:x", accepts_direct=True, doorbells=None
    )
    rx.init([2, 3])
    assert rx.poll() == KVPoll.Success, rx.failure_reason
    assert rx.aux == b"a"
