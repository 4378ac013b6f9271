"""`baton bench pd-sweep --repeats`: each point measured again on fresh clusters, the
shapes taken in turn, and ranked by the median of its runs. One run of a point can
mislead where runs vary: the Mooncake trace at x8 on 2x H200 (session 38) gave the cost
placement 1.21 to 1.88 good requests/s over five runs of the same tree."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from rich.console import Console

from baton.benchmarks import pd_sweep
from baton.benchmarks.config import BenchConfigError
from baton.benchmarks.metrics import summarize
from baton.benchmarks.sweep_config import Shape, SweepConfig, SweepPoint, parse_shapes
from baton.benchmarks.sweep_report import best_per_shape, render_report


def point(shape: str, workers: int, goodput: float, repeat: int) -> SweepPoint:
    summary = replace(summarize([], {}, 0.01), goodput=goodput)
    return SweepPoint(shape, workers, 8.0, summary, repeat=repeat)


def test_repeats_run_the_shapes_in_turn_each_on_a_fresh_cluster(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[tuple[str, int]] = []

    def sweep_shape(
        config: SweepConfig, shape: Shape, console: Console, repeat: int
    ) -> list[SweepPoint]:
        started.append((shape.name, repeat))
        return [point(shape.name, shape.num_workers, 1.0, repeat)]

    monkeypatch.setattr(pd_sweep, "_sweep_shape", sweep_shape)
    monkeypatch.setattr(pd_sweep, "write_sweep_outputs", lambda config, points: [])
    config = SweepConfig(
        shapes=parse_shapes("1P1D,agg2"), rates=(8.0,), out_dir=tmp_path, repeats=3
    )
    points = pd_sweep.run_sweep(config, Console(quiet=True))
    assert started == [(shape, r) for r in range(3) for shape in ("1P1D", "agg2")]
    assert [p.repeat for p in points] == [0, 0, 1, 1, 2, 2]
    # each repeat's cluster log and runs under their own name
    assert config.run_name("1P1D", 1) == "1P1D-r2"
    assert SweepConfig(out_dir=tmp_path).run_name("1P1D", 0) == "1P1D"  # (unrepeated: as ever)
    with pytest.raises(BenchConfigError, match="--repeats"):
        SweepConfig(repeats=0)


def test_the_report_ranks_each_shape_by_its_median_run_and_shows_the_range(
    tmp_path: Path,
) -> None:
    # cost: one lucky run; always-disagg: steadier and better in the median
    runs = [(1.88, 1.57), (1.21, 1.62), (1.64, 1.60)]
    points = []
    for repeat, (cost, disagg) in enumerate(runs):
        points += [
            point("1P1D@cost", 2, cost, repeat),
            point("1P1D@always-disagg", 2, disagg, repeat),
        ]
    best = best_per_shape(points)
    assert best["1P1D@cost"].median == pytest.approx(1.64 / 2)
    assert best["1P1D@always-disagg"].median == pytest.approx(1.60 / 2)
    config = SweepConfig(
        shapes=parse_shapes("1P1D@cost,1P1D@always-disagg"),
        rates=(8.0,),
        out_dir=tmp_path,
        repeats=3,
    )
    report = render_report(config, points, [])
    assert "**1P1D@cost**: 0.820 good requests/s per worker (median of 3 runs" in report
    assert "| 1P1D@cost | 8 | 3 | 1.64 | 1.21 | 1.88 | 1.88, 1.21, 1.64 |" in report
    assert "| 1P1D@always-disagg r3 | 2 | 8 |" in report  # every run in the table of all
