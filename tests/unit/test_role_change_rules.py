"""The router's side of a role change without processes (issue 41 item 2): which changes
it refuses, and a held worker out of every choice but still listed."""

from __future__ import annotations

from baton.common.rpc import baton_pb2 as pb
from baton.services.router.roles import refusal, serves
from baton.services.router.workers import WorkerPool
from tests.unit.test_worker_pool import info


def test_serving_needs_an_aggregated_worker_or_a_pair() -> None:
    assert serves({"both": 1})
    assert serves({"prefill": 1, "decode": 1})
    assert not serves({"prefill": 3})
    assert not serves({"decode": 2, "both": 0})


def test_a_change_is_refused_when_the_rest_could_not_serve_meanwhile() -> None:
    # 1P1D: either one away leaves no pair
    assert "could not serve" in refusal({"prefill": 0, "decode": 1, "both": 0})
    assert "could not serve" in refusal({"prefill": 1, "decode": 0, "both": 0})
    # 1P2D: a decode worker may change, the prefill worker may not
    assert refusal({"prefill": 1, "decode": 1, "both": 0}) == ""
    assert "(2 decode)" in refusal({"prefill": 0, "decode": 2, "both": 0})
    # the last aggregated worker beside a lone prefill worker
    assert "could not serve" in refusal({"prefill": 1, "decode": 0, "both": 0})


def test_aggregated_workers_serve_while_a_cluster_turns_p_d() -> None:
    # 3 aggregated: one becomes a prefill worker (no decode worker yet: it waits idle),
    # then another a decode worker, beside the third
    assert refusal({"both": 2}) == ""
    assert refusal({"both": 1, "prefill": 1}) == ""


async def test_a_held_worker_leaves_the_choices_and_counts_but_stays_listed() -> None:
    pool = WorkerPool(None)
    try:
        for worker_id, role, port in (
            ("p", pb.PREFILL, 1),
            ("d1", pb.DECODE, 2),
            ("d2", pb.DECODE, 3),
        ):
            pool.upsert(info(worker_id, role, port))
        pool.hold("d1", "draining")
        assert [w.worker_id for w in pool.workers(pb.DECODE)] == ["d2"]
        assert pool.counts_by_role() == {"both": 0, "prefill": 1, "decode": 1}
        assert pool.worker_ids() == ["d2", "p"]
        assert pool.changing() == {"d1": "draining"}
        d1 = pool.get("d1")
        assert d1 is not None and pool.state(d1) == "draining"
        assert [w.worker_id for w in pool.members()] == ["d1", "d2", "p"]
        # its new role arrives as a registration update of the same process
        pool.upsert(info("d1", pb.PREFILL, 2))
        assert pool.workers(pb.PREFILL)[0].worker_id == "p"  # still held
        pool.release("d1")
        assert pool.changing() == {}
        assert pool.counts_by_role() == {"both": 0, "prefill": 2, "decode": 1}
        assert pool.state(d1) == "serving"
    finally:
        await pool.close()
