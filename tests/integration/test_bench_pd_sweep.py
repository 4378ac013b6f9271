"""`baton bench pd-sweep` with `--launcher-cmd` starting the fake server per shape."""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from pathlib import Path

import pytest

from baton.benchmarks.pd_sweep import Cluster, free_port
from baton.services.cli import main

pytestmark = pytest.mark.timeout(120)

FAKE = f"{shlex.quote(sys.executable)} -m baton.benchmarks.fake_server --port {{port}} "


def alive(pid: int) -> bool:
    """Running, i.e. existing and not a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def test_sweep_writes_report_plots_and_results(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    code = main([
        "bench", "pd-sweep",
        "--shapes", "1P1D,agg2",
        "--rates", "4,8",
        "--duration", "1",
        "--input-len", "40",
        "--output-len", "4",
        "--slo", "ttft=500ms,tpot=100ms",
        "--out-dir", str(out),
        "--launcher-cmd", FAKE + "--first-token-delay 0.02 --chunk-delay 0.01",
        "--startup-timeout", "30",
        "--stop-grace", "5",
        "--no-progress",
    ])  # fmt: skip
    assert code == 0
    for name in ("report.md", "results.json", "goodput_per_worker.png", "ttft.png", "tpot.png"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "goodput_per_worker.png").read_bytes()[:4] == b"\x89PNG"
    results = json.loads((out / "results.json").read_text())
    points = results["points"]
    assert [(p["shape"], p["rate"]) for p in points] == [
        ("1P1D", 4.0), ("1P1D", 8.0), ("agg2", 4.0), ("agg2", 8.0)
    ]  # fmt: skip
    for p in points:
        assert p["error"] is None and p["summary"]["completed"] > 0
        # Each rate sends fresh prompts: none hits the cache the run before left.
        assert p["summary"]["cached_prompt_tokens"] == 0
        assert p["goodput_per_worker"] == pytest.approx(p["summary"]["goodput"] / 2)
        assert (out / p["result_file"]).exists()
        run = (out / p["result_file"]).with_suffix("")
        for plot in ("latency_cdf", "throughput"):  # each run's own plots, as bench serve's
            assert Path(f"{run}.{plot}.png").read_bytes()[:4] == b"\x89PNG"
    report = (out / "report.md").read_text()
    assert "## Best shape for the SLOs" in report and "ttft <= 500 ms" in report
    assert "| 1P1D | 2 | 4 |" in report and "![ttft](ttft.png)" in report


def test_a_sweep_replays_a_mooncake_trace_faster_at_each_rate(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    lines = [
        {"timestamp": 1000 * i, "input_length": 600, "output_length": 2, "hash_ids": [0, i + 1]}
        for i in range(4)
    ]
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "sweep"
    code = main([
        "bench", "pd-sweep", "--shapes", "agg1", "--rates", "1,4",
        "--dataset", "mooncake", "--dataset-path", str(trace), "--time-scale", "0.5",
        "--out-dir", str(out), "--startup-timeout", "30", "--stop-grace", "5", "--no-progress",
        "--launcher-cmd", FAKE + "--first-token-delay 0.01 --chunk-delay 0.001",
    ])  # fmt: skip
    assert code == 0
    points = json.loads((out / "results.json").read_text())["points"]
    for point, scale in zip(points, (0.5, 0.125), strict=True):
        run = json.loads((out / point["result_file"]).read_text())
        assert run["config"]["time_scale"] == scale
        assert [r["scheduled_s"] for r in run["requests"]] == [0, scale, 2 * scale, 3 * scale]
        # The first block is shared by all four prompts, in each run: never the run before's.
        assert run["total_cached_tokens"] == 3 * 512
    report = (out / "report.md").read_text()
    assert "at trace x" in report and "time scale 0.5 / rate" in report


def test_sweep_survives_a_cluster_that_does_not_start(tmp_path: Path) -> None:
    out = tmp_path / "broken"
    failing = f"{shlex.quote(sys.executable)} -c 'import sys; print(\"no GPU\"); sys.exit(3)'"
    code = main(
        [
            "bench",
            "pd-sweep",
            "--shapes",
            "2P1D",
            "--rates",
            "1",
            "--num-requests",
            "2",
            "--out-dir",
            str(out),
            "--launcher-cmd",
            failing,
            "--startup-timeout",
            "20",
            "--no-progress",
        ]
    )
    assert code == 1
    report = (out / "report.md").read_text()
    assert "No shape completed a run." in report and "exited with code 3" in report
    assert "no GPU" in report


def test_sweep_refuses_a_shape_whose_workers_never_all_join(tmp_path: Path) -> None:
    """The fake server's /health says 1 of the shape's 2 workers joined: the shape is not
    measured, and the report says why."""
    out = tmp_path / "partial"
    started = time.monotonic()
    code = main([
        "bench", "pd-sweep",
        "--shapes", "agg2",
        "--rates", "4",
        "--num-requests", "2",
        "--out-dir", str(out),
        "--launcher-cmd", FAKE + "--workers 1 --expect-workers {workers}",
        "--startup-timeout", "3",
        "--stop-grace", "5",
        "--no-progress",
    ])  # fmt: skip
    assert code == 1
    assert time.monotonic() - started < 60
    point = json.loads((out / "results.json").read_text())["points"][0]
    assert point["summary"] is None and "both 1 of 2 workers joined" in point["error"]
    assert "No shape completed a run." in (out / "report.md").read_text()


def test_sweep_marks_a_run_that_lost_a_worker_and_ranks_it_not(tmp_path: Path) -> None:
    out = tmp_path / "lost"
    code = main([
        "bench", "pd-sweep",
        "--shapes", "agg2",
        "--rates", "4",
        "--duration", "3",
        "--num-requests", "12",
        "--input-len", "8",
        "--output-len", "4",
        "--out-dir", str(out),
        "--launcher-cmd",
        FAKE + "--workers {workers} --expect-workers {workers} --lose-worker-after 1",
        "--startup-timeout", "30",
        "--stop-grace", "5",
        "--no-progress",
    ])  # fmt: skip
    assert code == 1  # its only run measured a partial cluster
    point = json.loads((out / "results.json").read_text())["points"][0]
    assert point["summary"]["completed"] > 0
    assert "both 2 at the start, 1 during the run" in point["partial"]
    assert "at the end both 1 of 2 workers joined (lost worker-1)" in point["partial"]
    run = json.loads((out / point["result_file"]).read_text())
    assert run["cluster"]["start"]["workers"]["both"] == 2
    assert run["partial_cluster"] == point["partial"]
    report = (out / "report.md").read_text()
    assert "| agg2 | 2 (partial) | 4 |" in report and "## Partial clusters" in report
    assert "runs on a partial cluster are not ranked" in report


def test_stopping_a_cluster_leaves_no_orphans(tmp_path: Path) -> None:
    # A launcher that ignores SIGTERM and whose child does too: only SIGKILL of the
    # whole process group ends them.
    child_pid = tmp_path / "child.pid"
    script = f"trap '' TERM; sleep 300 & echo $! > {child_pid}; wait"
    port = free_port()
    cluster = Cluster(
        ["bash", "-c", script], tmp_path / "c.log", f"http://127.0.0.1:{port}", stop_grace_s=0.5
    )
    with cluster:
        deadline = time.monotonic() + 10
        while not child_pid.exists() or not child_pid.read_text().strip():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        pid = int(child_pid.read_text())
        assert alive(pid)
    started = time.monotonic()
    while alive(pid) and time.monotonic() - started < 5:
        time.sleep(0.05)
    assert not alive(pid)
    assert os.path.exists(tmp_path / "c.log")


def test_a_phased_sweep_reports_each_shapes_goodput_by_phase(tmp_path: Path) -> None:
    """`--phases` in a sweep: the sweep's rate scales every phase's rate, and report.md and
    results.json give each shape's goodput phase by phase and over the whole run."""
    out = tmp_path / "sweep"
    code = main([
        "bench", "pd-sweep", "--shapes", "1P1D,agg2", "--rates", "2", "--duration", "2",
        "--phases", "8:4@10,30:2@3", "--slo", "ttft=500ms", "--out-dir", str(out),
        "--launcher-cmd", FAKE + "--first-token-delay 0.02 --chunk-delay 0.01",
        "--startup-timeout", "30", "--stop-grace", "5", "--no-progress",
    ])  # fmt: skip
    assert code == 0
    points = json.loads((out / "results.json").read_text())["points"]
    for p in points:
        first, second = p["phases"]
        assert (first["phase"], second["phase"]) == ("8:4@20/0.5", "30:2@6/0.5")  # x2
        assert first["completed"] > second["completed"] > 0 and p["summary"]["failed"] == 0
        assert p["planner_decisions"] is None  # no planner in these shapes
    report = (out / "report.md").read_text()
    assert "- phases: 8:4@10/0.5,30:2@3/0.5" in report and "## Goodput by phase" in report
    assert "| agg2 | phases x2 |" in report
