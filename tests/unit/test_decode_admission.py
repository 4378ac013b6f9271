"""A decode worker admits rooms as fast as its KV pool and running cap allow.

On four H100s each decode worker admitted about 9 requests/s while its GPU idled (issue
#38): its pool was the CPU default of 32k tokens, so about 20 requests of 1,500 tokens fit.
Here one decode role runs its real admission path (prealloc queue, `port.reserve`, the
KV-control messages, the `fake` data plane, the join) against a prefill side that sends
each room's pages the moment it learns where they go, while each scheduler step is a
10 ms sleep."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from baton.common.config import EngineConfig, ModelConfig, TransferConfig
from baton.common.disagg.start import start_role
from baton.common.disagg.transfer_role import FirstToken, encode_aux
from baton.common.protocol import GenerateReq, PeerInfo
from baton.common.sampling import SamplingParams
from baton.common.transfer.base import KVArgs, KVPoll, KVSender
from baton.common.transfer.manager import TransferManager
from baton.common.transfer.testing import kv_buffer
from tests.unit.test_disagg_inprocess import Sink

STEP_S = 0.010
PROMPT = 256
ROOMS = 150


class InstantPrefill:
    """P without a model: a room's pages go out as soon as D's page list arrives."""

    def __init__(self, d_pool_shape: tuple[int, ...], dtype, d_control: str) -> None:  # type: ignore[no-untyped-def]
        pages, layers, _, page_size, heads, dim = d_pool_shape
        buffer, page_bytes = kv_buffer(pages, page_size, layers, heads, dim, dtype, seed=None)
        self.manager = TransferManager(KVArgs(buffer, page_bytes, pages), "prefill", "fake")
        self.d_control = d_control
        self.senders: dict[int, KVSender] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def add(self, room: int) -> None:
        with self._lock:
            self.senders[room] = self.manager.create_sender(room, self.d_control)

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                waiting = [
                    (room, s)
                    for room, s in self.senders.items()
                    if s.poll() == KVPoll.WaitingForInput
                ]
            for room, sender in waiting:
                sender.send(list(range(sender.num_dst_pages or 0)), 0, None)
                sender.finish(encode_aux(FirstToken(7)))
                with self._lock:
                    del self.senders[room]
            time.sleep(0.0005)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.manager.shutdown()


@contextmanager
def decode_and_prefill(model) -> Iterator[tuple]:  # type: ignore[no-untyped-def,type-arg]
    cfg = EngineConfig(
        model_path=str(model),
        role="decode",
        page_size=16,
        max_total_tokens=ROOMS * (PROMPT + 80),
        max_running_requests=ROOMS + 16,
    )
    transfer = TransferConfig(backend="fake", room_timeout=30.0)
    sched, role = start_role("decode", cfg, ModelConfig.from_pretrained(model), Sink(), transfer)
    prefill = InstantPrefill(
        tuple(sched.runner.pool.buffer.shape), cfg.torch_dtype, role.kv_control_address
    )
    try:
        yield sched, role, prefill
    finally:
        prefill.close()
        role.shutdown()
        sched.shutdown()


def arrive(role, prefill, n: int) -> list[str]:  # type: ignore[no-untyped-def]
    rids = []
    params = SamplingParams(temperature=0.0, max_new_tokens=256, ignore_eos=True)
    p_peer = PeerInfo("p", prefill.manager.control_address)
    for _ in range(n):
        room = random.getrandbits(62) | 1
        rid = f"r{room}"
        prefill.add(room)
        role.on_generate(GenerateReq(rid, list(range(1, PROMPT + 1)), params, room, p_peer))
        rids.append(rid)
    return rids


def fake_loop(sched, role, until, timeout: float) -> int:  # type: ignore[no-untyped-def]
    """The worker's loop with a 10 ms step: poll, step, poll. Returns the steps taken."""
    steps = 0
    deadline = time.monotonic() + timeout
    while not until() and time.monotonic() < deadline:
        role.poll()
        time.sleep(STEP_S)  # the GPU step
        steps += 1
        role.poll()
    return steps


def test_one_poll_admits_every_room_that_fits(tiny_model) -> None:
    with decode_and_prefill(tiny_model) as (sched, role, prefill):
        arrive(role, prefill, 100)
        role.poll()  # admits all (the fastest may even have landed and joined)
        assert not role.prealloc
        assert len(role.transferring) + len(sched.decode.running) == 100
        fake_loop(sched, role, lambda: len(sched.decode.running) == 100, timeout=30)
        assert len(sched.decode.running) == 100


def test_a_decode_worker_joins_rooms_far_faster_than_its_steps(tiny_model) -> None:
    """Rooms arriving at 200/s, one every 5 ms: with 10 ms steps D keeps up."""
    with decode_and_prefill(tiny_model) as (sched, role, prefill):
        start = time.monotonic()
        sent = 0
        while sent < ROOMS:
            due = int((time.monotonic() - start) / 0.005) + 1
            arrive(role, prefill, min(due, ROOMS) - sent)
            sent = min(due, ROOMS)
            role.poll()
            time.sleep(STEP_S)
            role.poll()
        fake_loop(sched, role, lambda: len(sched.decode.running) == ROOMS, timeout=30)
        elapsed = time.monotonic() - start
        rate = len(sched.decode.running) / elapsed
        assert len(sched.decode.running) == ROOMS, role.stats()
        print(f"{rate:.0f} rooms/s joined")
        assert rate >= 50, f"{rate:.0f} rooms/s joined"
        admission = [r.times["decode_admission"] for r in sched.decode.running]
        assert sorted(admission)[len(admission) // 2] < 0.02  # p50 under 20 ms
