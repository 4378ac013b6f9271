"""Why the GPU idles in steady decoding: every gap between kernels, and what the host did
in it (a diagnostic for the overlapped loop, not a benchmark).

    python -m baton.benchmarks.lab.gpu_gaps [--bs 1] [--steps 20] [--stack] [--out gaps.json]
    python -m baton.benchmarks.lab.gpu_gaps --prefill 2048      (time to first token instead)

Runs the engine as a worker does (overlap on, CUDA graphs), profiles steady decode steps
(or, with ``--prefill N``, one N-token prompt's generation of its first token, and then
also the host time before the GPU's first and after its last activity) with
torch.profiler, and reads its trace:

- busy: the union of kernel, memcpy and memset intervals over the window from the first
  device activity to the last;
- each gap of at least ``--min-gap-us`` between them, split by the launch of the activity
  that ends it: launched *after* the gap began, the GPU waited for that host thread (its
  work in the gap is attributed below); launched before, it waited on the device side
  (a stream or event wait, or launch latency);
- host work in host-bound gaps: inclusive time of every op or range (with ``--stack``,
  every Python function) of the launching thread that overlaps the gap, like an inclusive
  profile of the moments the GPU waited for it.

`analyze` works on any Chrome trace of torch.profiler; the test feeds it a small one.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
HOST_CATS = ("cpu_op", "user_annotation", "python_function")


@dataclass
class Gaps:
    window_us: float = 0.0
    busy_us: float = 0.0
    gaps: int = 0
    host_bound_us: float = 0.0  # the next activity was launched after the gap began
    device_side_us: float = 0.0  # it had been launched: the GPU waited on something else
    unmatched_us: float = 0.0  # no launch found for the activity after the gap
    host_work_us: dict[str, float] = field(default_factory=dict)  # name -> inclusive µs
    threads: dict[str, float] = field(default_factory=dict)  # launching thread -> µs

    @property
    def busy_fraction(self) -> float:
        return self.busy_us / self.window_us if self.window_us else 0.0

    def summary(self, top: int = 20) -> dict[str, Any]:
        work = sorted(self.host_work_us.items(), key=lambda kv: -kv[1])[:top]
        return {
            "window_ms": self.window_us / 1e3,
            "busy_ms": self.busy_us / 1e3,
            "busy_fraction": self.busy_fraction,
            "gaps": self.gaps,
            "host_bound_ms": self.host_bound_us / 1e3,
            "device_side_ms": self.device_side_us / 1e3,
            "unmatched_ms": self.unmatched_us / 1e3,
            "threads_ms": {k: v / 1e3 for k, v in self.threads.items()},
            "host_work_in_gaps_ms": {k: v / 1e3 for k, v in work},
        }


def _overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


def analyze(trace: dict[str, Any], min_gap_us: float = 5.0) -> Gaps:
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    device = sorted(
        (e for e in events if e.get("cat") in DEVICE_CATS), key=lambda e: float(e["ts"])
    )
    out = Gaps()
    if not device:
        return out
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {})
    }
    host_by_tid: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        if e.get("cat") in HOST_CATS:
            host_by_tid[e.get("tid")].append(e)
    names = {
        e.get("tid"): e["args"]["name"]
        for e in trace.get("traceEvents", [])
        if e.get("ph") == "M" and e.get("name") == "thread_name"
    }
    start = float(device[0]["ts"])
    end = start
    for e in device:
        s, f = float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))
        gap = s - end
        if gap >= min_gap_us:
            out.gaps += 1
            _attribute(out, end, s, e, launches, host_by_tid, names)
        if s > end:
            out.busy_us += f - s
        elif f > end:
            out.busy_us += f - end
        end = max(end, f)
    out.window_us = end - start
    return out


def _attribute(
    out: Gaps,
    g0: float,
    g1: float,
    after: dict[str, Any],
    launches: dict[Any, dict[str, Any]],
    host_by_tid: dict[Any, list[dict[str, Any]]],
    names: dict[Any, str],
) -> None:
    launch = launches.get(after.get("args", {}).get("correlation"))
    if launch is None:
        out.unmatched_us += g1 - g0
        return
    issued = float(launch["ts"])
    if issued <= g0:
        out.device_side_us += g1 - g0
        return
    waited_until = min(issued, g1)
    out.host_bound_us += waited_until - g0
    out.device_side_us += g1 - waited_until
    tid = launch.get("tid")
    thread = names.get(tid, str(tid))
    out.threads[thread] = out.threads.get(thread, 0.0) + waited_until - g0
    for e in host_by_tid.get(tid, []):
        s = float(e["ts"])
        share = _overlap(s, s + float(e.get("dur", 0)), g0, waited_until)
        if share > 0:
            out.host_work_us[e["name"]] = out.host_work_us.get(e["name"], 0.0) + share


def host_edges(trace: dict[str, Any], range_name: str) -> dict[str, float]:
    """How long the host range `range_name` ran, and how much of it lay before the first
    and after the last device activity of the trace (ms)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    host = next(e for e in events if e.get("name") == range_name and e.get("cat") in HOST_CATS)
    device = [e for e in events if e.get("cat") in DEVICE_CATS]
    h0, h1 = float(host["ts"]), float(host["ts"]) + float(host["dur"])
    d0 = min(float(e["ts"]) for e in device)
    d1 = max(float(e["ts"]) + float(e.get("dur", 0)) for e in device)
    return {
        "call_ms": (h1 - h0) / 1e3,
        "before_device_ms": max(0.0, d0 - h0) / 1e3,
        "after_device_ms": max(0.0, h1 - d1) / 1e3,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--bs", type=int, default=1)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--min-gap-us", type=float, default=5.0)
    ap.add_argument("--stack", action="store_true", help="attribute to Python functions too")
    ap.add_argument("--out", default="gpu_gaps.json")
    ap.add_argument("--trace", default=None, help="also keep the Chrome trace here")
    ap.add_argument("--prefill", type=int, default=0, help="profile one prompt of this length")
    args = ap.parse_args(argv)

    import torch

    from baton.benchmarks.lab.gpu_setup import make_engine, model_dir, prompts
    from baton.common.sampling import SamplingParams

    tokens = max(200_000, args.bs * (args.context + 512))
    engine = make_engine(model_dir(), "flashinfer", tokens, max(64, args.bs), True)
    sched = engine.scheduler
    params = SamplingParams(temperature=0.0, max_new_tokens=10_000, ignore_eos=True)
    one = SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True)
    if args.prefill:
        engine.generate(prompts(1, args.prefill, seed=7), one)  # warm-up
    else:
        for i, p in enumerate(prompts(args.bs, args.context, seed=1)):
            sched.add_request(f"r{i}", p, params)
        for _ in range(20):  # prefill, then steady decoding with the overlap loop full
            sched.step()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities, with_stack=args.stack) as prof:
        if args.prefill:
            with torch.profiler.record_function("ttft"):
                engine.generate(prompts(1, args.prefill, seed=8), one)
        else:
            for _ in range(args.steps):
                sched.step()
        torch.cuda.synchronize()
    trace_path = Path(args.trace or tempfile.mkstemp(suffix=".json")[1])
    prof.export_chrome_trace(str(trace_path))
    trace = json.loads(trace_path.read_text())
    gaps = analyze(trace, args.min_gap_us)
    what = f"prefill of {args.prefill}" if args.prefill else f"{args.steps} steps, bs {args.bs}"
    result = {
        "command": "python -m baton.benchmarks.lab.gpu_gaps " + " ".join(argv or sys.argv[1:]),
        "device": torch.cuda.get_device_name(),
        "bs": args.bs,
        "steps": args.steps,
        "prefill": args.prefill,
        **gaps.summary(),
        **(host_edges(trace, "ttft") if args.prefill else {}),
    }
    print(
        f"GPU busy {gaps.busy_fraction:.0%} of {gaps.window_us / 1e3:.1f} ms "
        f"({what}); {gaps.gaps} gaps: host-bound "
        f"{gaps.host_bound_us / 1e3:.2f} ms, device-side {gaps.device_side_us / 1e3:.2f} ms"
    )
    if args.prefill:
        print(
            f"call {result['call_ms']:.2f} ms: host alone before the first device activity "
            f"{result['before_device_ms']:.2f} ms, after the last {result['after_device_ms']:.2f} ms"
        )
    for name, ms in result["host_work_in_gaps_ms"].items():
        print(f"  {ms:8.3f} ms  {name}")
    Path(args.out).write_text(json.dumps(result, indent=2))
    sched.drain()
    engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
