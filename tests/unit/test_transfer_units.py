"""Pure parts of the KV transfer: coalescing, the room state machine, fault plans, frames."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from baton.common.transfer.base import Deadlines, KVArgs, KVPoll
from baton.common.transfer.fake import FaultPlan
from baton.common.transfer.messages import (
    MAX_HEADER_BYTES,
    KVDone,
    KVInit,
    RegionFrame,
    decode_control,
    decode_prefixed_frame,
    encode_control,
    encode_frame,
    frame_length,
)
from baton.common.transfer.regions import Region, coalesce
from baton.common.transfer.registry import make_backend
from baton.common.transfer.room import RoomState, TransferStats


def maximal_runs(pairs: list[tuple[int, int]]) -> int:
    """Brute force: pairs that continue no other pair on both sides start a run."""
    members = set(pairs)
    return sum((s - 1, d - 1) not in members for s, d in members)


def test_coalesce_merges_runs_contiguous_on_both_sides() -> None:
    pairs = [(7, 20), (8, 21), (9, 22), (3, 23), (4, 24), (10, 30)]
    assert coalesce(pairs, page_bytes=100) == [
        Region(300, 2300, 200),
        Region(700, 2000, 300),
        Region(1000, 3000, 100),
    ]


def test_coalesce_merges_across_chunks_given_in_any_order() -> None:
    assert coalesce([(5, 9), (3, 7), (4, 8)], page_bytes=1) == [Region(3, 7, 3)]


@given(
    st.lists(st.integers(0, 40), min_size=0, max_size=30, unique=True),
    st.randoms(use_true_random=False),
)
def test_coalesce_region_count_is_the_number_of_maximal_runs(srcs: list[int], rnd) -> None:
    dsts = rnd.sample(range(60), len(srcs))
    if rnd.random() < 0.5:  # mostly contiguous destinations, as a fresh allocator gives
        start = rnd.randrange(20)
        dsts = list(range(start, start + len(srcs)))
    pairs = list(zip(sorted(srcs), dsts, strict=True))
    regions = coalesce(pairs, page_bytes=4)
    assert len(regions) == maximal_runs(pairs)
    covered = {
        (r.src_offset // 4 + i, r.dst_offset // 4 + i)
        for r in regions
        for i in range(r.length // 4)
    }
    assert covered == set(pairs)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_room_moves_forward_only_and_terminal_states_stick() -> None:
    state = RoomState(1, "p:1", Deadlines(), clock=FakeClock())
    assert state.advance(KVPoll.WaitingForInput)
    assert not state.advance(KVPoll.Bootstrapping)
    assert state.advance(KVPoll.Success)  # skipping Transferring is forward
    assert not state.fail("late")
    assert state.state == KVPoll.Success and state.failure_reason is None


def test_failure_wins_and_keeps_the_first_reason() -> None:
    state = RoomState(1, "p:1", Deadlines())
    assert state.fail("first")
    assert not state.fail("second")
    assert not state.advance(KVPoll.Success)
    assert (state.state, state.failure_reason) == (KVPoll.Failed, "first")


def test_each_state_has_its_own_deadline() -> None:
    clock = FakeClock()
    state = RoomState(1, "p:1", Deadlines(bootstrap_s=1, waiting_s=5, transferring_s=2), clock)
    clock.now = 0.9
    assert state.lapsed() is None
    state.advance(KVPoll.WaitingForInput)
    clock.now = 5.5
    assert state.lapsed() is None  # 4.6 s in WaitingForInput
    clock.now = 6.0
    assert state.lapsed() == "deadline in WaitingForInput"
    state.advance(KVPoll.Transferring)
    clock.now = 8.5
    assert state.lapsed() == "deadline in Transferring"
    state.fail("done")
    clock.now = 1000
    assert state.lapsed() is None


def test_stats_count_rooms_by_reason_kind_and_state_time() -> None:
    clock = FakeClock()
    stats = TransferStats()
    ok, bad = RoomState(1, "p", Deadlines(), clock), RoomState(2, "p", Deadlines(), clock)
    clock.now = 2.0
    ok.advance(KVPoll.Success)
    bad.fail("aborted by peer: client went away")
    stats.room_done(ok)
    stats.room_done(bad)
    snap = stats.snapshot()
    assert snap["rooms_ok"] == 1
    assert snap["rooms_failed"] == {"aborted by peer": 1}
    assert snap["state_seconds"] == {"Bootstrapping": 4.0}


@pytest.mark.parametrize(
    ("text", "plan"),
    [
        ("", FaultPlan()),
        ("fail:every=2", FaultPlan(fail_every=2)),
        ("drop", FaultPlan(drop_every=1)),
        (" delay:ms=200 ; corrupt:every=3 ", FaultPlan(delay_ms=200, corrupt_every=3)),
    ],
)
def test_fault_plan_grammar(text: str, plan: FaultPlan) -> None:
    assert FaultPlan.parse(text) == plan


@pytest.mark.parametrize("text", ["explode", "fail:every=x", "fail:ms=2", "delay", "drop:every"])
def test_fault_plan_rejects_nonsense(text: str) -> None:
    with pytest.raises(ValueError, match="fault plan"):
        FaultPlan.parse(text)


def test_control_messages_round_trip_and_garbage_is_rejected() -> None:
    init = KVInit(1 << 62, "tok", "127.0.0.1:9", [3, 4], 2, 4096, False)
    assert decode_control(encode_control(init)) == init
    for garbage in (b"\x00\x01garbage", b"", encode_control(init)[:-3]):
        with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
            decode_control(garbage)


TRACEPARENT = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"


@pytest.mark.parametrize(
    "bad",
    [
        "00-" + "ab" * 16 + "-" + "cd" * 8,  # no flags
        "01-" + "ab" * 16 + "-" + "cd" * 8 + "-01",  # a version we do not read
        "00-" + "AB" * 16 + "-" + "cd" * 8 + "-01",  # W3C spells it lower case
        TRACEPARENT + "-" + "x" * 500,
    ],
)
def test_a_rooms_trace_context_crosses_checked(bad: str) -> None:
    """D's init and P's final status carry each side's W3C trace context, and one that is
    not a traceparent fails the message as any malformed field does."""
    init = KVInit(7, "tok", "127.0.0.1:9", [3, 4], 0, 4096, False, traceparent=TRACEPARENT)
    done = KVDone(7, "tok", 2, b"a", traceparent=TRACEPARENT)
    assert decode_control(encode_control(init)) == init
    assert decode_control(encode_control(done)) == done
    assert decode_control(encode_control(KVDone(7, "tok", 2))).traceparent is None  # type: ignore[union-attr]
    for message in (init, done):
        forged = msgspec.structs.replace(message, traceparent=bad)
        with pytest.raises(msgspec.ValidationError, match="traceparent"):
            decode_control(encode_control(forged))


def test_frame_headers_are_length_prefixed_and_bounded() -> None:
    frame = RegionFrame(room=5, dst_offset=4096, length=8192, crc=123)
    data = encode_frame(frame)
    assert decode_prefixed_frame(data + b"\0" * 100) == frame  # ucx slots carry padding
    with pytest.raises(ValueError):
        frame_length((100 << 20).to_bytes(4, "big"))  # a "100 MB" header
    with pytest.raises(ValueError):
        frame_length(MAX_HEADER_BYTES.to_bytes(4, "big"))


def test_kv_args_check_the_buffer_layout() -> None:
    buffer = torch.zeros(4, 16, dtype=torch.uint8)
    KVArgs(buffer, page_bytes=16, num_pages=4)
    with pytest.raises(ValueError, match="expected"):
        KVArgs(buffer, page_bytes=32, num_pages=4)
    with pytest.raises(ValueError, match="contiguous"):
        KVArgs(buffer.t(), page_bytes=16, num_pages=4)


def test_unknown_backend_names_are_refused() -> None:
    with pytest.raises(ValueError, match="known"):
        make_backend("carrier-pigeon")


def test_reading_the_backend_names_loads_no_backend() -> None:
    """The command line reads `--transfer-backend`'s choices at start-up: that imports no
    backend and no torch (each factory imports its backend only when called)."""
    code = (
        "import sys\n"
        "from baton.common.config import transfer_backend_names\n"
        "names = transfer_backend_names()\n"
        "loaded = [m for m in sys.modules if m == 'torch' or m.startswith('baton.common.transfer.')]\n"
        "print(sorted(names), sorted(loaded))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    expected = "['auto', 'fake', 'ipc', 'tcp', 'ucx'] ['baton.common.transfer.registry']"
    assert out.stdout.strip() == expected


def test_auto_builds_the_backends_it_offers_through_the_registry() -> None:
    """`auto` is handed the registry's `make_backend` rather than importing the registry: a
    decode worker with a memfd pool offers ipc and tcp, each built by that function."""
    from baton.common.transfer.auto import AutoBackend, decode_address
    from baton.common.transfer.backend import TransferBackend
    from baton.common.transfer.testing import kv_buffer

    asked: list[str] = []

    def make(name: str) -> TransferBackend:
        asked.append(name)
        return make_backend(name)

    backend = AutoBackend(make)
    buffer, page_bytes = kv_buffer(2, 1, seed=None)
    try:  # the sink is never called: no peer connects
        address = backend.start(KVArgs(buffer, page_bytes, 2), sink=object())  # type: ignore[arg-type]
    finally:
        backend.shutdown()
    assert address is not None
    assert asked == ["ipc", "tcp"] == list(decode_address(address).addresses)
