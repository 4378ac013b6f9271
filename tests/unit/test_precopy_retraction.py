"""A live migration's pre-copy against a retraction on its source (issue 41), with two real
decode schedulers in one process joined by the `fake` transfer backend.

The source's transfer lane is held just before it reads the pre-copy's pages; meanwhile the
source retracts the request (memory), every evictable page is evicted and another request's
prompt fills the pool. The pages on the wire must not go to anyone before the room ends: they
keep their bytes, the room succeeds, the target caches exactly them, the hand-off that follows
copies only the rest, the stream is token-exact and no page is held on either side after.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from baton.common.config import EngineConfig, ModelConfig, TransferConfig
from baton.common.disagg.start import start_role
from baton.common.protocol import GenerateReq, MigrateReq, PeerInfo
from baton.common.sampling import SamplingParams
from baton.common.transfer.base import KVPoll
from baton.common.transfer.fake import FakeBackend
from baton.common.transfer.sender import SenderRoom
from tests.conftest import hf_greedy, random_prompts
from tests.unit.test_disagg_inprocess import Sink, assert_drained, shutdown

pytestmark = pytest.mark.timeout(300)
PAGE = 4
PRECOPY_ROOM, HANDOFF_ROOM = 0x1234567, 0x7654321


def _decode_side(model: Any, radix: bool) -> tuple[Any, Any, Sink]:
    cfg = EngineConfig(
        model_path=str(model),
        role="decode",
        page_size=PAGE,
        max_total_tokens=2048,
        disable_radix_cache=not radix,
    )
    sink = Sink()
    transfer = TransferConfig(backend="fake", room_timeout=120.0)
    sched, handler = start_role("decode", cfg, ModelConfig.from_pretrained(model), sink, transfer)
    return sched, handler, sink


def _drive(sides: Sequence[Any], until: Callable[[], bool], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline, "timed out"
        for sched, handler, _ in sides:
            handler.poll()
            if sched.has_work():
                sched.step()
            handler.poll()
        time.sleep(0.001)


@pytest.mark.parametrize("source_radix", [True, False])
def test_a_retraction_never_hands_a_precopys_pages_to_another_request(
    tiny_model: Any, monkeypatch: pytest.MonkeyPatch, source_radix: bool
) -> None:
    lane_waits, lane_paused = threading.Event(), threading.Event()
    before_push = FakeBackend.before_push

    def paused(self: FakeBackend, room: int) -> None:  # the source's lane, before each read
        if room == PRECOPY_ROOM:
            lane_paused.set()
            assert lane_waits.wait(120)
        before_push(self, room)

    read: list[int] = []  # the source pages the pre-copy room reads
    send = SenderRoom.send

    def recorded(self: SenderRoom, pages: Sequence[int], start: int, ready: Any = None) -> None:
        if self.room == PRECOPY_ROOM:
            read.extend(pages)
        send(self, pages, start, ready)

    monkeypatch.setattr(FakeBackend, "before_push", paused)
    monkeypatch.setattr(SenderRoom, "send", recorded)
    src, dst = _decode_side(tiny_model, source_radix), _decode_side(tiny_model, radix=True)
    (ss, sh, ssink), (ds, dh, dsink) = src, dst
    src_peer = PeerInfo("d1", sh.kv_control_address, sh.transfer_address)
    dst_peer = PeerInfo("d2", dh.kv_control_address, dh.transfer_address)
    try:
        first, moving, filler = random_prompts([30, 50, 300], vocab=2000, seed=41)
        greedy = SamplingParams(temperature=0.0, max_new_tokens=160, ignore_eos=True)
        sh.on_generate(GenerateReq("first", first, greedy))
        _drive([src], lambda: len(ssink.tokens.get("first", [])) >= 2)
        sh.on_generate(GenerateReq("moving", moving, greedy))  # the newest: retracted first
        _drive([src], lambda: len(ssink.tokens.get("moving", [])) >= 6)

        # The router's pre-copy (services/router/precopy.py): the target asks for the whole
        # pages of the context but its last token, the source sends them and decodes on.
        context = moving + ssink.tokens["moving"]
        tokens = (len(context) - 1) // PAGE * PAGE
        warming = SamplingParams(max_new_tokens=1)
        dh.on_generate(GenerateReq("moving-pc", context[:tokens], warming, PRECOPY_ROOM, src_peer))
        assert sh.on_migrate(MigrateReq("moving", PRECOPY_ROOM, dst_peer, tokens)) is None
        _drive([src, dst], lane_paused.is_set)
        assert len(read) == tokens // PAGE
        pool = ss.runner.pool.buffer
        before = pool[read].clone()

        req = ss.requests["moving"]
        with monkeypatch.context() as m:  # one step, the pool looks short: it is retracted
            m.setattr(ss.cache, "available_pages", lambda: -1)
            ss.step()
        assert ss.decode.num_retracted == 1 and req.slot is None
        if ss.cache.radix is not None:
            ss.cache.radix.evict(ss.allocator.num_pages)  # all that nobody holds
        assert not any(ss.allocator.is_free(p) for p in read)
        sh.on_generate(GenerateReq("filler", filler, SamplingParams(max_new_tokens=4)))
        _drive([src], lambda: len(ssink.tokens.get("filler", [])) >= 2 and req.slot is not None)
        taken = [r.pages[r.cached_len // PAGE :] for r in ss.requests.values()]
        assert not set(read) & {p for pages in taken for p in pages}  # nobody's own page
        assert not any(ss.allocator.is_free(p) for p in read)
        assert torch.equal(pool[read], before), "a pre-copied page changed under the copy"
        assert sh.outgoing.precopying["moving"].sender.poll() == KVPoll.Transferring

        lane_waits.set()
        _drive([src, dst], lambda: "moving-pc" in dsink.done and not sh.outgoing.precopying)
        assert dsink.done["moving-pc"].finish_reason.value == "length"  # cached on the target
        cached, _ = ds.cache.radix.match_prefix(context[:tokens])
        assert len(cached) == tokens // PAGE
        assert torch.equal(ds.runner.pool.buffer[cached], before)

        # The hand-off: the target finds the pre-copied pages in its cache.
        assert sh.on_migrate(MigrateReq("moving", HANDOFF_ROOM, dst_peer)) is None
        _drive([src, dst], lambda: "moving" in ssink.done)
        assert ssink.done["moving"].finish_reason.value == "migrated"
        passed = ssink.tokens["moving"]
        resumed = greedy.replace(
            max_new_tokens=greedy.max_new_tokens - len(passed) + 1,
            output_offset=len(passed) - 1,
        )
        prompt = moving + passed[:-1]
        dh.on_generate(GenerateReq("moving", prompt, resumed, HANDOFF_ROOM, src_peer))
        _drive([src, dst], lambda: "moving" in dsink.done and "first" in ssink.done)
        assert passed + dsink.tokens["moving"] == hf_greedy(tiny_model, moving, 160)
        assert ssink.tokens["first"] == hf_greedy(tiny_model, first, 160)
        assert sh.outgoing.pages_sent == -(-len(prompt) // PAGE) - tokens // PAGE  # the rest
        _drive([src, dst], lambda: not sh.has_work() and not dh.has_work())
        assert ss.cache.pages_in_use() == 0 and ds.cache.pages_in_use() == 0
        assert_drained(src, dst)
    finally:
        lane_waits.set()
        shutdown(src, dst)
