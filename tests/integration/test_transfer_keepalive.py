"""Rooms wait as long as both sides hold them (back-pressure is not a fault), a room the
peer never heard of still fails at its deadline, and with direct writes (ipc) D reuses a
failed room's pages only once P has released the room."""

from __future__ import annotations

import time

import pytest

from baton.common.transfer import receiver as receiver_module
from baton.common.transfer.base import Deadlines, KVPoll
from baton.common.transfer.testing import kv_buffer, manager_pair, wait_for

pytestmark = pytest.mark.timeout(60)

SHORT = Deadlines(bootstrap_s=0.6, waiting_s=0.6, transferring_s=5)


def test_a_room_both_sides_hold_outlives_its_deadline() -> None:
    src, page_bytes = kv_buffer(8, 4)
    dst, _ = kv_buffer(8, 4, seed=None)
    with manager_pair("tcp", src, dst, page_bytes, deadlines=SHORT) as (p, d):
        receiver = d.create_receiver(1, p.control_address)  # D's pool is full: no init yet
        sender = p.create_sender(1, d.control_address)
        orphan = p.create_sender(2, d.control_address)  # D never heard of room 2
        time.sleep(2.0)  # more than three deadlines
        assert receiver.poll() == KVPoll.Bootstrapping
        assert sender.poll() == KVPoll.Bootstrapping
        assert orphan.poll() == KVPoll.Failed
        assert orphan.failure_reason == "deadline in Bootstrapping"
        receiver.init([0, 1])  # room at last: the handoff completes
        assert wait_for(lambda: sender.poll() == KVPoll.WaitingForInput)
        sender.send([4, 5], 0)
        sender.finish(b"tok")
        assert wait_for(lambda: receiver.poll() == KVPoll.Success)


def test_direct_writes_keep_a_failed_rooms_pages_until_p_releases_it(monkeypatch) -> None:
    src, page_bytes = kv_buffer(16, 4)
    dst, _ = kv_buffer(16, 4, seed=None)
    with manager_pair("ipc", src, dst, page_bytes, deadlines=Deadlines(5, 5, 5)) as (p, d):
        receiver = d.create_receiver(7, p.control_address)
        receiver.init([3, 4, 5, 6])
        sender = p.create_sender(7, d.control_address)
        assert wait_for(lambda: sender.poll() == KVPoll.WaitingForInput)
        sender.send([0, 1], 0)  # a transfer worker now owns the room
        receiver.abort("client gone")
        assert receiver.poll() == KVPoll.Failed
        # until P's transfer worker confirms, the pages may still be written into
        assert wait_for(lambda: receiver.reusable, timeout=5)
        assert sender.poll() == KVPoll.Failed


def test_without_a_release_the_pages_wait_for_the_grace_period(monkeypatch) -> None:
    monkeypatch.setattr(receiver_module, "DIRECT_RELEASE_GRACE_S", 0.5)
    src, page_bytes = kv_buffer(16, 4)
    dst, _ = kv_buffer(16, 4, seed=None)
    with manager_pair("ipc", src, dst, page_bytes, deadlines=Deadlines(5, 5, 5)) as (p, d):
        receiver = d.create_receiver(8, p.control_address)
        receiver.init([3, 4])
        sender = p.create_sender(8, d.control_address)
        assert wait_for(lambda: sender.poll() == KVPoll.WaitingForInput)
        monkeypatch.setattr(type(sender), "released", lambda self: None)  # a silent P
        sender.send([0], 0)
        receiver.abort("client gone")
        assert not receiver.reusable
        time.sleep(0.2)
        assert not receiver.reusable
        assert wait_for(lambda: receiver.reusable, timeout=3)
