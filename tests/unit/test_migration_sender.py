"""The source's side of a live migration (`disagg/migration.py`) against a fake room and
port: which pages leave, with which token, when the request's memory is freed, and every
way a move ends before the hand-off."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from baton.common.disagg.migration import MigrationSender
from baton.common.disagg.transfer_role import decode_aux
from baton.common.protocol import MigrateReq, PeerInfo
from baton.common.state import FinishReason
from baton.common.transfer.base import KVPoll

PAGE = 4
TARGET = PeerInfo("d2", "127.0.0.1:5000")


@dataclass
class FakeSender:
    state: KVPoll = KVPoll.Bootstrapping
    prefix_pages: int | None = None
    failure_reason: str | None = None
    sent: list[tuple[list[int], int]] = field(default_factory=list)
    aux: bytes | None = None
    aborted: str | None = None
    released: bool = False

    def poll(self) -> KVPoll:
        return self.state

    def send(self, pages: list[int], start: int, ready: Any = None) -> None:
        self.sent.append((list(pages), start))

    def finish(self, aux: bytes) -> None:
        self.aux = aux

    def abort(self, reason: str = "aborted") -> None:
        self.aborted = reason
        self.state = KVPoll.Failed

    def release(self) -> None:
        self.released = True


class FakeManager:
    def __init__(self) -> None:
        self.senders: dict[int, FakeSender] = {}

    def create_sender(self, room: int, peer: str) -> FakeSender:
        assert peer == TARGET.kv_control_address
        self.senders[room] = FakeSender()
        return self.senders[room]


class FakePort:
    def __init__(self) -> None:
        self.released: list[tuple[str, bool]] = []
        self.held: list[Any] = []  # memory given back (`release_held`)

    def release(self, req: Any, cache: bool) -> None:
        self.released.append((req.rid, cache))

    def release_held(self, held: Any) -> None:
        self.held.append(held)


def _req(prompt: int, outputs: list[int]) -> Any:
    tokens = prompt + len(outputs)
    pages = list(range(100, 100 + -(-tokens // PAGE)))
    return SimpleNamespace(
        rid="r1",
        input_ids=list(range(prompt)),
        output_ids=list(outputs),
        pages=pages,
        logprobs=[],
        sampling=SimpleNamespace(logprobs=False),
    )


def _sender(tp: bool = False) -> tuple[MigrationSender, FakeManager, FakePort]:
    manager, port = FakeManager(), FakePort()
    return MigrationSender(manager, port, PAGE, tp), manager, port  # type: ignore[arg-type]


def test_hand_off_sends_every_page_but_the_last_tokens_then_frees_them() -> None:
    moving, manager, port = _sender()
    moving.on_migrate(MigrateReq("r1", 7, TARGET))
    req = _req(prompt=10, outputs=[5, 6, 7])  # KV of 12 tokens: 3 pages, the last full
    assert moving.hand_off(req, None, None)
    sender = manager.senders[7]
    moving.poll()
    assert sender.sent == []  # the target has not asked yet
    sender.state, sender.prefix_pages = KVPoll.WaitingForInput, 1  # it holds page 0 cached
    moving.poll()
    assert sender.sent == [([101, 102], 0)]
    assert sender.aux is not None and decode_aux(sender.aux).token_id == 7
    assert port.released == []  # until the room ends
    sender.state = KVPoll.Success
    moving.poll()
    assert port.released == [("r1", False)] and sender.released
    assert not moving.has_work() and moving.sent == 1 and moving.pages_sent == 2


def test_a_partial_last_page_travels() -> None:
    moving, manager, _ = _sender()
    moving.on_migrate(MigrateReq("r1", 7, TARGET))
    req = _req(prompt=9, outputs=[5, 6, 7, 8, 9])  # KV of 13 tokens: a page holds the 13th
    assert moving.hand_off(req, None, None)
    manager.senders[7].state = KVPoll.WaitingForInput
    moving.poll()
    assert manager.senders[7].sent == [([100, 101, 102, 103], 0)]


def test_a_request_that_ends_first_aborts_the_room() -> None:
    moving, manager, port = _sender()
    moving.on_migrate(MigrateReq("r1", 7, TARGET))
    assert not moving.hand_off(_req(10, [5]), FinishReason.LENGTH, None)
    sender = manager.senders[7]
    assert sender.aborted and sender.released and port.released == []
    assert not moving.has_work()


def test_abort_before_the_hand_off_drops_the_room() -> None:
    moving, manager, _ = _sender()
    moving.on_migrate(MigrateReq("r1", 7, TARGET))
    moving.on_abort("r1")
    assert manager.senders[7].aborted and not moving.has_work()
    assert not moving.hand_off(_req(10, [5]), None, None)  # decodes on here


def test_a_target_that_gives_up_ends_the_move() -> None:
    moving, manager, _ = _sender()
    moving.on_migrate(MigrateReq("r1", 7, TARGET))
    manager.senders[7].state = KVPoll.Failed
    moving.poll()
    assert not moving.has_work() and manager.senders[7].released


def test_tensor_parallel_and_second_moves_are_refused_with_a_reason() -> None:
    moving, manager, _ = _sender(tp=True)
    refused = moving.on_migrate(MigrateReq("r1", 7, TARGET))
    assert refused and "tensor-parallel" in refused
    assert manager.senders[7].aborted and not moving.has_work()
    moving, manager, _ = _sender()
    assert moving.on_migrate(MigrateReq("r1", 7, TARGET)) is None
    refused = moving.on_migrate(MigrateReq("r1", 8, TARGET))
    assert refused and "moving already" in refused
    assert manager.senders[8].aborted and not manager.senders[7].aborted


def test_a_precopy_sends_whole_pages_ahead_and_the_request_decodes_on() -> None:
    moving, manager, port = _sender()
    assert moving.on_migrate(MigrateReq("r1", 9, TARGET, precopy_tokens=8)) is None
    req = _req(prompt=10, outputs=[5, 6, 7])  # 13 tokens: pages 100..103
    assert not moving.hand_off(req, None, None)  # not handed off: it decodes on
    sender = manager.senders[9]
    sender.state, sender.prefix_pages = KVPoll.WaitingForInput, 1  # it holds page 0 cached
    moving.poll()
    assert sender.sent == [([101], 0)]  # tokens 4..7: the target's uncached whole pages
    assert sender.aux is not None and decode_aux(sender.aux).token_id == 8  # the token at 8
    sender.state = KVPoll.Success
    moving.poll()
    assert sender.released and port.released == [] and not moving.has_work()
    assert moving.pages_precopied == 1 and moving.pages_sent == 0 and moving.sent == 0


def test_a_request_that_ends_during_its_precopy_aborts_the_room() -> None:
    for end in ("finish", "abort"):
        moving, manager, _ = _sender()
        moving.on_migrate(MigrateReq("r1", 9, TARGET, precopy_tokens=8))
        req = _req(prompt=10, outputs=[5])
        moving.hand_off(req, None, None)
        manager.senders[9].state = KVPoll.WaitingForInput
        moving.poll()
        assert manager.senders[9].sent  # the pages are on their way
        if end == "finish":
            assert not moving.hand_off(req, FinishReason.LENGTH, None)
        else:
            moving.on_abort("r1")
        assert manager.senders[9].aborted and manager.senders[9].released, end
        assert not moving.has_work()


def test_a_precopy_of_a_partial_page_or_past_the_context_is_refused() -> None:
    moving, manager, _ = _sender()
    refused = moving.on_migrate(MigrateReq("r1", 9, TARGET, precopy_tokens=6))
    assert refused and "whole pages" in refused and manager.senders[9].aborted
    moving.on_migrate(MigrateReq("r1", 10, TARGET, precopy_tokens=12))
    moving.hand_off(_req(prompt=10, outputs=[5, 6]), None, None)  # 12 tokens: none after
    manager.senders[10].state = KVPoll.WaitingForInput
    moving.poll()
    assert manager.senders[10].aborted and manager.senders[10].sent == []


def _precopy_on_the_wire() -> tuple[MigrationSender, FakeSender, FakePort, Any]:
    moving, manager, port = _sender()
    moving.on_migrate(MigrateReq("r1", 9, TARGET, precopy_tokens=8))
    req = _req(prompt=10, outputs=[5])
    moving.hand_off(req, None, None)
    manager.senders[9].state = KVPoll.WaitingForInput
    moving.poll()
    assert manager.senders[9].sent == [([100, 101], 0)]
    return moving, manager.senders[9], port, req


def test_a_request_retracted_during_its_precopy_leaves_its_pages_to_the_room() -> None:
    """Retracted while its pages are on the wire: the pre-copy keeps the request's memory,
    so no other request gets those pages before the room ends; the room goes on."""
    moving, sender, port, req = _precopy_on_the_wire()
    held = object()
    assert moving.keep_memory(req, held)  # type: ignore[arg-type]
    assert not moving.keep_memory(req, object())  # type: ignore[arg-type]  # kept already
    moving.poll()
    assert sender.aborted is None and port.held == []  # still read
    sender.state = KVPoll.Success
    moving.poll()
    assert port.held == [held] and sender.released and not moving.has_work()


def test_memory_kept_by_a_precopy_goes_back_however_the_room_ends() -> None:
    for end in ("failed", "finish", "abort", "fail_all"):
        moving, sender, port, req = _precopy_on_the_wire()
        held = object()
        assert moving.keep_memory(req, held)  # type: ignore[arg-type]
        if end == "failed":
            sender.state = KVPoll.Failed
            moving.poll()
        elif end == "finish":
            moving.hand_off(req, FinishReason.LENGTH, None)
        elif end == "abort":
            moving.on_abort("r1")
        else:
            moving.fail_all("worker failed")
        assert port.held == [held] and sender.released and not moving.has_work(), end


def test_a_request_retracted_before_its_precopy_sent_waits_for_its_recompute() -> None:
    moving, manager, port = _sender()
    moving.on_migrate(MigrateReq("r1", 9, TARGET, precopy_tokens=8))
    req = _req(prompt=10, outputs=[5])
    moving.hand_off(req, None, None)
    assert not moving.keep_memory(req, object())  # type: ignore[arg-type]  # nothing read
    req.pages = []  # retracted: its pages went back to the pool
    sender = manager.senders[9]
    sender.state = KVPoll.WaitingForInput
    moving.poll()
    assert sender.sent == [] and sender.aborted is None  # waits: no pages to read
    recomputed = _req(prompt=10, outputs=[5, 6])
    recomputed.pages = [200, 201, 202]
    moving.hand_off(recomputed, None, None)  # decodes again
    moving.poll()
    assert sender.sent == [([200, 201], 0)] and port.held == []


def test_memory_of_a_request_without_a_precopy_is_not_kept() -> None:
    moving, _, _ = _sender()
    moving.on_migrate(MigrateReq("r1", 7, TARGET))  # a hand-off: nothing read before it
    assert not moving.keep_memory(_req(10, [5]), object())  # type: ignore[arg-type]
