"""Page runs -> byte regions, and a KV buffer seen as flat bytes.

Pages are page-major in the buffer, so pages ``p, p+1, …, p+n-1`` are one byte range. A
sender's (src page, dst page) pairs coalesce into one region wherever both sides step by one
page::

    src 7 8 9 | 3 4      dst 20 21 22 | 23 24    -> regions (7..9 -> 20..22), (3..4 -> 23..24)
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Region:
    """``length`` bytes from source offset to destination offset."""

    src_offset: int
    dst_offset: int
    length: int


def coalesce(pairs: Iterable[tuple[int, int]], page_bytes: int) -> list[Region]:
    """The fewest regions covering the (src_page, dst_page) pairs: a region is a maximal run
    in which both page ids grow by one."""
    regions: list[Region] = []
    start_src = start_dst = count = 0
    for src, dst in sorted(pairs):
        if count and src == start_src + count and dst == start_dst + count:
            count += 1
            continue
        if count:
            regions.append(
                Region(start_src * page_bytes, start_dst * page_bytes, count * page_bytes)
            )
        start_src, start_dst, count = src, dst, 1
    if count:
        regions.append(Region(start_src * page_bytes, start_dst * page_bytes, count * page_bytes))
    return regions


class ByteBuffer:
    """A contiguous tensor (CPU or CUDA) as a flat byte array."""

    def __init__(self, tensor: torch.Tensor):
        self.bytes = tensor.reshape(-1).view(torch.uint8)
        self.nbytes = self.bytes.numel()
        self.is_cuda = self.bytes.is_cuda
        # CPU memory is read and written in place through this view (no copies).
        self._host: memoryview | None = None
        if not self.is_cuda:
            self._host = self.bytes.numpy().data

    def slice(self, offset: int, length: int) -> torch.Tensor:
        return self.bytes[offset : offset + length]

    def host(self, offset: int, length: int) -> memoryview | None:
        """A writable view of host memory, or None when the buffer lives on a GPU."""
        if self._host is None:
            return None
        return self._host[offset : offset + length]

    def crc32(self, offset: int, length: int) -> int:
        view = self.host(offset, length)
        if view is None:  # debug-only path: one device-to-host copy per region
            return zlib.crc32(self.slice(offset, length).cpu().numpy().data)
        return zlib.crc32(view)
