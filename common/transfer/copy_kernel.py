"""One kernel launch that copies every region of a push, GPU to GPU.

The `ipc` backend writes into memory another process exported. CUDA treats a copy into
such a mapping as a peer copy and runs it on a copy engine: on one H200, 256 MiB took
about 0.5 ms that way against 0.13 ms for the same copy between two of the process's own
tensors (`benchmarks/results/gpu4_2026-11-26/`). Stores issued by a kernel reach the
mapping at the memory's speed, and one launch covers any number of regions (scattered
pages make many), where each `copy_` was a launch of its own.

Regions are cut into chunks of `CHUNK_BYTES`; program i copies chunk i, whose source
offset, destination offset and length (in 8-byte words) are row i of a table uploaded
with the launch. Offsets and lengths must be multiples of 8 bytes (KV pages always are);
`fits` says whether a push qualifies, and the caller copies region by region otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - triton is optional on the CPU
    HAVE_TRITON = False

WORD = 8
CHUNK_BYTES = 1 << 16
_BLOCK = 1024  # words per step of a program


def fits(buffers: Sequence[torch.Tensor], regions: Sequence[tuple[int, int, int]]) -> bool:
    """Whether `copy_regions` can copy these (src offset, dst offset, length) regions."""
    return (
        HAVE_TRITON
        and all(b.nbytes % WORD == 0 and b.data_ptr() % 16 == 0 for b in buffers)
        and all(s % WORD == 0 and d % WORD == 0 and n % WORD == 0 for s, d, n in regions)
    )


if HAVE_TRITON:

    @triton.jit
    def _copy_chunks_kernel(
        src_ptr, dst_ptr, table_ptr, CHUNK_WORDS: tl.constexpr, BLOCK: tl.constexpr
    ):
        chunk = tl.program_id(0)
        src = tl.load(table_ptr + chunk * 3)
        dst = tl.load(table_ptr + chunk * 3 + 1)
        words = tl.load(table_ptr + chunk * 3 + 2)
        for start in range(0, CHUNK_WORDS, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < words
            tl.store(dst_ptr + dst + offs, tl.load(src_ptr + src + offs, mask=mask), mask=mask)


def chunk_table(regions: Sequence[tuple[int, int, int]]) -> list[int]:
    """(src word, dst word, words) per chunk of at most CHUNK_BYTES, flattened."""
    table: list[int] = []
    step = CHUNK_BYTES // WORD
    for src, dst, length in regions:
        s, d, words = src // WORD, dst // WORD, length // WORD
        for k in range(0, words, step):
            table += (s + k, d + k, min(step, words - k))
    return table


def copy_regions(
    src: torch.Tensor, dst: torch.Tensor, regions: Sequence[tuple[int, int, int]]
) -> None:
    """Copy (src offset, dst offset, length) byte regions of `src` into `dst` (flat uint8
    tensors on one device, or mapped there) with one launch on the current stream."""
    table = chunk_table(regions)
    if not table:
        return
    rows = torch.tensor(table, dtype=torch.int64, pin_memory=src.is_cuda)
    rows = rows.to(src.device, non_blocking=True)
    _copy_chunks_kernel[(len(table) // 3,)](
        src.view(torch.int64), dst.view(torch.int64), rows,
        CHUNK_WORDS=CHUNK_BYTES // WORD, BLOCK=_BLOCK, num_warps=4,
    )  # fmt: skip


def warm_up(device: torch.device) -> None:
    """Compile the kernel now (a sender's start), not in the first request's transfer."""
    if HAVE_TRITON and device.type == "cuda":
        a = torch.zeros(16, dtype=torch.uint8, device=device)
        copy_regions(a, torch.empty_like(a), [(0, 0, 16)])
        torch.cuda.synchronize(device)
