"""The GPU-gap analysis tells host-bound idle time from device-side waits, and names the
host work of the launching thread during the gaps (a synthetic torch.profiler trace)."""

from __future__ import annotations

import pytest

from baton.benchmarks.lab.gpu_gaps import analyze


def x(cat: str, name: str, ts: float, dur: float, tid: int = 1, **args: object) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "args": args}


TRACE = {
    "traceEvents": [
        {"ph": "M", "name": "thread_name", "tid": 7, "args": {"name": "scheduler"}},
        x("kernel", "gemm", 0, 10, tid=0, correlation=1),
        x("gpu_memcpy", "copy", 5, 7, tid=0, correlation=2),  # overlaps: busy until 12
        x("kernel", "attn", 30, 10, tid=0, correlation=3),  # after a gap 12..30
        x("kernel", "norm", 42, 8, tid=0, correlation=4),  # a 2 µs gap: too small to count
        x("kernel", "gemm", 70, 10, tid=0, correlation=5),  # after a gap 50..70
        x("cuda_runtime", "cudaLaunchKernel", -3, 1, tid=7, correlation=1),
        x("cuda_runtime", "cudaMemcpyAsync", -2, 1, tid=7, correlation=2),
        x("cuda_runtime", "cudaGraphLaunch", 25, 2, tid=7, correlation=3),  # host-bound 13
        x("cuda_runtime", "cudaLaunchKernel", 41, 1, tid=7, correlation=4),
        x("cuda_runtime", "cudaLaunchKernel", 45, 1, tid=7, correlation=5),  # before its gap
        x("cpu_op", "plan", 14, 8, tid=7),  # inside the host-bound part of the first gap
        x("cpu_op", "step", 0, 60, tid=7),  # encloses it all
        x("cpu_op", "elsewhere", 14, 8, tid=9),  # another thread: not the launcher
    ]
}


def test_gaps_are_split_by_when_the_next_activity_was_launched() -> None:
    gaps = analyze(TRACE, min_gap_us=5)
    assert gaps.window_us == 80
    assert gaps.busy_us == 12 + 10 + 8 + 10
    assert gaps.busy_fraction == pytest.approx(40 / 80)
    assert gaps.gaps == 2
    assert gaps.host_bound_us == 25 - 12  # the launch came 13 µs into the first gap
    assert gaps.device_side_us == (30 - 25) + (70 - 50)
    assert gaps.threads == {"scheduler": 13}
    assert gaps.host_work_us == {"plan": 8, "step": 13}


def test_a_trace_without_device_activity_is_empty() -> None:
    gaps = analyze({"traceEvents": [x("cpu_op", "step", 0, 10)]})
    assert gaps.window_us == 0 and gaps.busy_fraction == 0 and gaps.gaps == 0
