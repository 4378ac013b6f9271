"""A sender's data connections opened ahead of any room (`TransferManager.connect`, for a
live migration's target known before its hand-off, issue 41): the first room to that
receiver then pushes over them and opens none of its own, so its transfer waits for no
handshake (for ipc, no mapping of the receiver's pool)."""

from __future__ import annotations

import pytest
import torch

from baton.common.transfer.base import Deadlines, KVPoll, PeerLostError
from baton.common.transfer.ipc import IpcBackend
from baton.common.transfer.tcp import TcpBackend
from baton.common.transfer.testing import kv_buffer, manager_pair, wait_for, wait_terminal

pytestmark = pytest.mark.timeout(60)

DEADLINES = Deadlines(bootstrap_s=5, waiting_s=5, transferring_s=10)
BACKENDS = {"tcp": TcpBackend, "ipc": IpcBackend}


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_the_first_room_uses_the_connections_opened_ahead(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    opened: list[str] = []
    connect = BACKENDS[backend].connect

    def counted(self, address, hello):  # type: ignore[no-untyped-def]
        opened.append(address)
        return connect(self, address, hello)

    monkeypatch.setattr(BACKENDS[backend], "connect", counted)
    src, page_bytes = kv_buffer(8, 4, seed=1)
    dst, _ = kv_buffer(8, 4, seed=2)
    with manager_pair(backend, src, dst, page_bytes, deadlines=DEADLINES, token="t") as (p, d):
        assert d.transfer_address is not None
        p.connect(d.transfer_address).result(timeout=10)
        assert opened == [d.transfer_address] * 2  # one per transfer thread (the default)

        receiver = d.create_receiver(7, p.control_address)
        receiver.init([5, 6, 7])
        sender = p.create_sender(7, d.control_address)
        assert wait_for(lambda: sender.poll() == KVPoll.WaitingForInput)
        sender.send([0, 1, 2], 0)
        sender.finish(b"aux")
        assert wait_terminal([receiver, sender]) == [KVPoll.Success, KVPoll.Success]
        assert torch.equal(dst[5:8].view(torch.uint8), src[0:3].view(torch.uint8))
        assert len(opened) == 2, opened  # the room opened none of its own


def test_a_receiver_that_is_not_there_fails_the_connect() -> None:
    src, page_bytes = kv_buffer(4, 4, seed=1)
    dst, _ = kv_buffer(4, 4, seed=2)
    pair = manager_pair("tcp", src, dst, page_bytes, deadlines=DEADLINES, token="t")
    with pair as (p, _), pytest.raises(PeerLostError):
        p.connect("127.0.0.1:1").result(timeout=10)
