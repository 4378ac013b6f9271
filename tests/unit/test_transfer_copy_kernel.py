"""The ipc backend's one-launch region copy (Triton's interpreter on the CPU): every byte
of every region lands where the frames say, nothing else is touched."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from baton.common.transfer import copy_kernel


def test_regions_of_many_chunks_land_where_their_frames_say() -> None:
    gen = torch.Generator().manual_seed(3)
    src = torch.randint(0, 256, (1 << 19,), dtype=torch.uint8, generator=gen)
    dst = torch.zeros(1 << 19, dtype=torch.uint8)
    chunk = copy_kernel.CHUNK_BYTES
    # a region of several chunks and a ragged tail, a one-word region, one ending the buffer
    regions = [(0, 3 * chunk + 4096, 2 * chunk + 808), (chunk, 64, 8), ((1 << 19) - 4096, 0, 4096)]
    assert copy_kernel.fits((src, dst), regions)
    copy_kernel.copy_regions(src, dst, regions)
    want = torch.zeros_like(dst)
    for s, d, n in regions:
        want[d : d + n] = src[s : s + n]
    assert torch.equal(dst, want)


def test_regions_off_the_word_grid_are_refused() -> None:
    buf = torch.zeros(4096, dtype=torch.uint8)
    assert not copy_kernel.fits((buf, buf), [(0, 4, 8)])
    assert not copy_kernel.fits((buf, buf), [(0, 0, 12)])
    assert copy_kernel.chunk_table([(16, 8, 2 * copy_kernel.CHUNK_BYTES + 8)]) == [
        2, 1, 8192, 2 + 8192, 1 + 8192, 8192, 2 + 16384, 1 + 16384, 1,
    ]  # fmt: skip
