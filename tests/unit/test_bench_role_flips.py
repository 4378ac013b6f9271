"""The role-flip benchmark's arithmetic: what the router's /metrics grew by during the run
(migrations by kind, tokens recomputed, the longest stall's bucket), and the longest gap
of the streams in flight during a flip."""

from __future__ import annotations

import argparse
from typing import cast

import httpx
import pytest
from rich.console import Console

from baton.benchmarks.metrics import RequestRecord
from baton.benchmarks.migration_report import migration_report
from baton.benchmarks.role_flips import (
    Witnesses,
    _seconds_list,
    configs,
    gaps_during_flips,
    table,
    witness_prompts,
)
from baton.services.top import parse

BEFORE = """
baton_router_migrations_total{kind="live",reason="role_change"} 2.0
baton_router_migrations_total{kind="recompute",reason="role_change"} 0.0
baton_router_migration_recomputed_tokens_total 0.0
baton_router_migration_bytes_total 100.0
baton_router_migration_stall_seconds_bucket{le="0.05"} 1.0
baton_router_migration_stall_seconds_bucket{le="0.1"} 2.0
baton_router_migration_stall_seconds_bucket{le="0.2"} 2.0
baton_router_migration_stall_seconds_bucket{le="+Inf"} 2.0
baton_router_migration_stall_seconds_count 2.0
baton_router_migration_stall_seconds_sum 0.12
baton_router_migration_cutover_seconds_bucket{le="0.01"} 2.0
baton_router_migration_cutover_seconds_bucket{le="0.02"} 2.0
baton_router_migration_cutover_seconds_bucket{le="0.05"} 2.0
baton_router_migration_cutover_seconds_bucket{le="+Inf"} 2.0
baton_router_migration_cutover_seconds_count 2.0
baton_router_migration_cutover_seconds_sum 0.01
baton_router_role_changes_total{outcome="done",role="prefill"} 0.0
"""
AFTER = """
baton_router_migrations_total{kind="live",reason="role_change"} 7.0
baton_router_migrations_total{kind="recompute",reason="role_change"} 1.0
baton_router_migration_recomputed_tokens_total 812.0
baton_router_migration_bytes_total 5100.0
baton_router_migration_stall_seconds_bucket{le="0.05"} 4.0
baton_router_migration_stall_seconds_bucket{le="0.1"} 7.0
baton_router_migration_stall_seconds_bucket{le="0.2"} 8.0
baton_router_migration_stall_seconds_bucket{le="+Inf"} 8.0
baton_router_migration_stall_seconds_count 8.0
baton_router_migration_stall_seconds_sum 0.72
baton_router_migration_cutover_seconds_bucket{le="0.01"} 3.0
baton_router_migration_cutover_seconds_bucket{le="0.02"} 5.0
baton_router_migration_cutover_seconds_bucket{le="0.05"} 6.0
baton_router_migration_cutover_seconds_bucket{le="+Inf"} 6.0
baton_router_migration_cutover_seconds_count 6.0
baton_router_migration_cutover_seconds_sum 0.07
baton_router_role_changes_total{outcome="done",role="prefill"} 1.0
"""


def test_the_report_counts_what_the_run_added() -> None:
    report = migration_report(parse(BEFORE), parse(AFTER))
    assert report["migrations"] == {"live/role_change": 5, "recompute/role_change": 1}
    assert report["recomputed_tokens"] == 812 and report["migration_bytes"] == 5000
    assert report["stalled_streams"] == 6
    assert report["stall_mean_s"] == pytest.approx(0.1)
    assert report["stall_max_at_most_s"] == 0.2  # one of the six fell in (0.1, 0.2]
    assert report["role_changes"] == {"prefill/done": 1}
    # the cutovers alone: 4 more, 1 under 10 ms, 2 under 20, 1 under 50
    cutover = report["cutover"]
    assert cutover["count"] == 4 and cutover["mean_s"] == pytest.approx(0.015)
    assert cutover["p50_at_most_s"] == 0.02 and cutover["p99_at_most_s"] == 0.05
    assert cutover["max_at_most_s"] == 0.05


def test_the_table_shows_the_cutovers() -> None:
    data = {
        "completed": 10, "failed": 0, "recomputed_tokens": 0, "witnesses": 0,
        "witnesses_differing": [], "gap_in_flight_at_flips_s": None,
        "longest_gap_any_stream_s": None, "flips": [], "shape": "1P3D", "rate_req_s": 1.0,
        **migration_report(parse(BEFORE), parse(AFTER)),
    }  # fmt: skip
    console = Console(width=200, record=True)
    console.print(table(data))
    assert "4: 15 ms, 20 ms, 50 ms, 50 ms" in console.export_text()


def test_no_migration_leaves_no_stall() -> None:
    report = migration_report(parse(BEFORE), parse(BEFORE))
    assert report["migrations"] == {} and report["stall_max_at_most_s"] is None
    assert report["stall_mean_s"] is None
    assert report["cutover"]["count"] == 0 and report["cutover"]["max_at_most_s"] is None


def test_the_longest_gap_is_of_streams_in_flight_during_a_flip() -> None:
    def record(at: float, end: float, gaps: list[float]) -> RequestRecord:
        return RequestRecord(0, False, at, success=True, finished_s=end, itl_s=gaps)

    records = [
        record(0.0, 3.0, [0.9]),  # ended before the flip
        record(9.0, 12.0, [0.01, 0.15]),  # in flight during it
        record(20.0, 21.0, [0.5]),  # after it
    ]
    flips = [{"at_s": 10.0, "ended_s": 11.0}]
    assert gaps_during_flips(records, flips) == 0.15
    assert gaps_during_flips(records, []) is None


def test_flip_times_must_ascend() -> None:
    assert _seconds_list("30,60") == (30.0, 60.0)
    for bad in ("60,30", "x", "", "-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            _seconds_list(bad)


def test_the_command_line_gives_the_flips_and_the_load() -> None:
    config, bench = configs(["--flip-at", "5,12", "--load", "0.5", "--input-len", "16",
                             "--model", "/m", "--up-args", "--device cpu"])  # fmt: skip
    assert config.flip_at == (5.0, 12.0) and config.load == 0.5 and config.model_dir == "/m"
    assert config.up_args == ("--device", "cpu") and config.shape == "1P3D"
    assert bench.duration_s == 90.0 and bench.input_len == 16 and bench.model is None
    assert config.request_rate is None  # measured: --load x capacity
    config, bench = configs(["--duration", "20", "--request-rate", "3"])
    assert bench.duration_s == 20.0 and config.request_rate == bench.request_rate == 3.0
    assert configs(["--num-requests", "7"])[1].duration_s is None


async def test_a_witness_whose_answer_changed_or_failed_is_named() -> None:
    answers = iter(["a", "b", None, "a", "c", "x"])  # under the flip, then quiet

    class Scripted(Witnesses):
        async def answer(self, prompt: str) -> str | None:
            return next(answers)

    witnesses = Scripted(cast(httpx.AsyncClient, None), "", "m", 4, witness_prompts(3))
    witnesses.start()
    assert await witnesses.verdict() == {
        "witnesses": 3, "witnesses_differing": [1, 2], "control_witnesses": 0,
        "control_differing": [],
    }  # fmt: skip
    assert len(set(witness_prompts(8))) == 8 and witness_prompts(2) == witness_prompts(2)


async def test_the_control_under_load_is_judged_apart_from_the_flips_witnesses() -> None:
    # the control (under load, no flip), then the witnesses of the flip, then quiet
    answers = iter(["a", "q", "c", "a", "b", "c", "a", "b", "c"])

    class Scripted(Witnesses):
        async def answer(self, prompt: str) -> str | None:
            return next(answers)

    witnesses = Scripted(cast(httpx.AsyncClient, None), "", "m", 4, witness_prompts(3))
    witnesses.start_control()
    witnesses.start()
    assert await witnesses.verdict() == {
        "witnesses": 3, "witnesses_differing": [], "control_witnesses": 3,
        "control_differing": [1],
    }  # fmt: skip
