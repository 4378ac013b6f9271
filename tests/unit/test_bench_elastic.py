"""A sweep of shapes the planner moves: its decisions read from planner.log within a run's
time, and report.md's sections comparing it with the fixed shapes, phase by phase."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest

from baton.benchmarks.config import BenchConfigError
from baton.benchmarks.elastic_report import planner_decisions, render
from baton.benchmarks.metrics import summarize
from baton.benchmarks.sweep_config import (
    SweepConfig,
    SweepPoint,
    launcher_command,
    parse_shape,
    parse_shapes,
)


def _stamp(at: float) -> str:
    """The planner's asctime for time.time() `at`."""
    return datetime.datetime.fromtimestamp(at).strftime("%Y-%m-%d %H:%M:%S,%f")[:-3]


def test_a_planner_shape_starts_baton_up_with_the_planner_and_a_log_folder() -> None:
    shape = parse_shape("1p3d+Planner")
    assert (shape.name, shape.prefill, shape.decode, shape.planner) == ("1P3D+planner", 1, 3, True)
    command = launcher_command(shape, port=9, model_dir=None, log_dir=Path("/l"))
    assert command[-5:] == ["--decode", "3", "--planner", "--log-dir", "/l"]
    assert "--planner" not in launcher_command(parse_shape("1P3D"), port=9, model_dir=None)
    with pytest.raises(ValueError, match="planner"):
        parse_shape("agg4+planner")


def test_decisions_are_the_planner_lines_logged_during_the_run(tmp_path: Path) -> None:
    start = 1_800_000_000.0
    log = tmp_path / "planner.log"
    log.write_text(
        "\n".join(
            [
                f"{_stamp(start - 5)} INFO planner: hold (too few requests (0 < 20)): P:D 1:3",
                f"{_stamp(start)} INFO planner: watching http://x every 5s",
                f"{_stamp(start + 10)} INFO planner: hold (within the SLO): P:D 1:3 -> ...",
                f"{_stamp(start + 20.5)} INFO planner: flip decode -> prefill (prefill is "
                "short): P:D 1:3 -> predicted 2:2; done: decode-2-ab is prefill after 3.1s",
                f"{_stamp(start + 30)} INFO planner: flip decode -> prefill (prefill is "
                "short): P:D 2:2; decode-1-ab not changed (409): busy",
                "a line of another process",
                f"{_stamp(start + 99)} INFO planner: hold (within the SLO): P:D 2:2",
            ]
        )
        + "\n"
    )
    decisions = planner_decisions(log, start, start + 60)
    assert [d["at_s"] for d in decisions] == [10.0, 20.5, 30.0]
    assert [d["flip"] for d in decisions] == [False, True, False]  # the refused one is no flip
    assert [d["split"] for d in decisions] == ["1:3", "1:3", "2:2"]
    assert decisions[1]["time"] == _stamp(start + 20.5)
    assert planner_decisions(tmp_path / "missing.log", start, start + 60) == []


def _point(shape: str, goodput_requests: int, failed: int = 0) -> SweepPoint:
    from baton.benchmarks.metrics import RequestRecord

    records = [  # all sent at 0, answered by 1 s: goodput is their number
        RequestRecord(i, False, 0.0, success=True, ttft_s=0.1, e2e_s=1.0, finished_s=1.0)
        for i in range(goodput_requests)
    ] + [RequestRecord(100 + i, False, 0.0, success=False) for i in range(failed)]
    point = SweepPoint(shape, 4, 1.0, summary=summarize(records, {}, 0.01))
    point.phases = [
        {"phase": "400:600@8/0.5", "goodput": 1.5, "failed": 0},
        {"phase": "6000:100@2/0.5", "goodput": 0.5, "failed": failed},
    ]
    return point


def test_the_report_sets_the_planner_against_the_best_fixed_shape() -> None:
    fixed, other, planned = _point("1P3D", 10), _point("2P2D", 5), _point("1P3D+planner", 13)
    planned.planner = [
        {"at_s": 20.5, "flip": True, "split": "1:3", "line": "flip decode -> prefill ..."},
        {"at_s": 25.0, "flip": False, "split": "2:2", "line": "hold (within the SLO) ..."},
    ]
    text = "\n".join(render([fixed, other, planned], {1.0: "phases x1"}))
    assert "| 400:600@8/0.5 | 6000:100@2/0.5 | whole run |" in text
    assert "| 1P3D+planner | phases x1 | 1.50 (0) | 0.50 (0) |" in text
    assert "| 1P3D+planner | 1 | 13.00 | 0 | 1P3D | 10.00 | 1.30x |" in text
    assert "1 role flips, 2 decisions" in text and "20.5 FLIP flip decode -> prefill" in text
    assert "The planner" not in "\n".join(render([fixed, other], {1.0: "x1"}))
    assert "Cutover" not in text  # (no /metrics read)


def test_a_planner_runs_section_says_what_its_migrations_did() -> None:
    planned = _point("1P3D+planner", 13)
    planned.planner = []
    cutover = {"count": 31, "mean_s": 0.012, "p50_at_most_s": 0.01, "p99_at_most_s": 0.03,
               "max_at_most_s": 0.03}  # fmt: skip
    planned.migrations = {
        "migrations": {"live/role_change": 31}, "recomputed_tokens": 0, "cutover": cutover,
        "stall_max_at_most_s": 0.15,
    }  # fmt: skip
    text = "\n".join(render([_point("1P3D", 10), planned], {1.0: "x1"}))
    assert "Streams migrated: 31 live/role_change; prompt tokens recomputed: 0." in text
    assert "31: mean 12 ms, p50 <= 10 ms, p99 <= 30 ms, max <= 30 ms" in text
    assert "to its end <= 150 ms." in text


def test_a_shape_names_the_router_placement_it_runs_under():
    shape = parse_shape("1p1d@Cost")
    assert (shape.name, shape.placement) == ("1P1D@cost", "cost")
    command = launcher_command(shape, port=9, model_dir=None, extra=["--placement", "threshold"])
    assert command[-2:] == ["--placement", "cost"]  # the shape's wins over --up-args'
    assert "--placement" not in launcher_command(parse_shape("1P1D"), port=9, model_dir=None)
    with pytest.raises(ValueError, match="not one of"):
        parse_shape("1P1D@fastest")
    with pytest.raises(ValueError):
        parse_shape("agg2@cost")
    with pytest.raises(BenchConfigError, match="1P1D@cost"):  # it would run always-disagg
        SweepConfig(shapes=parse_shapes("1P1D@cost,agg2"), launcher_cmd="my-up --port {port}")
