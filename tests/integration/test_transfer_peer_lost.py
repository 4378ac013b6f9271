"""A peer process dies (SIGKILL) mid-room: the survivor's rooms fail with "peer lost" long
before their deadlines."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from baton.common.transfer.base import Deadlines, KVArgs, KVPoll
from baton.common.transfer.manager import TransferManager
from baton.common.transfer.testing import kv_buffer, wait_for, wait_terminal

pytestmark = pytest.mark.timeout(60)

LONG = Deadlines(bootstrap_s=30, waiting_s=30, transferring_s=30)

# The peer: prints its control address, then follows the commands below, one per line.
PEER = textwrap.dedent(
    """
    import sys
    from baton.common.transfer.base import Deadlines, KVArgs, KVPoll
    from baton.common.transfer.manager import TransferManager
    from baton.common.transfer.testing import kv_buffer, wait_for

    role, backend = sys.argv[1], sys.argv[2]
    buffer, page_bytes = kv_buffer(16, 4)
    args = KVArgs(buffer, page_bytes, 16, deadlines=Deadlines(30, 30, 30))
    manager = TransferManager(args, role, backend)
    print(manager.control_address, flush=True)
    handle = None
    for line in sys.stdin:
        command, room, peer = line.split()
        if command == "sender":
            handle = manager.create_sender(int(room), peer)
            wait_for(lambda: handle.poll() == KVPoll.WaitingForInput, 10)
            handle.send([0, 1], 0)  # and no finish: the room stays in Transferring
        elif command == "receiver":
            handle = manager.create_receiver(int(room), peer)
            handle.init([2, 3])
        print("ready", flush=True)
    """
)


def start_peer(role: str) -> tuple[subprocess.Popen[str], str]:
    peer = subprocess.Popen(
        [sys.executable, "-c", PEER, role, "tcp"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert peer.stdout is not None
    return peer, peer.stdout.readline().strip()


def command(peer: subprocess.Popen[str], line: str) -> None:
    assert peer.stdin is not None and peer.stdout is not None
    peer.stdin.write(line + "\n")
    peer.stdin.flush()
    assert peer.stdout.readline().strip() == "ready"


def kill(peer: subprocess.Popen[str]) -> None:
    peer.kill()
    peer.wait(timeout=10)


def test_decode_notices_a_dead_prefill_mid_transfer() -> None:
    buffer, page_bytes = kv_buffer(16, 4, seed=None)
    decode = TransferManager(KVArgs(buffer, page_bytes, 16, deadlines=LONG), "decode", "tcp")
    peer, address = start_peer("prefill")
    try:
        receiver = decode.create_receiver(7, address)
        receiver.init([2, 3])
        command(peer, f"sender 7 {decode.control_address}")
        assert wait_for(lambda: receiver.poll() == KVPoll.Transferring, 10)
        kill(peer)
        assert wait_terminal([receiver], timeout=5) == [KVPoll.Failed]
        assert receiver.failure_reason == "peer lost"
    finally:
        kill(peer)
        decode.shutdown()


def test_decode_notices_a_dead_prefill_before_any_data() -> None:
    buffer, page_bytes = kv_buffer(16, 4, seed=None)
    decode = TransferManager(KVArgs(buffer, page_bytes, 16, deadlines=LONG), "decode", "tcp")
    peer, address = start_peer("prefill")
    try:
        receiver = decode.create_receiver(8, address)
        receiver.init([2, 3])
        time.sleep(0.5)  # let the control connection come up
        kill(peer)
        assert wait_terminal([receiver], timeout=5) == [KVPoll.Failed]
        assert receiver.failure_reason == "peer lost"
    finally:
        kill(peer)
        decode.shutdown()


def test_prefill_notices_a_dead_decode() -> None:
    buffer, page_bytes = kv_buffer(16, 4)
    prefill = TransferManager(KVArgs(buffer, page_bytes, 16, deadlines=LONG), "prefill", "tcp")
    peer, address = start_peer("decode")
    try:
        sender = prefill.create_sender(9, address)
        command(peer, f"receiver 9 {prefill.control_address}")
        assert wait_for(lambda: sender.poll() == KVPoll.WaitingForInput, 10)
        kill(peer)
        assert wait_terminal([sender], timeout=5) == [KVPoll.Failed]
        assert sender.failure_reason == "peer lost"
    finally:
        kill(peer)
        prefill.shutdown()
