"""What goes wrong in a KV handoff, and what each side then reports: aborts, deadlines,
injected faults (the `fake` backend), corruption, lost peers, hostile bytes."""

from __future__ import annotations

import dataclasses
import os
import socket
import struct
import time

import pytest
import torch
import zmq

from baton.common.transfer.base import Deadlines, KVPoll
from baton.common.transfer.messages import (
    DataHello,
    KVAbort,
    RegionFrame,
    encode_control,
    encode_frame,
)
from baton.common.transfer.testing import kv_buffer, manager_pair, wait_for, wait_terminal

pytestmark = pytest.mark.timeout(60)

SHORT = Deadlines(bootstrap_s=0.4, waiting_s=0.4, transferring_s=0.4)
LONG = Deadlines(bootstrap_s=5, waiting_s=5, transferring_s=5)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.fixture
def buffers() -> tuple[torch.Tensor, torch.Tensor, int]:
    src, page_bytes = kv_buffer(32, 4, seed=3)
    dst, _ = kv_buffer(32, 4, seed=None)
    return src, dst, page_bytes


def handoff(p, d, room: int, dst_pages: list[int], prefix: int = 0):
    """Receiver initialised and sender bootstrapped for ``room``."""
    receiver = d.create_receiver(room, p.control_address)
    receiver.init(dst_pages, prefix_pages=prefix)
    sender = p.create_sender(room, d.control_address)
    assert wait_for(lambda: sender.poll() == KVPoll.WaitingForInput), sender.failure_reason
    return sender, receiver


def transfer(sender, pages: list[int], aux: bytes = b"x") -> None:
    sender.send(pages, 0)
    sender.finish(aux)


def test_init_that_arrives_before_create_sender_is_kept(buffers) -> None:
    src, dst, pb = buffers
    with manager_pair("tcp", src, dst, pb, deadlines=LONG) as (p, d):
        receiver = d.create_receiver(11, p.control_address)
        receiver.init([4, 5])
        time.sleep(0.2)  # the init reaches P, which has no such room yet
        sender = p.create_sender(11, d.control_address)
        assert sender.poll() == KVPoll.WaitingForInput
        transfer(sender, [0, 1])
        assert wait_terminal([receiver, sender]) == [KVPoll.Success, KVPoll.Success]


@pytest.mark.parametrize("side", ["decode", "prefill"])
def test_abort_on_either_side_fails_both(buffers, side: str) -> None:
    src, dst, pb = buffers
    with manager_pair("tcp", src, dst, pb, deadlines=LONG) as (p, d):
        sender, receiver = handoff(p, d, 12, [1, 2, 3])
        sender.send([0], 0)
        (receiver if side == "decode" else sender).abort("client went away")
        assert wait_terminal([receiver, sender]) == [KVPoll.Failed, KVPoll.Failed]
        aborted, told = (receiver, sender) if side == "decode" else (sender, receiver)
        assert aborted.failure_reason == "client went away"
        assert told.failure_reason == "aborted by peer: client went away"
        # The scheduler may call these before it polls the failure: they are ignored.
        sender.send([1, 2], 1)
        sender.finish(b"")
        assert sender.poll() == KVPoll.Failed


def test_abort_before_create_receiver_is_kept(buffers) -> None:
    src, dst, pb = buffers
    with manager_pair("tcp", src, dst, pb, deadlines=LONG) as (p, d):
        sender = p.create_sender(13, d.control_address)
        sender.abort("prompt too long")
        time.sleep(0.2)
        receiver = d.create_receiver(13, p.control_address)
        assert receiver.poll() == KVPoll.Failed
        assert receiver.failure_reason == "aborted by peer: prompt too long"


@pytest.mark.parametrize(
    ("setup", "side", "reason"),
    [
        ("no_init", "receiver", "deadline in Bootstrapping"),
        ("no_receiver", "sender", "deadline in Bootstrapping"),
        ("no_sender", "receiver", "deadline in WaitingForInput"),
        ("no_send", "sender", "deadline in WaitingForInput"),
        ("no_finish", "receiver", "deadline in Transferring"),
        ("no_finish", "sender", "deadline in Transferring"),
    ],
)
def test_every_state_has_a_deadline(buffers, setup: str, side: str, reason: str) -> None:
    src, dst, pb = buffers
    # Only the side under test has a short deadline, and only for the state under test: the
    # other side's own deadline would otherwise fail it first and abort this one ("aborted
    # by peer: ..."), and on a loaded machine a short deadline of an earlier state could
    # pass before the peer moved the room on.
    field = {
        "deadline in Bootstrapping": "bootstrap_s",
        "deadline in WaitingForInput": "waiting_s",
        "deadline in Transferring": "transferring_s",
    }[reason]
    short = dataclasses.replace(LONG, **{field: getattr(SHORT, field)})
    decode_deadlines, prefill_deadlines = (short, LONG) if side == "receiver" else (LONG, short)
    with manager_pair(
        "tcp",
        src,
        dst,
        pb,
        deadlines=decode_deadlines,
        sender_args={"deadlines": prefill_deadlines},
    ) as (p, d):
        receiver = sender = None
        if setup != "no_receiver":
            receiver = d.create_receiver(14, p.control_address)
            if setup != "no_init":
                receiver.init([1, 2])
        if setup not in ("no_sender", "no_init"):
            sender = p.create_sender(14, d.control_address)
        if setup == "no_finish":
            assert sender is not None
            assert wait_for(lambda: sender.poll() == KVPoll.WaitingForInput)
            sender.send([0], 0)
        handle = receiver if side == "receiver" else sender
        assert handle is not None
        assert wait_terminal([handle], timeout=3) == [KVPoll.Failed]
        assert handle.failure_reason == reason


def test_deadlines_fail_rooms_even_when_nobody_polls(buffers) -> None:
    src, dst, pb = buffers
    waiting_only = dataclasses.replace(LONG, waiting_s=SHORT.waiting_s)  # as above
    with manager_pair("tcp", src, dst, pb, deadlines=waiting_only) as (p, d):
        receiver = d.create_receiver(15, p.control_address)
        receiver.init([1])
        time.sleep(0.8)
        # the room turns terminal just before the manager counts it
        assert wait_for(lambda: d.stats()["rooms_failed"] == {"deadline in WaitingForInput": 1}), (
            d.stats()
        )
        assert receiver.poll() == KVPoll.Failed


def test_fake_fail_every_second_room(buffers) -> None:
    src, dst, pb = buffers
    with manager_pair("fake", src, dst, pb, deadlines=LONG, fault_plan="fail:every=2") as (p, d):
        rooms = [handoff(p, d, 100 + i, [2 * i, 2 * i + 1]) for i in range(4)]
        for sender, _ in rooms:
            transfer(sender, [0, 1])
            wait_terminal([sender])  # fix the order in which rooms reach the backend
        receivers = [r for _, r in rooms]
        assert wait_terminal(receivers) == [KVPoll.Success, KVPoll.Failed] * 2
        assert receivers[1].failure_reason == "aborted by peer: fake fault: fail"
        assert rooms[3][0].failure_reason == "fake fault: fail"


def test_fake_fault_plan_from_the_environment(buffers, monkeypatch) -> None:
    src, dst, pb = buffers
    monkeypatch.setenv("BATON_TRANSFER_FAULT", "fail:every=1")  # what --transfer-fault reads
    plan = _prefill_config("--transfer-backend", "fake").transfer.fault
    with manager_pair("fake", src, dst, pb, deadlines=LONG, fault_plan=plan) as (p, d):
        sender, receiver = handoff(p, d, 16, [3])
        transfer(sender, [0])
        assert wait_terminal([receiver]) == [KVPoll.Failed]


def test_fake_drop_leaves_decode_to_its_deadline(buffers) -> None:
    src, dst, pb = buffers
    with manager_pair("fake", src, dst, pb, deadlines=SHORT, fault_plan="drop:every=1") as (
        p,
        d,
    ):
        sender, receiver = handoff(p, d, 17, [3, 4])
        transfer(sender, [0, 1])
        assert wait_terminal([sender]) == [KVPoll.Success]
        assert wait_terminal([receiver], timeout=3) == [KVPoll.Failed]
        assert receiver.failure_reason == "deadline in Transferring"
        assert receiver.aux is None


def test_fake_delay_slows_but_completes(buffers) -> None:
    src, dst, pb = buffers
    with manager_pair("fake", src, dst, pb, deadlines=LONG, fault_plan="delay:ms=200") as (p, d):
        sender, receiver = handoff(p, d, 18, [3, 4])
        began = time.monotonic()
        transfer(sender, [0, 1])
        assert wait_terminal([receiver]) == [KVPoll.Success]
        assert time.monotonic() - began >= 0.4  # before the push and before the status


def test_corruption_on_the_wire_fails_the_checksum(buffers) -> None:
    src, dst, pb = buffers
    with manager_pair(
        "fake", src, dst, pb, deadlines=LONG, verify_checksum=True, fault_plan="corrupt:every=1"
    ) as (p, d):
        sender, receiver = handoff(p, d, 19, [3, 4, 9])
        transfer(sender, [0, 1, 2], aux=b"tok")
        assert wait_terminal([receiver]) == [KVPoll.Failed]
        assert receiver.failure_reason == "checksum mismatch"
        assert receiver.aux is None
        # the room turns terminal just before the manager counts it
        assert wait_for(lambda: d.stats()["rooms_failed"] == {"checksum mismatch": 1}), d.stats()


def test_corruption_goes_unnoticed_without_checksums(buffers) -> None:
    """The reason checksums exist (debug mode): the room 'succeeds' with bad bytes."""
    src, dst, pb = buffers
    with manager_pair("fake", src, dst, pb, deadlines=LONG, fault_plan="corrupt:every=1") as (
        p,
        d,
    ):
        sender, receiver = handoff(p, d, 20, [3])
        transfer(sender, [0])
        assert wait_terminal([receiver]) == [KVPoll.Success]
        assert not same(dst[3], src[0])


def test_fail_peer_fails_every_room_bound_to_it(buffers) -> None:
    src, dst, pb = buffers
    with manager_pair("tcp", src, dst, pb, deadlines=LONG) as (p, d):
        pairs = [handoff(p, d, 30 + i, [i]) for i in range(3)]
        assert d.fail_peer(p.control_address, "heartbeat lapsed") == 3
        assert d.fail_peer(p.control_address, "heartbeat lapsed") == 0
        for _, receiver in pairs:
            assert receiver.poll() == KVPoll.Failed
            assert receiver.failure_reason == "heartbeat lapsed"


def test_release_and_abort_are_idempotent(buffers) -> None:
    src, dst, pb = buffers
    with manager_pair("tcp", src, dst, pb, deadlines=LONG) as (p, d):
        sender, receiver = handoff(p, d, 21, [3])
        transfer(sender, [0])
        assert wait_terminal([receiver, sender]) == [KVPoll.Success, KVPoll.Success]
        for handle in (receiver, sender):
            handle.abort()  # terminal: nothing changes
            handle.release()
            handle.release()
            handle.abort()
            assert handle.poll() == KVPoll.Success
        assert d.stats()["rooms_active"] == p.stats()["rooms_active"] == 0
        assert d.stats()["rooms_ok"] == 1 and d.stats()["rooms_failed"] == {}

        sender, receiver = handoff(p, d, 22, [4])
        receiver.release()  # live: aborts first, tells P
        receiver.release()
        assert wait_terminal([sender]) == [KVPoll.Failed]
        assert sender.failure_reason == "aborted by peer: released"
        # the room turns terminal just before the manager counts it
        assert wait_for(lambda: d.stats()["rooms_failed"] == {"released": 1}), d.stats()


def test_sender_rejects_misuse(buffers) -> None:
    src, dst, pb = buffers
    with manager_pair("tcp", src, dst, pb, deadlines=LONG) as (p, d):
        early = p.create_sender(23, d.control_address)
        with pytest.raises(RuntimeError, match="before"):
            early.send([0], 0)
        sender, _ = handoff(p, d, 24, [3, 4])
        with pytest.raises(ValueError, match="outside"):
            sender.send([0, 1, 2], 0)
        with pytest.raises(ValueError, match="out of range"):
            sender.send([999], 0)
        sender.send([0], 0)
        with pytest.raises(ValueError, match="twice"):
            sender.send([5], 0)
        with pytest.raises(ValueError, match="1 of 2"):
            sender.finish(b"")
        with pytest.raises(RuntimeError, match="decode"):
            p.create_receiver(25, d.control_address)
        with pytest.raises(ValueError, match="exists"):
            p.create_sender(24, d.control_address)


def test_layout_mismatch_fails_the_room_not_the_data(buffers) -> None:
    src, dst, pb = buffers
    other, other_pb = kv_buffer(16, 8, seed=1)
    with manager_pair(
        "tcp",
        src,
        dst,
        pb,
        deadlines=LONG,
        sender_args={"buffer": other, "page_bytes": other_pb, "num_pages": 16},
    ) as (p, d):
        receiver = d.create_receiver(26, p.control_address)
        receiver.init([1])
        sender = p.create_sender(26, d.control_address)
        assert wait_terminal([sender, receiver]) == [KVPoll.Failed, KVPoll.Failed]
        assert sender.failure_reason.startswith("layout mismatch")


def test_wrong_token_is_dropped(buffers) -> None:
    src, dst, pb = buffers
    with manager_pair(
        "tcp", src, dst, pb, deadlines=SHORT, token="right", sender_args={"token": "wrong"}
    ) as (p, d):
        receiver = d.create_receiver(27, p.control_address)
        receiver.init([1])
        sender = p.create_sender(27, d.control_address)
        assert wait_terminal([sender, receiver], timeout=3) == [KVPoll.Failed, KVPoll.Failed]
        assert sender.failure_reason == "deadline in Bootstrapping"  # D's init never counted
        assert p.stats()["frames_dropped"] >= 1


def raw_send(address: str, data: bytes) -> None:
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=2) as sock:
        sock.sendall(data)
        time.sleep(0.05)


def test_garbage_on_every_port_is_dropped_and_serving_goes_on(buffers) -> None:
    src, dst, pb = buffers
    with manager_pair("tcp", src, dst, pb, deadlines=LONG, token="t") as (p, d):
        hundred_mb = struct.pack(">I", 100 << 20)
        assert d.transfer_address is not None
        for address in (p.control_address, d.control_address, d.transfer_address):
            raw_send(address, os.urandom(4096))
            raw_send(address, hundred_mb + os.urandom(64))
        # Well-formed ZMQ, but nonsense inside, or the wrong token.
        with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as dealer:
            dealer.setsockopt(zmq.LINGER, 1000)
            dealer.connect(f"tcp://{d.control_address}")
            dealer.send(os.urandom(200))
            dealer.send_multipart([b"a", b"b"])
            dealer.send(encode_control(KVAbort(room=40, token="nope", reason="x")))
        # A hello with a wrong token, and a region before any hello.
        raw_send(d.transfer_address, encode_frame(DataHello(token="nope", peer="x:1")))
        raw_send(d.transfer_address, encode_frame(RegionFrame(room=40, dst_offset=0, length=pb)))
        assert wait_for(lambda: d.stats().get("frames_dropped", 0) >= 7)

        sender, receiver = handoff(p, d, 40, [7, 8])
        transfer(sender, [0, 1])
        assert wait_terminal([receiver, sender]) == [KVPoll.Success, KVPoll.Success]
        assert same(dst[[7, 8]], src[[0, 1]])


@pytest.mark.parametrize(
    ("offset_pages", "length_pages", "room_fails"),
    [
        (5, 1, "write from a peer not bound to the room"),  # right pages, wrong sender
        (0, 1, "write outside the room's pages"),  # page 0 is not the room's
        (5, 3, "write outside the room's pages"),  # runs past the room's last page
        # Not page-aligned / past the end of the buffer: the stream is dropped, and as it
        # claimed to come from P, P's rooms fail.
        (5, 1.5, "peer lost"),
        (31, 2, "peer lost"),
    ],
)
def test_a_peer_cannot_write_outside_its_rooms_pages(
    buffers, offset_pages: int, length_pages: float, room_fails: str
) -> None:
    src, dst, pb = buffers
    before = dst.clone()
    with manager_pair("tcp", src, dst, pb, deadlines=LONG, token="t") as (p, d):
        assert d.transfer_address is not None
        receiver = d.create_receiver(41, p.control_address)
        receiver.init([5, 6])
        frame = RegionFrame(room=41, dst_offset=offset_pages * pb, length=int(length_pages * pb))
        claimed = "10.0.0.1:1" if "bound" in room_fails else p.control_address
        hello = encode_frame(DataHello(token="t", peer=claimed))
        raw_send(d.transfer_address, hello + encode_frame(frame) + b"\xee" * frame.length)
        assert wait_for(lambda: d.stats().get("frames_dropped", 0) >= 1)
        assert wait_for(lambda: receiver.poll() == KVPoll.Failed)
        assert receiver.failure_reason == room_fails
        assert same(dst, before)


def test_a_page_is_written_once(buffers) -> None:
    src, dst, pb = buffers
    with manager_pair("tcp", src, dst, pb, deadlines=LONG, token="t") as (p, d):
        assert d.transfer_address is not None
        receiver = d.create_receiver(42, p.control_address)
        receiver.init([5, 6])
        region = encode_frame(RegionFrame(room=42, dst_offset=5 * pb, length=pb))
        hello = encode_frame(DataHello(token="t", peer=p.control_address))
        raw_send(d.transfer_address, hello + (region + b"\x01" * pb) * 2)
        assert wait_for(lambda: receiver.poll() == KVPoll.Failed)
        assert receiver.failure_reason == "page written twice"


def _prefill_config(*argv: str):  # type: ignore[no-untyped-def]
    """A prefill worker's config, parsed as `baton prefill` would (environment included)."""
    from baton.services.cli import apply_env_defaults, build_parser
    from baton.services.worker.config import worker_config

    parser = build_parser("prefill")
    apply_env_defaults(parser)
    return worker_config(parser.parse_args(["prefill", "--model", "m", *argv]), "prefill")
