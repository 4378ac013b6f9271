"""The host-tier replay's report (`benchmarks/host_tier_report.py`): it reads the counters a
worker really exports, splits prefix hits between the GPU and the host tier, and judges
the issue's targets from two runs side by side."""

from __future__ import annotations

import json
from pathlib import Path

from prometheus_client import generate_latest

from baton.benchmarks import host_tier_report
from baton.common.protocol import HostTierStats, StatsOut
from baton.services.worker.metrics import WorkerMetrics


def exported(hits: int, queries: int, host: HostTierStats | None) -> str:
    metrics = WorkerMetrics("both")
    stats = StatsOut(
        running=0,
        queued=0,
        pages_free=0,
        pages_cached=0,
        pages_in_use=0,
        prefix_hit_tokens=hits,
        prompt_tokens=queries,
        token_usage=0.0,
        retracted=2,
        steps=0,
        host_tier=host,
    )
    metrics.observe_stats(stats)
    return generate_latest(metrics.registry).decode()


def test_counters_are_read_under_the_names_a_worker_exports() -> None:
    host = HostTierStats(300, 4096, 2048, 0.5, 7, 10, 64)
    got = host_tier_report.counters(exported(hits=500, queries=1000, host=host))
    assert got == {
        "queries": 1000,
        "hits": 500,
        "host_hits": 300,
        "to_host": 4096,
        "to_device": 2048,
        "stall_s": 0.5,
        "dropped": 7,
        "host_pages_used": 10,
        "host_pages": 64,
        "retracted": 2,
    }


def write_run(folder: Path, ttft_p50: float, before: dict, after: dict) -> Path:
    folder.mkdir()
    bench = {
        "summary": {
            "measured": 4,
            "completed": 4,
            "failed": 0,
            "ttft": {"p50": ttft_p50, "p99": 2 * ttft_p50},
        },
        "trace_prefix_reuse": 0.5,
        "requests": [{"expected_input_len": 1000}] * 4,
    }
    (folder / "bench.json").write_text(json.dumps(bench))
    (folder / "metrics_before.json").write_text(json.dumps(before))
    (folder / "metrics_after.json").write_text(json.dumps(after))
    return folder


def test_the_table_splits_hits_by_tier_and_judges_the_targets(tmp_path: Path, capsys) -> None:
    start = {"queries": 100.0, "hits": 10.0}  # counted before the replay: left out
    tier = write_run(
        tmp_path / "tier",
        ttft_p50=0.2,
        before={**start, "host_hits": 0.0, "to_host": 0.0},
        after={
            **{"queries": 4100.0, "hits": 2010.0, "host_hits": 1200.0, "to_host": 2**30},
            **{"host_pages": 64.0, "host_pages_used": 10.0},
        },
    )
    plain = write_run(
        tmp_path / "plain", ttft_p50=0.5, before=start, after={"queries": 4100.0, "hits": 810.0}
    )
    out = tmp_path / "figures.json"
    argv = ["table", f"with tier={tier}", f"without={plain}", "--pool", "500", "--out", str(out)]
    assert host_tier_report.main(argv) == 0
    figures = json.loads(out.read_text())
    with_tier, without = figures["with tier"], figures["without"]
    assert (
        with_tier["prefill_tokens_computed"] == 2000 and without["prefill_tokens_computed"] == 3200
    )
    assert with_tier["gpu_hit_ratio"] == 0.2 and with_tier["host_hit_ratio"] == 0.3
    assert without["host_hit_ratio"] == 0.0
    assert with_tier["working_set_x_pool"] == 4.0  # 4,000 prompt tokens, half reusable
    printed = capsys.readouterr().out
    assert "| hit ratio, host tier | 30.0% | 0.0% |" in printed
    assert "| GiB GPU -> host | 1.00 | 0.00 |" in printed
    assert "TTFT p50 2.50x better (target >= 2x: met)" in printed
    assert (
        "computed 37.5% fewer (target >= 40%: not met; a cache that forgets nothing: 37.5%"
        in printed
    )


def test_two_runs_without_a_tier_are_compared_without_the_tiers_verdict(
    tmp_path: Path, capsys
) -> None:
    """`gpu_session.sh chunking` compares two replays neither of which has a tier."""
    start = {"queries": 0.0, "hits": 0.0}
    a = write_run(tmp_path / "a", ttft_p50=0.4, before=start, after={"queries": 4000.0})
    b = write_run(tmp_path / "b", ttft_p50=0.2, before=start, after={"queries": 4000.0})
    assert host_tier_report.main(["table", f"default={a}", f"chunked={b}", "--pool", "500"]) == 0
    printed = capsys.readouterr().out
    assert "| TTFT p50 ms | 400 | 200 |" in printed
    assert "with the tier" not in printed
