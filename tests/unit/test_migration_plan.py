"""Where a worker's streams go when it is emptied (`plan_moves`, issue 41): spread over the
other decode workers by the policy, each move planned counting toward the next choice's
load, not all to the one that was least loaded before the plan, and only onto a target
with a running slot and KV pages free for the stream: what fits nowhere stays."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

from baton.common.rpc import baton_pb2 as pb
from baton.services.router.migration import plan_moves
from baton.services.router.policies import PowerOfTwo
from baton.services.router.worker_handle import WorkerHandle


def worker(
    worker_id: str, running: int, slots: int = 0, pages: int = 0, usage: float = 0.0
) -> WorkerHandle:
    """A decode worker running `running`; with `slots`, its max_running_requests, and
    `pages` of 4 tokens, a fraction `usage` of them in use (0: no capacity reported)."""
    info = pb.WorkerInfo(
        worker_id=worker_id,
        role=pb.DECODE,
        load=pb.Load(running=running, token_usage=usage),
        capacity=pb.Capacity(max_running_requests=slots, num_pages=pages, page_size=4),
    )
    return WorkerHandle(info, stub=None)  # type: ignore[arg-type]


class Pool:
    def __init__(self, *handles: WorkerHandle) -> None:
        self.handles = list(handles)

    def workers(self, role: int) -> list[WorkerHandle]:
        return [w for w in self.handles if w.role == role]


@dataclass
class Running:
    request_id: str
    worker: WorkerHandle
    input_ids: list[int] = field(default_factory=lambda: [1, 2, 3])
    context_tokens: int = 830


def test_a_flip_spreads_its_streams_over_the_other_decode_workers() -> None:
    source, busier, quieter = worker("d0", 31), worker("d1", 22), worker("d2", 20)
    pool = Pool(source, busier, quieter)
    streams = [Running(f"r{i}", source) for i in range(31)]
    policy = PowerOfTwo(random.Random(41))
    plans, stay = plan_moves(pool, streams, None, policy.choose)  # type: ignore[arg-type]
    assert stay == []  # (no capacity reported: room for any number)
    where = Counter(target.worker_id for _, target in plans)
    # d2 first takes the 2 it was short of d1, then the two alternate (ties at random)
    assert where["d1"] + where["d2"] == 31 and where.keys() == {"d1", "d2"}
    assert abs((22 + where["d1"]) - (20 + where["d2"])) <= 1, where
    assert source.in_flight == busier.in_flight == quieter.in_flight == 0  # only while planning


def test_a_named_target_takes_them_all() -> None:
    source, one = worker("d0", 4), worker("d1", 0)
    streams = [Running(f"r{i}", source) for i in range(4)]
    full = worker("d2", 9, slots=9, pages=100)
    pool = Pool(source, one, full)
    plans, stay = plan_moves(pool, streams, full, PowerOfTwo().choose)  # type: ignore[arg-type]
    assert [target for _, target in plans] == [full] * 4 and stay == []  # room or not
    assert full.in_flight == 0


def test_a_burst_fills_each_targets_free_slots_and_the_rest_stay() -> None:
    source = worker("d0", 31, slots=32, pages=10_000)
    roomy, tight = (
        worker("d1", 20, slots=32, pages=10_000),
        worker("d2", 28, slots=32, pages=10_000),
    )
    streams = [Running(f"r{i}", source) for i in range(31)]
    plans, stay = plan_moves(
        Pool(source, roomy, tight), streams, None, PowerOfTwo(random.Random(1)).choose
    )  # type: ignore[arg-type]
    where = Counter(target.worker_id for _, target in plans)
    assert where == {"d1": 12, "d2": 4}  # up to 32 running on each, none queued
    assert [s.request_id for s in stay] == [f"r{i}" for i in range(16, 31)]


def test_the_routers_own_count_is_used_when_the_report_lags() -> None:
    source, target = worker("d0", 4, slots=8, pages=1000), worker("d1", 0, slots=8, pages=1000)
    target.in_flight = 6  # placed there since its last report said 0
    streams = [Running(f"r{i}", source) for i in range(4)]
    plans, stay = plan_moves(Pool(source, target), streams, None, PowerOfTwo().choose)  # type: ignore[arg-type]
    assert len(plans) == 2 and len(stay) == 2


def test_a_long_context_goes_where_its_pages_fit() -> None:
    source = worker("d0", 2, slots=64, pages=4096)
    # d1: 40 pages free (160 tokens); d2: 2,048 free
    small, large = (
        worker("d1", 0, slots=64, pages=400, usage=0.9),
        worker("d2", 50, slots=64, pages=4096, usage=0.5),
    )
    short, long = (
        Running("short", source, context_tokens=100),
        Running("long", source, context_tokens=8000),
    )
    plans, stay = plan_moves(
        Pool(source, small, large), [long, short], None, PowerOfTwo(random.Random(3)).choose
    )  # type: ignore[arg-type]
    assert dict((g.request_id, t.worker_id) for g, t in plans)["long"] == "d2"
    assert stay == []
    # 8,001 tokens need 2,001 pages of 4: d2 has room for one such context, not two
    again, stay = plan_moves(
        Pool(source, small, large),
        [long, Running("long2", source, context_tokens=8000)],
        None,
        PowerOfTwo().choose,
    )  # type: ignore[arg-type]
    assert [t.worker_id for _, t in again] == ["d2"] and [g.request_id for g in stay] == ["long2"]
