"""The placer: `--placement`'s rules on the pool's workers (their caches, loads and fitted
step times), without processes."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from prometheus_client.parser import text_string_to_metric_families

from baton.common.rpc import baton_pb2 as pb
from baton.services.router.attempt import Attempt
from baton.services.router.metrics import RouterMetrics
from baton.services.router.placement import DELTA, FULL, LOCAL, Slo
from baton.services.router.placer import Placer
from baton.services.router.worker_handle import WorkerHandle

PAGE = 4


class Pool:
    """The part of WorkerPool the placer reads: one P, two D's, all compatible."""

    def __init__(self) -> None:
        self.handles = {
            "p": worker("p", pb.PREFILL),
            "d1": worker("d1", pb.DECODE),
            "d2": worker("d2", pb.DECODE),
        }
        self.joined: list[Callable[[], None]] = []

    def on_joined(self, listener: Callable[[], None]) -> None:
        self.joined.append(listener)

    def on_removed(self, listener: Callable[[str], None]) -> None:
        pass

    def workers(self, role: int) -> list[WorkerHandle]:
        return [w for _, w in sorted(self.handles.items()) if w.role == role]

    def get(self, worker_id: str) -> WorkerHandle | None:
        return self.handles.get(worker_id)

    def compatible(self, prefill: WorkerHandle, decode: WorkerHandle) -> bool:
        return True

    def report(self, worker_id: str, load: pb.Load) -> None:
        """A heartbeat: the worker's new load reaches the pool, and its listeners."""
        self.handles[worker_id].info.load.CopyFrom(load)
        for listener in self.joined:
            listener()


def worker(worker_id: str, role: int) -> WorkerHandle:
    info = pb.WorkerInfo(
        worker_id=worker_id,
        role=role,
        layout=pb.KVLayout(page_size=PAGE, dtype="bfloat16", num_layers=32, num_kv_heads=8),
        load=pb.Load(prefix_cache=True),
    )
    info.layout.head_dim = 128
    return WorkerHandle(info, stub=None)  # type: ignore[arg-type]


def placer(rule: str, pool: Pool) -> Placer:
    def policies_pair(ids: list[int], avoid: set[str]) -> tuple[WorkerHandle, WorkerHandle]:
        return pool.handles["p"], pool.handles["d2" if "d1" in avoid else "d1"]

    return Placer(pool, policies_pair, rule, Slo(2.0, 0.02))  # type: ignore[arg-type]


def steps(
    prefill: tuple[float, float, float],
    decode: tuple[float, float, float],
    sent: float = 0,
    slack: float = 3.0,
) -> pb.Load:
    """A load with these cumulative counts, `sent` bytes of KV sent at 10 GB/s, and its
    running requests' TPOT slack."""
    times = pb.StepTimes(
        prefill_steps=prefill[0],
        prefill_tokens=prefill[1],
        prefill_seconds=prefill[2],
        decode_steps=decode[0],
        decode_rows=decode[1],
        decode_seconds=decode[2],
        decode_slack=slack,
    )
    return pb.Load(
        step_times=times,
        prefix_cache=True,
        running=4,
        kv_bytes_sent=sent,
        kv_send_seconds=sent / 1e10,
    )


def test_always_disagg_names_delta_only_where_d_keeps_a_cache() -> None:
    pool = Pool()
    place = placer("always-disagg", pool)
    turn1 = list(range(10, 110))
    placement, prefill, decode = place.place(turn1, set()) or (None, None, None)
    assert placement is not None and (placement.kind, placement.reason) == (FULL, "always-disagg")
    assert (prefill, decode) == (pool.handles["p"], pool.handles["d1"])
    place.remember([*turn1, 7, 7], pool.handles["d1"])  # D1 answered
    turn2 = [*turn1, 7, 7, 8, 9]
    assert place.place(turn2, set())[0].kind == DELTA  # type: ignore[index]
    pool.handles["d1"].info.load.prefix_cache = False  # (a D without --decode-radix-cache)
    assert place.place(turn2, set())[0].kind == FULL  # type: ignore[index]


def test_threshold_computes_a_follow_up_on_the_d_that_holds_it_unless_avoided() -> None:
    pool = Pool()
    place = placer("threshold", pool)
    turn1 = list(range(10, 110))
    assert place.place(turn1, set())[0].kind == FULL  # type: ignore[index]
    place.remember([*turn1, 5, 6], pool.handles["d1"])  # D1 answered turn one
    turn2 = [*turn1, 5, 6, *range(300, 310)]
    placement, prefill, decode = place.place(turn2, set()) or (None, None, None)
    assert placement is not None and placement.kind == LOCAL
    assert (prefill, decode) == (None, pool.handles["d1"])
    # 102 tokens known on D1: 100 of them in whole pages of 4
    assert placement.reason == "threshold: 12 of 112 tokens uncached on D"
    rerun = place.place(turn2, {"d1"})  # D1 failed this request: the rerun goes elsewhere
    assert rerun is not None and rerun[0].kind == FULL and rerun[2] is pool.handles["d2"]


def test_cost_places_from_the_step_times_the_workers_report() -> None:
    pool = Pool()
    place = placer("cost", pool)
    history = list(range(10, 2010))
    first = place.place(history, set())
    assert first is not None and first[0].reason == "no step times measured yet"
    answer = list(range(3000, 3300))  # D1 answered: only D1 holds the answer
    place.remember([*history, *answer], pool.handles["d1"])
    # prompt steps of 5 ms + 0.05 ms a token, decode steps of 12 ms + 0.5 ms a row, and P
    # sending 10 GB/s
    for worker_id in ("p", "d1", "d2"):
        pool.report(worker_id, steps((0, 0, 0), (0, 0, 0)))
        pool.report(worker_id, steps((10, 10_000, 0.55), (100, 800, 1.6), sent=1e9))
        pool.report(worker_id, steps((20, 30_000, 1.6), (200, 2400, 3.6), sent=2e9))
    turn2 = [*history, *answer, *range(5000, 5040)]
    follow_up = place.place(turn2, set())
    assert follow_up is not None and follow_up[0].kind == LOCAL and follow_up[2].worker_id == "d1"
    # D1's running requests report their TPOT slack spent: nothing more is computed there
    pool.report("d1", steps((20, 30_000, 1.6), (200, 2400, 3.6), sent=2e9, slack=0.0))
    spent = place.place(turn2, set())
    assert spent is not None and spent[0].kind != LOCAL
    new = place.place(list(range(6000, 14000)), set())
    assert new is not None and (new[0].kind, new[1]) == (FULL, pool.handles["p"])


def test_cost_keeps_prompts_off_a_decode_worker_whose_steps_now_reach_the_tpot_slo() -> None:
    pool = Pool()
    place = placer("cost", pool)
    history = list(range(10, 2010))
    place.remember(history, pool.handles["d1"])  # D1 served turn one
    # decode steps of its 4 rows at 10 ms
    for worker_id in ("p", "d1", "d2"):
        pool.report(worker_id, steps((0, 0, 0), (0, 0, 0)))
        pool.report(worker_id, steps((10, 10_000, 0.55), (100, 400, 1.0), sent=1e9))
        pool.report(worker_id, steps((20, 30_000, 1.6), (200, 800, 2.0), sent=2e9))
    turn2 = [*history, *range(5000, 5040)]
    assert place.place(turn2, set())[0].kind == LOCAL  # type: ignore[index]
    # D1's latest 100 steps of the same rows took 19 ms each (their contexts grew, or
    # a neighbour on the device): its fitted line lags, its step now is past 90% of the
    # TPOT SLO, whatever slack it reported
    pool.report("d1", steps((20, 30_000, 1.6), (300, 1200, 3.9), sent=2e9, slack=3.0))
    assert place.place(turn2, set())[0].kind != LOCAL  # type: ignore[index]


def test_local_prompts_placed_in_a_burst_spend_a_decode_workers_slack_once() -> None:
    """Prompts arriving faster than the workers report: each local one is owed on its D
    (`Attempt.owe`) until its first token, so the next is costed after it; once the
    owed prompts would spend D's slack, prompts go to P (on 2x H200, 19 prompts placed on
    D within 0.5 s queued there for seconds). Answered, the slack is D's again."""
    pool = Pool()
    place = placer("cost", pool)
    for worker_id in ("p", "d1", "d2"):
        pool.report(worker_id, steps((0, 0, 0), (0, 0, 0)))
        pool.report(worker_id, steps((10, 10_000, 0.55), (100, 400, 1.0), sent=1e9, slack=0.3))
        pool.report(worker_id, steps((20, 30_000, 1.6), (200, 800, 2.0), sent=2e9, slack=0.3))
    pool.handles["p"].info.load.queued = 12  # P is busy: ~0.7 s before a new prompt starts
    attempts, kinds = [], []
    for i in range(20):
        placed = place.place(list(range(10_000 * (i + 1), 10_000 * (i + 1) + 1000)), set())
        assert placed is not None
        placement, _, decode = placed
        kinds.append(placement.kind)
        if placement.kind == LOCAL:
            attempt = Attempt(f"r{i}", lambda worker, rid: None)
            attempt.owe(decode, placement.computes)
            attempts.append(attempt)
    locals_ = kinds.count(LOCAL)
    assert 2 <= locals_ < 20 and kinds[-1] != LOCAL, kinds
    # what each D owes fits in its slack: about 1,000 tokens of 0.05 ms each a prompt
    for d in ("d1", "d2"):
        assert pool.handles[d].prompt_tokens_owed * 0.05e-3 <= 0.3 + 1e-9
    for attempt in attempts:
        attempt.close()  # answered (or failed): nothing owed any more
    assert pool.handles["d1"].prompt_tokens_owed == pool.handles["d2"].prompt_tokens_owed == 0
    again = place.place(list(range(900_000, 901_000)), set())
    assert again is not None and again[0].kind == LOCAL


def test_the_router_exports_what_the_cost_placement_reads() -> None:
    """An operator sees each worker's fitted lines, its decode step now, the local prompt
    tokens it owes and the transfer rate on the router's /metrics."""
    pool = Pool()
    metrics = RouterMetrics(dict, "m")
    Placer(pool, lambda ids, avoid: None, "cost", Slo(2.0, 0.02), metrics=metrics)  # type: ignore[arg-type,return-value]
    for worker_id in ("p", "d1"):
        pool.report(worker_id, steps((0, 0, 0), (0, 0, 0)))
        pool.report(worker_id, steps((10, 10_000, 0.55), (100, 400, 1.0), sent=1e9))
        pool.report(worker_id, steps((20, 30_000, 1.6), (200, 800, 2.0), sent=2e9))
    pool.handles["d1"].owed_prompts = [1331]
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for s in family.samples
    }

    def line(worker: str, kind: str, term: str) -> float:
        labels = (("kind", kind), ("term", term), ("worker_id", worker))
        return samples[("baton_router_step_line_seconds", labels)]

    # prompt steps of 5 ms + 0.05 ms a token (the two intervals' means lie on it)
    assert line("p", "prefill", "intercept") == pytest.approx(0.005)
    assert line("p", "prefill", "slope") == pytest.approx(0.00005)
    assert line("d1", "decode", "intercept") + 2 * line("d1", "decode", "slope") > 0
    assert samples[("baton_router_decode_step_now_seconds", (("worker_id", "d1"),))] == 0.01
    assert samples[("baton_router_prompt_tokens_owed", (("worker_id", "d1"),))] == 1331
    assert samples[("baton_router_prompt_tokens_owed", (("worker_id", "d2"),))] == 0
    assert samples[("baton_router_kv_transfer_bytes_per_second", ())] == pytest.approx(1e10)
    assert ("baton_router_step_line_seconds", (("kind", "prefill"), ("term", "slope"), ("worker_id", "d2"))) not in samples  # fmt: skip
