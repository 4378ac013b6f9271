"""The host-memory tier of the prefix cache: pages the device pool evicts, kept in host RAM.

    device pool ──(evict: offload)──▶ host pool ──(host full: LRU drop)──▶ gone
         ▲                                │
         └──────(prefix hit: load)────────┘

The radix tree (`tiered_radix.py`) keeps host-resident pages as nodes whose `pages` are
empty and whose `host` pages hold the KV; a host node's descendants are on the host too.
A device node may also hold a host copy (`--host-kv-write through`); that copy is dropped
first when the host pool runs short, and makes its eviction free of copies.

Copies never run on the scheduler's thread. `HostTier` queues them in order, one `Move`
per call (a list of pages: at a page of one token a prefill chunk moves thousands), and
the step launched next runs them first, before its forward (`PageMoves.run`, from the
model runner): in stream order after every step launched before, which is what makes a
queued copy safe. A device page freed by an offload may be handed to a request of that
same step, whose forward writes it after the copy read it; a host page freed by a load
may be reused by an offload queued after it, which runs after the load. So a page is on
one tier, or in a queued move whose order settles which copy is read. On CUDA the copies
run on a stream of their own, the step's stream waits for their event, and the pool's host
side is pinned; on a CPU they are plain copies on the forward thread. However many pages
a step moves, it launches a bounded number of operations: per run of consecutive host
pages, one slice copy, or a gather/scatter kernel on the device and one slice copy per
64 MiB chunk through a staging buffer (`page_moves.py`).

Write-through copies wait one launch more: a page enters the tree while the step that
computes it is being scheduled (or is in flight, for a request finishing while the next
step runs), so its copy is queued behind the step after that one.

Copies ahead of need: a step's forward waits only for the copies queued while it was
scheduled (`PageMoves.wait`: the pages it writes were freed by them, or it reads what they
load). Copies of pages still in the tree (write-through, or `tiered_radix`'s copies of the
next pages to evict, queued at launch) run behind them, beside the forward, and nothing
waits for them until their pages are evicted: the step launched next then waits for their
launch's event (`fence`), by then long done. This keeps GPU->host offload off the step.
"""

from __future__ import annotations

import logging
import weakref
from collections import deque

import torch

from baton.common.cache.allocator import PageAllocator
from baton.common.cache.page_moves import (
    STAGING_BYTES,
    Copier,
    Move,
    PageMoves,
    TierCounters,
)
from baton.common.devices import cuda_host_register, cuda_host_unregister

log = logging.getLogger(__name__)
FENCE_EVENTS = 64  # launches whose copies' end events are kept for fences


def _check_fits(nbytes: int) -> None:
    """Refuse a host pool that the machine's available memory cannot hold (pinned memory
    cannot be swapped: the OOM killer would end the worker later, under load)."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return  # not Linux: nothing to check against
    if nbytes > 0.9 * available:
        raise ValueError(
            f"--host-kv-tokens asks for {nbytes / 2**30:.1f} GiB of host memory; "
            f"{available / 2**30:.1f} GiB is available"
        )


def _host_buffer(shape: tuple[int, ...], dtype: torch.dtype, pinned: bool) -> torch.Tensor:
    """The host pool, never read before written (empty). Pinned by registering a plain
    allocation with CUDA: torch's pinned allocator rounds a block up to a power of two, so
    a 40 GiB tier would pin 64 GiB, past what `_check_fits` allowed. Falls back to that
    allocator where registering fails."""
    buffer = torch.empty(shape, dtype=dtype)
    nbytes = buffer.numel() * buffer.element_size()
    if not pinned or nbytes == 0:
        return buffer
    if cuda_host_register(buffer.data_ptr(), nbytes):
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    # unregistered once the buffer goes, before its memory is freed (the finalizer holds it)
    weakref.finalize(buffer, _unregister, buffer.untyped_storage())
    return buffer


def _unregister(storage: torch.UntypedStorage) -> None:
    if error := cuda_host_unregister(storage.data_ptr()):
        log.warning("host tier: unregistering its pool failed: %s", error)


class HostTier:
    """The host pool, its page allocator and the queue of copies between the tiers. The
    radix tree decides what moves (`RadixCache`); this only allocates and queues. Takes
    `staging_bytes` (rounded down to whole pages, at least one) of the pool's device for
    the copies of scattered pages (`page_moves`): 64 MiB by default, which the worker's
    memory plan keeps out of the KV pool (`engine/memory.py`)."""

    def __init__(
        self,
        device_buffer: torch.Tensor,
        num_pages: int,
        write_through: bool,
        staging_bytes: int = STAGING_BYTES,
    ) -> None:
        self.device_buffer = device_buffer
        self.num_pages = num_pages
        self.write_through = write_through
        cuda = device_buffer.device.type == "cuda"
        shape = (num_pages, *device_buffer.shape[1:])
        _check_fits(num_pages * device_buffer[0].numel() * device_buffer.element_size())
        self.buffer = _host_buffer(shape, device_buffer.dtype, pinned=cuda)
        self.page_bytes = device_buffer[0].numel() * device_buffer.element_size()
        self.allocator = PageAllocator(num_pages)
        self.counters = TierCounters()
        self.stream = torch.cuda.Stream(device_buffer.device) if cuda else None
        # the staging buffer: at least one page, never more than either pool holds
        chunk = max(min(staging_bytes // self.page_bytes, len(device_buffer), num_pages), 1)
        page = device_buffer[0].numel()
        self.copier = Copier(
            device_buffer.view(len(device_buffer), page),
            self.buffer.view(num_pages, page),
            torch.empty((chunk, page), dtype=device_buffer.dtype, device=device_buffer.device),
            self.stream,
            self.counters,
        )
        self._queue: list[Move] = []
        self._wait = 0  # the queue's moves up to the last one a step needs done first
        self._timings: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._fence = 0  # the latest launch whose copies read pages handed out since
        self._done: deque[tuple[int, torch.cuda.Event]] = deque(maxlen=FENCE_EVENTS)

    @property
    def queued(self) -> bool:
        """Copies are queued, or pages that copies read have been handed out since."""
        return bool(self._queue) or self._fence > 0

    @property
    def pages_used(self) -> int:
        return self.num_pages - self.allocator.num_free

    def offload(self, device_pages: list[int], host_pages: list[int], ahead: bool = False) -> None:
        """Queue copies to the host. `ahead`: of pages that stay in the tree (no step
        writes them), so no step waits for them until `fence`."""
        assert len(device_pages) == len(host_pages)
        if device_pages:
            self._queue.append(Move(True, list(device_pages), list(host_pages)))
        self.counters.bytes_to_host += len(device_pages) * self.page_bytes
        if not ahead:
            self._wait = len(self._queue)

    def load(self, host_pages: list[int], device_pages: list[int], page_size: int) -> None:
        assert len(device_pages) == len(host_pages)
        if device_pages:
            self._queue.append(Move(False, list(device_pages), list(host_pages)))
        self._wait = len(self._queue)
        self.counters.bytes_to_device += len(device_pages) * self.page_bytes
        self.counters.hit_tokens += len(device_pages) * page_size

    def fence(self, launch: int) -> None:
        """Device pages that the copies of `launch` read (`offload(ahead=True)`) are being
        handed out: the next step waits for those copies before its forward."""
        self._fence = max(self._fence, launch)

    def take_moves(self, launch: int | None = None) -> PageMoves | None:
        """The copies queued since the last call, for the step being launched (its number:
        later fences find this launch's copies' event)."""
        self._harvest()
        fence = self._fence_event()
        if not self._queue and fence is None:
            return None
        moves, self._queue = self._queue, []
        wait, self._wait = self._wait, 0
        done = None
        if self.stream is not None and launch is not None and len(moves) > wait:
            done = torch.cuda.Event()
            self._done.append((launch, done))
        return PageMoves(moves, self.copier, self._timings, wait=wait, fence=fence, done=done)

    def _fence_event(self) -> torch.cuda.Event | None:
        """The end event of the first launch at or after the fence (one stream: it follows
        the fenced copies); the oldest kept if the fence is older still."""
        launch, self._fence = self._fence, 0
        if not launch or self.stream is None:
            return None
        for at, event in self._done:
            if at >= launch:
                return event
        raise AssertionError(f"no copies of launch {launch} or later to wait for")

    def _harvest(self) -> None:
        """Add finished CUDA copies' time to the stall counter (never waits for one).
        The list is shared with the forward thread, which only appends to it."""
        done = 0
        for start, end in list(self._timings):
            if not end.query():
                break  # (one stream: later ones are not done either)
            self.counters.load_stall_seconds += start.elapsed_time(end) / 1000
            done += 1
        del self._timings[:done]

    def run_queued(self) -> None:
        """Run what is queued now, outside a step (a flush, tests): waits for it."""
        moves = self.take_moves()
        if moves is not None:
            moves.run()
            if self.stream is not None:
                self.stream.synchronize()
