"""How a step's queued host-tier copies run (`PageMoves.run`, from the model runner just
before the step's forward; `host_tier.py` says what is queued and why the order is safe).

The number of operations a step launches does not grow with its number of pages. Queued
calls (`Move`) of one direction in a row form a *segment*; segments run in queue order,
which the safety argument needs (a host page freed by a load is reused by an offload
queued after it). Within a segment no copy reads what another writes (an offload reads
the device and writes the host, a load the reverse), so only each destination's last
write counts, and the pages may be reordered: sorted by host page, split where the host
pages stop being consecutive (`PageAllocator` hands out the lowest ids first, so one
node's host pages are one run). Then, per host run:

    device pages consecutive too ──▶ one slice copy  host[h:h+n] ⇄ device[d:d+n]
    device pages scattered       ──▶ per chunk of the staging buffer:
        offload: index_select(device, rows) → staging;  staging → host[h:h+n]
        load:    host[h:h+n] → staging;  device.index_copy_(rows, staging)

with the rows uploaded once per segment. A step evicting 8,192 scattered pages of one
token (128 KiB each, Llama-3-8B's shape) launched 8,192 copies on the forward thread; now
it launches 33 (one upload, two per 64 MiB chunk). The staging buffer is allocated once
per tier, on the pool's device: `STAGING_BYTES` rounded down to whole pages, or one page
where a page is larger (`staging_bytes`; the worker's memory plan keeps it out of the KV
pool). Every copy runs on the tier's stream, so reusing the one staging buffer across
chunks is ordered. On a CPU the same operations run, synchronously.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import groupby
from typing import NamedTuple

import numpy as np
import torch

from baton.common.devices import flat_array, upload

STAGING_BYTES = 64 << 20  # the staging buffer: bounds a chunk of scattered pages


def staging_bytes(page_bytes: int) -> int:
    """The device memory a host tier's staging buffer takes, for pages of `page_bytes`."""
    return max(STAGING_BYTES // page_bytes, 1) * page_bytes


class Move(NamedTuple):
    """One queued call's pages, copied in order with the calls around it."""

    to_host: bool  # device → host (offload) or host → device (load)
    device_pages: list[int]
    host_pages: list[int]


@dataclass
class TierCounters:
    """Cumulative; the scheduler reports them as worker metrics."""

    hit_tokens: int = 0  # prefix tokens loaded back from the host tier
    bytes_to_host: int = 0
    bytes_to_device: int = 0
    load_stall_seconds: float = 0.0  # copies a step's forward waited for (CPU: ran)
    dropped_pages: int = 0  # host pages dropped, LRU, to make room
    copy_ops: int = 0  # copies and gather/scatter kernels launched (CUDA: uploads too)


@dataclass(frozen=True)
class Copier:
    """The tier's buffers, as [pages, page elements], and its copy stream (None: a CPU)."""

    device: torch.Tensor  # the KV pool's buffer
    host: torch.Tensor  # the host pool's buffer
    staging: torch.Tensor  # on the device: a chunk of scattered pages passes through it
    stream: torch.cuda.Stream | None
    counters: TierCounters

    def copy(self, moves: list[Move]) -> None:
        """Run `moves` in order, segment by segment (on the current stream)."""
        for to_host, segment in groupby(moves, key=lambda m: m.to_host):
            calls = list(segment)
            device = flat_array([m.device_pages for m in calls], torch.int64)
            host = flat_array([m.host_pages for m in calls], torch.int64)
            self._segment(to_host, *last_writes(to_host, device, host))

    def _segment(self, to_host: bool, device: np.ndarray, host: np.ndarray) -> None:
        non_blocking = self.stream is not None
        rows: torch.Tensor | None = None
        for start, stop, scattered in host_runs(device, host, len(self.staging)):
            h, d, n = int(host[start]), int(device[start]), stop - start
            host_slice = self.host[h : h + n]
            if not scattered:
                if to_host:
                    host_slice.copy_(self.device[d : d + n], non_blocking)
                else:
                    self.device[d : d + n].copy_(host_slice, non_blocking)
                self.counters.copy_ops += 1
                continue
            if rows is None:
                rows = upload(torch.from_numpy(device), self.device.device)
                self.counters.copy_ops += int(non_blocking)
            staged, index = self.staging[:n], rows[start:stop]
            if to_host:
                torch.index_select(self.device, 0, index, out=staged)
                host_slice.copy_(staged, non_blocking)
            else:
                staged.copy_(host_slice, non_blocking)
                self.device.index_copy_(0, index, staged)
            self.counters.copy_ops += 2


def last_writes(
    to_host: bool, device: np.ndarray, host: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """A segment's pages, each destination's last write only, sorted by host page."""
    written = host if to_host else device
    order = np.argsort(written, kind="stable")  # a destination's writes in queue order
    last = np.ones(len(order), dtype=bool)
    last[:-1] = written[order[1:]] != written[order[:-1]]
    keep = order[last]
    if not to_host:
        keep = keep[np.argsort(host[keep], kind="stable")]
    return device[keep], host[keep]


def host_runs(device: np.ndarray, host: np.ndarray, chunk: int) -> Iterator[tuple[int, int, bool]]:
    """(start, stop, scattered) over pages sorted by host page: runs of consecutive host
    pages, whole where their device pages are consecutive too, else in chunks of `chunk`."""
    n = len(host)
    if not n:
        return
    host_breaks = np.flatnonzero(host[1:] != host[:-1] + 1) + 1
    # device_breaks[i]: device discontinuities among the first i + 1 pages
    device_breaks = np.zeros(n, dtype=np.int64)
    np.cumsum(device[1:] != device[:-1] + 1, out=device_breaks[1:])
    starts = [0, *host_breaks.tolist()]
    stops = [*starts[1:], n]
    for a, b in zip(starts, stops, strict=True):
        if device_breaks[b - 1] == device_breaks[a]:
            yield a, b, False
            continue
        for c in range(a, b, chunk):
            yield c, min(c + chunk, b), True


@dataclass
class PageMoves:
    """One step's queued copies, run in order when the step is launched: the forward waits
    for the first `wait` of them (and for `fence`), the rest run beside it."""

    moves: list[Move]
    copier: Copier
    # CUDA: each run's (start, end) events, timed once done (`HostTier._harvest`)
    timings: list[tuple[torch.cuda.Event, torch.cuda.Event]] = field(default_factory=list)
    wait: int = -1  # how many of `moves` the forward waits for (-1: all)
    fence: torch.cuda.Event | None = None  # earlier copies that read pages this step writes
    done: torch.cuda.Event | None = None  # recorded after every move (a later fence)

    def run(self) -> None:
        wait = len(self.moves) if self.wait < 0 else self.wait
        copier = self.copier
        if copier.stream is None:
            started = time.perf_counter()
            copier.copy(self.moves)
            copier.counters.load_stall_seconds += time.perf_counter() - started
            return
        compute = torch.cuda.current_stream(copier.device.device)
        if self.fence is not None:
            compute.wait_event(self.fence)
        if not self.moves:
            return
        copier.stream.wait_stream(compute)  # after every step launched before this one
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(copier.stream):
            start.record()
            copier.copy(self.moves[:wait])
            end.record()
            copier.copy(self.moves[wait:])
            if self.done is not None:
                self.done.record()
        if wait:
            compute.wait_event(end)
            self.timings.append((start, end))
        # the host side and the staging buffer are reused only by later copies, queued on
        # this same stream
