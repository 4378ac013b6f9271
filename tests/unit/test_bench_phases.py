"""`--phases`: a workload whose mix changes midway, parsed with clear errors, scheduled
phase by phase, and judged per phase."""

from __future__ import annotations

import pytest

from baton.benchmarks import cli as bench_cli
from baton.benchmarks.config import BenchConfig, BenchConfigError
from baton.benchmarks.metrics import RequestRecord
from baton.benchmarks.phase_results import phase_results
from baton.benchmarks.phases import Phase, parse_phases, phase_offsets, scaled, windows
from baton.benchmarks.serve import make_plan
from baton.benchmarks.sweep_config import SweepConfig
from baton.services import cli


def test_phases_split_the_duration_evenly_unless_shares_are_given() -> None:
    even = parse_phases("400:600@8, 6000:100@2")
    assert list(even) == [Phase(400, 600, 8.0, 0.5), Phase(6000, 100, 2.0, 0.5)]
    given = parse_phases("400:600@8/25%,6000:100@2.5/0.75")
    assert [p.share for p in given] == [0.25, 0.75] and given[1].rate == 2.5
    assert str(given) == "400:600@8/0.25,6000:100@2.5/0.75"
    assert parse_phases(str(given)) == given  # the printed spelling parses back


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "at least one"),
        ("400:600", "IN:OUT@RATE"),
        ("400-600@8", "IN:OUT@RATE"),
        ("0:600@8", ">= 1"),
        ("400:600@0", "rate"),
        ("400:600@8/0.5,6000:100@2", "every phase a share"),
        ("400:600@8/0.5,6000:100@2/0.3", "sum to 0.8"),
        ("400:600@8/1.5", "share must be in (0, 1]"),
    ],
)
def test_a_bad_spec_is_refused_naming_what_is_wrong(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=None) as refused:
        parse_phases(text)
    assert says in str(refused.value)


def test_each_phase_sends_at_its_own_rate_within_its_window() -> None:
    phases = parse_phases("10:5@40/0.25,10:5@4/0.75")
    offsets, phase_of = phase_offsets(phases, 100.0, seed=3)
    assert offsets == sorted(offsets) and len(offsets) == len(phase_of)
    (a0, a1), (b0, b1) = windows(phases, 100.0)
    assert (a0, a1, b0, b1) == (0.0, 25.0, 25.0, 100.0)
    first = [t for t, p in zip(offsets, phase_of, strict=True) if p == 0]
    second = [t for t, p in zip(offsets, phase_of, strict=True) if p == 1]
    assert all(0 <= t < 25 for t in first) and all(25 <= t < 100 for t in second)
    assert 850 < len(first) < 1150 and 240 < len(second) < 360  # 1000 and 300 expected
    assert phase_offsets(phases, 100.0, seed=3) == (offsets, phase_of)  # reproducible


def test_the_plan_gives_each_request_its_phase_lengths() -> None:
    config = BenchConfig(phases=parse_phases("20:7@30,300:2@10"), duration_s=4.0, seed=1)
    plan = make_plan(config)
    cut = next(i for i, t in enumerate(plan.offsets) if t >= 2.0)
    assert all(r.input_len == 20 and r.max_tokens == 7 for r in plan.requests[:cut])
    assert all(r.input_len == 300 and r.max_tokens == 2 for r in plan.requests[cut:])
    assert len(plan.requests[cut:]) < len(plan.requests[:cut])


@pytest.mark.parametrize(
    ("settings", "says"),
    [
        ({}, "--duration"),
        ({"duration_s": 10, "num_requests": 5}, "without --num-requests"),
        ({"duration_s": 10, "request_rate": 3.0}, "not with --request-rate"),
        ({"duration_s": 10, "dataset": "shared-prefix"}, "not with --dataset"),
        ({"duration_s": 10, "warmup": 2}, "warmup"),
    ],
)
def test_settings_phases_cannot_go_with_are_refused(settings: dict, says: str) -> None:
    with pytest.raises(BenchConfigError, match=None) as refused:
        BenchConfig(phases=parse_phases("4:4@1"), **settings)
    assert says in str(refused.value)


def test_each_phase_is_judged_on_the_requests_it_sent() -> None:
    config = BenchConfig(phases=parse_phases("10:5@1,10:5@1"), duration_s=10.0, slo={"ttft": 0.5})

    def record(at: float, ttft: float, ok: bool = True) -> RequestRecord:
        return RequestRecord(
            int(at), False, at, success=ok, ttft_s=ttft, e2e_s=ttft, finished_s=at + ttft
        )

    records = [record(0, 0.1), record(4, 0.1), record(5, 2.0), record(9, 0.1, ok=False)]
    first, second = phase_results(records, config)
    assert (first.summary.completed, first.summary.failed) == (2, 0)
    assert first.summary.slo_attainment == 1.0 and first.summary.goodput == pytest.approx(2 / 4.1)
    assert (second.summary.completed, second.summary.failed) == (1, 1)
    assert second.summary.goodput == 0.0  # the one answer missed its TTFT
    assert (second.start_s, second.end_s) == (5.0, 10.0)
    assert second.to_dict()["phase"] == "10:5@1/0.5"


def test_serve_and_sweep_take_phases_from_the_command_line() -> None:
    parser = cli.build_parser("bench")
    args = parser.parse_args(["bench", "serve", "--phases", "400:600@8,6000:100@2",
                              "--duration", "60"])  # fmt: skip
    config = bench_cli.config_from_args(args)
    assert config.phases == parse_phases("400:600@8,6000:100@2")
    assert config.describe()["phases"] == "400:600@8/0.5,6000:100@2/0.5"
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "serve", "--phases", "400:600"])
    args = parser.parse_args(["bench", "pd-sweep", "--rates", "1,2", "--duration", "60",
                              "--phases", "400:600@8,6000:100@2"])  # fmt: skip
    sweep: SweepConfig = bench_cli.sweep_config(args)
    point = sweep.point_config("http://h:1", 2.0)
    assert point.phases == scaled(sweep.bench.phases, 2.0)
    assert [p.rate for p in point.phases] == [16.0, 4.0] and sweep.at(2.0) == "phases x2"
