"""Prefill and decode schedulers in one process, joined by the real KV transfer layer.

The full multi-process path is covered by the integration tests; this one pins the role
logic (bootstrap queue, prealloc, first-token handoff, release) fast and deterministically.
"""

from __future__ import annotations

import itertools
import random
import time

import pytest

from baton.common.config import EngineConfig, ModelConfig, TransferConfig
from baton.common.disagg.start import start_role
from baton.common.protocol import GenerateReq, PeerInfo
from baton.common.sampling import SamplingParams
from baton.common.state import Req, SpanRecord, TokenLogprob
from tests.conftest import hf_greedy, random_prompts


class Sink:
    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.done: dict[str, Req] = {}
        self.finished: list[Req] = []  # every one, kept
        self.spans: dict[str, list[SpanRecord]] = {}  # taken at the finish, as the worker does

    def __call__(
        self, req: Req, tokens: list[int], lps: list[TokenLogprob], finished: bool
    ) -> None:
        self.tokens.setdefault(req.rid, []).extend(tokens)
        if finished:
            self.done[req.rid] = req
            self.finished.append(req)
            if req.trace is not None:
                self.spans[req.rid] = req.trace.take()


def make_side(model, role: str, backend: str, checksum: bool = True, **opts):  # type: ignore[no-untyped-def]
    opts.setdefault("max_total_tokens", 4096)
    cfg = EngineConfig(model_path=str(model), role=role, **opts)  # type: ignore[arg-type]
    sink = Sink()
    transfer = TransferConfig(backend=backend, room_timeout=5.0, verify_checksum=checksum)
    sched, handler = start_role(role, cfg, ModelConfig.from_pretrained(model), sink, transfer)
    return sched, handler, sink


def traceparents(rid: str) -> tuple[str, str]:
    """The W3C contexts of `rid`'s worker spans on P and D (one trace, one per side)."""
    trace = rid.encode().hex().ljust(32, "0")[:32]
    return f"00-{trace}-{'1' * 16}-01", f"00-{trace}-{'2' * 16}-01"


def run_pd(p, d, prompts, params, timeout=60.0, per_step=0, traced=False):  # type: ignore[no-untyped-def]
    """Run `prompts` through P and D to the end; all at once, or (`per_step`) that many
    arriving before each step while any are left; `traced`: under `traceparents`."""
    (ps, ph, psink), (ds, dh, dsink) = p, d
    rooms = {
        f"r{i}-{random.getrandbits(30)}": random.getrandbits(62) | 1 for i in range(len(prompts))
    }
    arrivals = list(zip(rooms.items(), prompts, strict=True))

    def arrive(n: int) -> None:
        for (rid, room), prompt in arrivals[:n]:
            d_peer = PeerInfo("d", dh.kv_control_address, dh.transfer_address)
            p_peer = PeerInfo("p", ph.kv_control_address)
            on_p, on_d = traceparents(rid) if traced else (None, None)
            dh.on_generate(GenerateReq(rid, prompt, params, room, p_peer, on_d))
            ph.on_generate(GenerateReq(rid, prompt, params, room, d_peer, on_p))
        del arrivals[:n]

    arrive(per_step or len(arrivals))
    deadline = time.monotonic() + timeout
    while arrivals or any(rid not in dsink.done for rid in rooms) or ph.has_work():
        assert time.monotonic() < deadline, "PD run did not finish"
        arrive(per_step)
        for sched, handler in ((ps, ph), (ds, dh)):
            handler.poll()
            if sched.has_work():
                sched.step()
            handler.poll()
        if not ps.has_work() and not ds.has_work():
            time.sleep(0.001)
    outs = [psink.tokens.pop(rid) + dsink.tokens.pop(rid, []) for rid in rooms]
    for rid in rooms:
        dsink.done.pop(rid)
    return outs, rooms


@pytest.mark.parametrize(
    ("page_size", "chunk", "radix"), list(itertools.product([1, 16], [None, 16], [False, True]))
)
def test_pd_matches_transformers(tiny_model, page_size, chunk, radix) -> None:
    p = make_side(tiny_model, "prefill", "tcp", page_size=page_size, chunked_prefill_size=chunk)
    d = make_side(tiny_model, "decode", "tcp", page_size=page_size, disable_radix_cache=not radix)
    try:
        prompts = random_prompts([1, 17, 64, 150], vocab=2000, seed=page_size)
        prompts.append([*prompts[3][:100], 7, 8, 9])  # shares a prefix with the previous one
        params = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)
        for _ in range(2):  # the second pass hits both radix caches
            outs, _ = run_pd(p, d, prompts, params)
            assert outs == [hf_greedy(tiny_model, pr, 10) for pr in prompts]
        for sched, handler, _ in (p, d):
            assert not handler.has_work()
            sched.check_integrity()
            if sched.cache.radix is not None:
                sched.cache.radix.reset()
            assert sched.allocator.num_free == sched.cfg.num_pages, "pages leaked"
    finally:
        for sched, handler, _ in (p, d):
            handler.shutdown()
            sched.shutdown()


def assert_drained(*sides) -> None:  # type: ignore[no-untyped-def]
    for sched, handler, _ in sides:
        assert not handler.has_work()
        sched.check_integrity()
        if sched.cache.radix is not None:
            sched.cache.radix.reset()
        assert sched.allocator.num_free == sched.allocator.num_pages, "pages leaked"


def shutdown(*sides) -> None:  # type: ignore[no-untyped-def]
    for sched, handler, _ in sides:
        handler.shutdown()
        sched.shutdown()


@pytest.mark.parametrize("checksum", [True, False])
def test_auto_writes_directly_on_one_host(tiny_model, checksum: bool) -> None:
    """`auto` picks ipc between two workers of one host: P copies into D's memfd pool, and
    (without checksums, which P computes after the copies) rings D's doorbells."""
    p = make_side(tiny_model, "prefill", "auto", checksum, page_size=16, chunked_prefill_size=32)
    d = make_side(tiny_model, "decode", "auto", checksum, page_size=16)
    try:
        prompts = random_prompts([3, 40, 130], vocab=2000, seed=5)
        params = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
        outs, _ = run_pd(p, d, prompts, params)
        assert outs == [hf_greedy(tiny_model, pr, 8) for pr in prompts]
        assert p[1].stats()["kv_connections_ipc"] >= 1
        assert d[1].stats()["kv_direct_rooms"] == len(prompts)
        # once the lane connected (during the 130-token prompt's five chunks), a final
        # status left at finish, ahead of the copies, for D's doorbell (see doorbell)
        announced = p[1].stats().get("kv_rooms_announced", 0)
        assert announced == 0 if checksum else announced >= 1
        assert_drained(p, d)
    finally:
        shutdown(p, d)


def test_a_burst_that_overfills_the_decode_pool_completes(tiny_model) -> None:
    """D's pool holds a few requests; 16 arrive at once. They wait (back-pressure, rooms
    kept alive past their 5 s deadline by keepalives) and all complete token-exact."""
    p = make_side(tiny_model, "prefill", "auto", page_size=4, max_total_tokens=8192)
    d = make_side(tiny_model, "decode", "auto", page_size=4, max_total_tokens=640)
    try:
        prompts = random_prompts([100 + 2 * i for i in range(16)], vocab=2000, seed=9)
        params = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)
        outs, _ = run_pd(p, d, prompts, params, timeout=240)
        assert outs == [hf_greedy(tiny_model, pr, 40) for pr in prompts]
        assert_drained(p, d)
        assert not [k for k in d[1].stats() if k.startswith("room_failed")]
    finally:
        shutdown(p, d)


def test_new_rooms_never_overtake_a_request_retracted_on_decode(tiny_model) -> None:
    """D's pool is small and its decode reserve tiny, so running requests get retracted
    while new rooms keep arriving. A retracted request is recomputed before any room that
    D reserves after its retraction: on a GPU under 1.5x load, rooms kept taking the pages
    and retracted requests sat for five minutes."""
    p = make_side(tiny_model, "prefill", "auto", page_size=4, max_total_tokens=8192)
    d = make_side(
        tiny_model, "decode", "auto", page_size=4, max_total_tokens=480, decode_reserve_tokens=4
    )
    ds = d[0]
    events: list[tuple[str, str]] = []
    reserve, retract, add_chunk = ds.reserve, ds.decode._retract, ds.prefill._add_chunk

    def reserved(req):  # type: ignore[no-untyped-def]
        ok = reserve(req)
        if ok:
            events.append(("reserved", req.rid))
        return ok

    def retracted(req):  # type: ignore[no-untyped-def]
        events.append(("retracted", req.rid))
        retract(req)

    def recomputed(plan, req, *budget):  # type: ignore[no-untyped-def]
        events.append(("recomputed", req.rid))
        return add_chunk(plan, req, *budget)

    ds.reserve, ds.decode._retract, ds.prefill._add_chunk = reserved, retracted, recomputed
    try:
        prompts = random_prompts([60 + 3 * i for i in range(14)], vocab=2000, seed=17)
        params = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)
        outs, _ = run_pd(p, d, prompts, params, timeout=240, per_step=1)
        assert outs == [hf_greedy(tiny_model, pr, 40) for pr in prompts]
        waiting: set[str] = set()
        overtaken = []
        for kind, rid in events:
            if kind == "retracted":
                waiting.add(rid)
            elif kind == "recomputed":
                waiting.discard(rid)
            elif waiting:
                overtaken.append((rid, sorted(waiting)))
        assert any(kind == "retracted" for kind, _ in events), "the workload should retract"
        assert overtaken == []
        assert_drained(p, d)
    finally:
        shutdown(p, d)


def test_traced_requests_record_chunks_transfers_and_retractions(tiny_model) -> None:
    """Traced (the frontend's context on the request), each prompt chunk on P, each room's
    transfer on both sides linked to the other side's context (it crossed in the KV
    control messages), and each retraction on D become span records; the tokens stay
    HF's. Untraced requests record nothing."""
    p = make_side(
        tiny_model, "prefill", "auto", page_size=4, max_total_tokens=8192, chunked_prefill_size=32
    )
    d = make_side(
        tiny_model, "decode", "auto", page_size=4, max_total_tokens=480, decode_reserve_tokens=4
    )
    try:
        prompts = random_prompts([60 + 3 * i for i in range(14)], vocab=2000, seed=17)
        params = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)
        outs, rooms = run_pd(p, d, prompts, params, timeout=240, per_step=1, traced=True)
        assert outs == [hf_greedy(tiny_model, pr, 40) for pr in prompts]
        late = {spans.rid: spans for spans in p[1].take_spans() or []}
        assert p[1].take_spans() is None  # taken once
        on_p = {req.rid: req for req in p[2].finished}
        on_d = {req.rid: req for req in d[2].finished}
        for (rid, room), prompt in zip(rooms.items(), prompts, strict=True):
            p_context, d_context = traceparents(rid)
            p_req, d_req = on_p[rid], on_d[rid]
            assert p_req.trace is not None and d_req.trace is not None
            chunks = [s for s in p[2].spans[rid] if s.name == "baton.prefill.chunk"]
            # one after the other (each step's 32 tokens shared among the prompts in it)
            ends = [0] + [
                c.attributes["baton.prefix_tokens"] + c.attributes["baton.chunk_tokens"]  # type: ignore[operator]
                for c in chunks
            ]
            assert [c.attributes["baton.prefix_tokens"] for c in chunks] == ends[:-1]
            assert ends[-1] == len(prompt) and len(chunks) >= len(prompt) / 32
            assert [c.attributes["baton.last_chunk"] for c in chunks][-1]
            assert all(c.start <= c.end for c in chunks)
            (send,) = late[rid].spans  # after P's request ended: on its own
            assert late[rid].traceparent == p_context and send.name == "baton.kv_transfer.send"
            (receive,) = [s for s in d[2].spans[rid] if s.name == "baton.kv_transfer.receive"]
            assert send.links == [d_context] and receive.links == [p_context]
            for side in (send, receive):
                assert side.attributes["baton.room"] == str(room)
                assert side.attributes["baton.kv.outcome"] == "ok"
                assert side.attributes["baton.kv.pages"] == -(-len(prompt) // 4)
                assert side.attributes["baton.kv.bytes"] == send.attributes["baton.kv.bytes"]
            retracted = [s for s in d[2].spans[rid] if s.name == "baton.retracted"]
            assert len(retracted) == d_req.trace.retractions
        retractions = sum(req.trace.retractions for req in on_d.values() if req.trace)
        assert retractions == d[0].decode.num_retracted > 0
        assert_drained(p, d)

        outs, rooms = run_pd(p, d, prompts[:2], params)  # untraced
        assert all(req.trace is None for req in p[2].finished[-2:] + d[2].finished[-2:])
        assert p[1].take_spans() is None
    finally:
        shutdown(p, d)
