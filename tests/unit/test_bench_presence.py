"""What a benchmark run records of the workers it measured (`benchmarks/presence.py`): a
worker that leaves marks the run partial; one changing role (the planner's flips) does not."""

from __future__ import annotations

from typing import Any

from baton.benchmarks.presence import Presence, Reading


def health(workers: dict[str, int], ids: list[str], changing: dict[str, Any] | None = None,
           expected: dict[str, int] | None = None) -> Reading:  # fmt: skip
    body: dict[str, Any] = {"status": "ok", "workers": workers, "worker_ids": ids}
    if changing:
        body["changing"] = changing
    if expected:
        body["expected"] = expected
    return Reading.from_answer(200, body)


START = health(
    {"prefill": 1, "decode": 2}, ["d0", "d1", "p0"], expected={"prefill": 1, "decode": 2}
)


def watched(*readings: Reading) -> Presence:
    presence = Presence(START, fewest=dict(START.workers or {}))
    for reading in readings:
        presence.note(reading)
    presence.end = readings[-1]
    return presence


def test_a_worker_changing_role_is_not_a_worker_lost() -> None:
    switching = health({"prefill": 1, "decode": 1}, ["d1", "p0"],
                       {"d0": {"state": "switching", "from": "decode", "to": "prefill"}},
                       expected={"prefill": 1, "decode": 2})  # fmt: skip
    assert switching.missing == {} and switching.total == 3
    after = health(
        {"prefill": 2, "decode": 1}, ["d0", "d1", "p0"], expected={"prefill": 2, "decode": 1}
    )
    presence = watched(switching, after)
    assert presence.partial is None and presence.lost == []
    assert presence.to_dict()["fewest_total"] == 3


def test_a_worker_that_leaves_marks_the_run_partial() -> None:
    gone = health({"prefill": 1, "decode": 1}, ["d1", "p0"], expected={"prefill": 1, "decode": 2})
    presence = watched(gone)
    assert (
        presence.partial is not None
        and "decode 2 at the start, 1 during the run" in presence.partial
    )
    assert presence.lost == ["d0"]
    # one that left while another joined: the total holds, the loss still shows
    replaced = health({"prefill": 2, "decode": 1}, ["d1", "p0", "p9"])
    presence = watched(replaced)
    assert presence.partial is not None and "(lost d0)" in presence.partial
