"""Where a worker's streams go when it is emptied (`plan_moves`, issue 41): spread over the
other decode workers by the policy, each move planned counting toward the next choice's
load, not all to the one that was least loaded before the plan."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

from baton.common.rpc import baton_pb2 as pb
from baton.services.router.migration import plan_moves
from baton.services.router.policies import PowerOfTwo
from baton.services.router.workers import WorkerHandle


def worker(worker_id: str, running: int) -> WorkerHandle:
    info = pb.WorkerInfo(worker_id=worker_id, role=pb.DECODE, load=pb.Load(running=running))
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


def test_a_flip_spreads_its_streams_over_the_other_decode_workers() -> None:
    source, busier, quieter = worker("d0", 31), worker("d1", 22), worker("d2", 20)
    pool = Pool(source, busier, quieter)
    streams = [Running(f"r{i}", source) for i in range(31)]
    policy = PowerOfTwo(random.Random(41))
    plans = plan_moves(pool, streams, None, policy.choose)  # type: ignore[arg-type]
    where = Counter(target.worker_id for _, target in plans)
    # d2 first takes the 2 it was short of d1, then the two alternate (ties at random)
    assert where["d1"] + where["d2"] == 31 and where.keys() == {"d1", "d2"}
    assert abs((22 + where["d1"]) - (20 + where["d2"])) <= 1, where
    assert source.in_flight == busier.in_flight == quieter.in_flight == 0  # only while planning


def test_a_named_target_takes_them_all() -> None:
    source, one, other = worker("d0", 4), worker("d1", 0), worker("d2", 9)
    streams = [Running(f"r{i}", source) for i in range(4)]
    plans = plan_moves(Pool(source, one, other), streams, other, PowerOfTwo().choose)  # type: ignore[arg-type]
    assert [target for _, target in plans] == [other] * 4
    assert other.in_flight == 0
