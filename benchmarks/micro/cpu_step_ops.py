"""Work a decode step puts on the device, counted on the CPU (a proxy, not the GPU target).

    python -m baton.benchmarks.micro.cpu_step_ops [--out results.json]

A GPU decode step is short enough that its cost is set by how many kernels it launches and
how long the host takes to launch them. Both can be counted without a GPU:
  layer    kernels one decoder layer launches in a decode step: aten ops that compute
           (views and allocations excluded; a reshape that copies counts) plus Triton launches, with the fused Triton
           kernels on (run by the interpreter), attention counted as one kernel. Fused q/k/v
           path (`qkv_rope_store`) against the unfused one it replaced.
  sampler  `sample()` for a batch of 1..128 rows: aten ops per call, and host microseconds
           per call at a 64-token vocabulary (where the arithmetic is negligible and the
           time is the host's dispatch work a GPU step would also pay): this thread's CPU
           time, best of 5 blocks, so other processes on a shared machine do not count.
Prints tables labelled CPU and writes JSON. Run it before and after a change.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

_NOT_KERNELS = {"empty", "empty_like", "empty_strided", "lift_fresh", "set_", "resize_"}


class KernelCount(TorchDispatchMode):
    """Counts aten ops that would launch a device kernel."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        out = func(*args, **(kwargs or {}))
        if func.is_view:  # a view, unless it had to copy (reshape of a strided tensor)
            if _storage(out) != _storage(args[0]):
                self.ops.append(f"{name} (copies)")
        elif name not in _NOT_KERNELS:
            self.ops.append(name)
        return out


def _storage(x: Any) -> int | None:
    if isinstance(x, (tuple, list)):
        x = x[0] if x else None
    return x.untyped_storage().data_ptr() if isinstance(x, torch.Tensor) else None


@contextmanager
def triton_launches_counted(count: KernelCount) -> Iterator[None]:
    """Each launch of a fused kernel of `layers.kernels` counts as one kernel (the
    interpreter's own tensor work inside it does not)."""
    from baton.common.layers import kernels

    saved: dict[str, Any] = {}

    class Launch:
        def __init__(self, name: str, kernel: Any) -> None:
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid: Any) -> Callable[..., Any]:
            def launch(*args: Any, **kw: Any) -> Any:
                count.ops.append(self.name)
                with _disable_current_modes():
                    return self.kernel[grid](*args, **kw)

            return launch

    for name in dir(kernels):
        if name.startswith("_") and name.endswith("_kernel"):
            saved[name] = getattr(kernels, name)
            setattr(kernels, name, Launch(name.strip("_"), saved[name]))
    try:
        yield
    finally:
        for name, kernel in saved.items():
            setattr(kernels, name, kernel)


def layer_kernels(arch: str, fused: bool) -> list[str]:
    """Kernels of one decoder layer (the second) in a decode step of 4 requests."""
    from baton.common.engine import Engine
    from baton.common.layers import kernels
    from baton.common.models import llama
    from baton.common.models.tiny import make_model
    from baton.common.sampling import SamplingParams

    model = make_model(tempfile.mkdtemp(prefix="ops-"), arch=arch, layers=2)
    saved = kernels.TRITON_ON_CPU, llama.qkv_rope_store
    kernels.TRITON_ON_CPU = True
    if not fused:
        llama.qkv_rope_store = lambda *args, **kw: None
    calls: list[list[str]] = []
    try:
        with Engine(model, page_size=4, disable_overlap=True) as engine:
            layer = engine.scheduler.runner.model.model.layers[1]
            original = layer.forward

            def counted(*args: Any, **kw: Any) -> Any:
                count = KernelCount()
                with count, triton_launches_counted(count), attention_as_one_kernel(count):
                    out = original(*args, **kw)
                calls.append(count.ops)
                return out

            layer.forward = counted
            params = SamplingParams(temperature=0.0, max_new_tokens=3, ignore_eos=True)
            engine.generate([[11, 12, 13, 14]] * 4, params)  # prefill, then 2 decode steps
    finally:
        kernels.TRITON_ON_CPU, llama.qkv_rope_store = saved
    return calls[-1]  # the last call: a decode step


@contextmanager
def attention_as_one_kernel(count: KernelCount) -> Iterator[None]:
    """The reference backend's attention is many torch ops; on a GPU it is one kernel."""
    from baton.common.attention.torch_backend import TorchBackend

    saved = TorchBackend._decode, TorchBackend._extend

    def one_kernel(method: Callable[..., Any]) -> Callable[..., Any]:
        def attention(*args: Any, **kw: Any) -> Any:
            count.ops.append("attention")
            with _disable_current_modes():
                return method(*args, **kw)

        return attention

    wrapped = one_kernel(saved[0]), one_kernel(saved[1])
    TorchBackend._decode, TorchBackend._extend = wrapped  # type: ignore[method-assign]
    try:
        yield
    finally:
        TorchBackend._decode, TorchBackend._extend = saved  # type: ignore[method-assign]


def sampler_cost(batch: int, kind: str, vocab: int, reps: int) -> dict[str, Any]:
    from baton.common.layers.sampler import SamplingRow, sample
    from baton.common.sampling import SamplingParams

    p = (
        SamplingParams(temperature=0.0)
        if kind == "greedy"
        else SamplingParams(temperature=0.8, top_p=0.9, top_k=50)
    )
    rows = [SamplingRow(p, 1234 + i, 7, [], None) for i in range(batch)]
    logits = torch.randn(batch, vocab)
    with KernelCount() as count:
        sample(logits, rows)
    for _ in range(3):
        sample(logits, rows)
    blocks = []
    for _ in range(5):  # CPU time of this thread, best block: other processes do not count
        t = time.thread_time()
        for _ in range(reps // 5):
            sample(logits, rows)
        blocks.append((time.thread_time() - t) / (reps // 5))
    return {"batch": batch, "kind": kind, "ops": len(count.ops), "host_us": min(blocks) * 1e6}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default="")
    ap.add_argument("--reps", type=int, default=500)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    result: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": f"CPU ({platform.machine()}), 1 torch thread",
        "command": "python -m baton.benchmarks.micro.cpu_step_ops " + " ".join(sys.argv[1:]),
        "torch": torch.__version__,
        "layer": [],
        "sampler": [],
    }
    print("CPU count: kernels one decoder layer launches in a decode step (GPU: one each)\n")
    print("| family | q/k/v path | kernels | what |\n|---|---|---|---|")
    for arch in ("llama", "qwen3"):
        for fused in (False, True):
            ops = layer_kernels(arch, fused)
            path = "fused" if fused else "unfused"
            result["layer"].append({"arch": arch, "path": path, "kernels": ops})
            print(f"| {arch} | {path} | {len(ops)} | {', '.join(ops)} |", flush=True)
    print("\nCPU timing: sample() per call, 64-token vocabulary (host dispatch work)\n")
    print("| batch | rows | aten ops | host us / call |\n|---|---|---|---|")
    for kind in ("greedy", "sampled"):
        for batch in (1, 8, 32, 128):
            row = sampler_cost(batch, kind, 64, args.reps)
            result["sampler"].append(row)
            print(f"| {batch} | {kind} | {row['ops']} | {row['host_us']:.0f} |", flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
