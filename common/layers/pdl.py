"""Programmatic dependent launch (PDL) for baton's Triton kernels.

On Hopper and later, a kernel launched with `launch_pdl` may start while the kernel before
it on the stream finishes: its launch and start-up overlap that kernel's last wave. Every
such kernel calls `pdl_start` before it reads or writes any memory a kernel before it
may write: it waits for its predecessor's memory (`gdc_wait`), so the order of memory
effects is the stream's, then lets its own successor launch. A kernel after an NCCL or
cuBLAS kernel, which never lets its dependents launch early, simply starts once that kernel
has finished.

Before that wait a kernel may `prefetch_l2` what it will read: L2 is the one point of
coherence of the device, so a line fetched early is never stale, whoever writes it later.
The small kernels of a decode step (norms, RoPE, attention's reduce) leave the memory bus
nearly idle; a projection or attention launched behind one of them fetches its first
weights or keys meanwhile, instead of starting cold once it ends. A little is enough: 1 KB
of each weight row made decode steps 1-2% faster on an H100, 4 KB made them 7% slower on
an H200 (results/gpu_2026-11-27_s15/).

`BATON_PDL=0` in the environment launches them without PDL: a profiler then sees each
kernel's own time, not its wait for the one before (a diagnostic).
"""

from __future__ import annotations

import torch

from baton.common.env import PDL as PDL_SWITCH

try:  # Triton 3.3 and later
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    HAVE_PDL = True
except ImportError:  # pragma: no cover - no Triton, or one that launches without PDL
    HAVE_PDL = False

ENABLED = PDL_SWITCH.get()
_ON = {"PDL": True, "launch_pdl": True}
_OFF = {"PDL": False}
_DEVICES: dict[int, bool] = {}  # CUDA device index -> compute capability 9 or more


def pdl(x: torch.Tensor) -> dict[str, bool]:
    """The launch arguments of a kernel with a `PDL` constexpr, for tensors like `x`: with
    programmatic dependent launch on a CUDA device of compute capability 9 or more."""
    if not (HAVE_PDL and ENABLED and x.is_cuda):
        return _OFF
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    if index not in _DEVICES:
        _DEVICES[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return _ON if _DEVICES[index] else _OFF


if HAVE_PDL:

    @triton.jit
    def pdl_start(PDL: tl.constexpr):
        """In a kernel that `pdl` launches, before it touches memory that kernels before it
        may write: wait for the kernel before it, then let the one after it launch."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()

    @triton.jit
    def prefetch_l2(ptrs):
        """Ask L2 for the 128-byte lines at `ptrs` without waiting for them: a hint
        that fills no registers. Callers keep the addresses inside their tensors. Compiled
        kernels only: the interpreter has no PTX."""
        tl.inline_asm_elementwise(
            "mov.u32 $0, 0; prefetch.global.L2 [$1];",
            "=r,l",
            [ptrs],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )

else:  # pragma: no cover - kernels still compile; `pdl` never sets PDL
    try:
        import triton
        import triton.language as tl

        @triton.jit
        def pdl_start(PDL: tl.constexpr):
            pass

        @triton.jit
        def prefetch_l2(ptrs):
            pass

    except ImportError:
        pass
