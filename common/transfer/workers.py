"""Transfer workers: a few threads per destination, each with its own data connection.

A room is pinned to one worker thread (round robin over that destination's threads) so its
jobs run in order. A worker takes every job waiting in its queue, groups them by room,
coalesces each room's queued pages into regions contiguous on both sides, and pushes them;
a room whose finish is among the jobs then gets its final status.

Where the lane's connection copies on the GPU into D's mapped pool (ipc, ``launches``), the
thread that sends the pages (P's scheduler) queues the copies itself, behind the step that
computes them, without waiting, and the lane waits for them only once the room finishes or
fails (before the final status, or before the release). The first room to a destination
still goes through its lane (which connects), and so do rooms with checksums.

A lane connects when its first job needs the connection, or ahead of any room when asked
(`TransferWorkers.connect`: a live migration's target is known before its hand-off, and the
hand-off should not wait for a handshake, for ipc the mapping of the target's pool).

Where D's doorbells are mapped too (``rings``), the thread that finishes a room sends its
final status at once and rings the room's bell: queued on the GPU behind the copies when
the sending thread launched them all, else by the lane once its copies returned. D then
needs no message to learn that the pages landed (see doorbell).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from baton.common.transfer.backend import DataConnection, Outbound, TransferBackend
from baton.common.transfer.base import PeerLostError, TransferError
from baton.common.transfer.messages import DataHello, RegionFrame
from baton.common.transfer.regions import ByteBuffer, Region, coalesce
from baton.common.transfer.room import TransferStats
from baton.common.transfer.sender import (
    FinishJob,
    Job,
    Launched,
    ReleaseJob,
    SenderRoom,
    SendJob,
)

logger = logging.getLogger(__name__)

_PUSH_BYTES = 64 << 20  # between pushes of this size a worker notices an aborted room


@dataclass(frozen=True)
class ConnectJob:
    """Open the lane's connection now, before any room needs it; `done(error)` once it is
    open (None) or could not be."""

    done: Callable[[BaseException | None], None]


class _Lane:
    """One worker thread and its connection to one destination."""

    def __init__(self, pool: TransferWorkers, address: str, index: int):
        self._pool = pool
        self._address = address
        self._queue: queue.SimpleQueue[Job | ConnectJob | None] = queue.SimpleQueue()
        self._order = threading.Lock()
        self._deferred: list[SendJob] = []  # launched, queued with the next other job
        self._conn: DataConnection | None = None
        self._thread = threading.Thread(target=self._run, name=f"kv-transfer-{index}", daemon=True)
        self._thread.start()

    def submit(self, job: Job | ConnectJob | None) -> None:
        # One at a time: a room failing while its pages are being launched queues its
        # release after them, so the lane waits for those copies before releasing.
        with self._order:
            if isinstance(job, SendJob):
                send = job = self._launch(job)
                if send.launched is not None:
                    # Nothing for the lane to do before the room finishes or fails: woken
                    # now, it would take the GIL from the thread about to finish the room.
                    self._deferred.append(send)
                    return
            elif isinstance(job, FinishJob):
                self._announce(job.room)
            for deferred in self._deferred:  # in order, before anything queued after them
                self._queue.put(deferred)
            self._deferred.clear()
            self._queue.put(job)

    def _launch(self, job: SendJob) -> SendJob:
        """The job with its copies queued on the GPU now (caller's thread), where the
        connection can; else unchanged, for the lane to push."""
        conn, room = self._pool.shared.get(self._address), job.room
        if conn is None or not conn.launches or room.checksum or room.state.state.terminal:
            room.all_launched = False
            return job
        items = [self._outbound(room, r) for r in coalesce(job.pairs, self._pool.page_bytes)]
        try:
            done = conn.launch(self._pool.source, items, job.ready)
        except Exception as exc:  # never the scheduler's error: the lane meets it again
            logger.debug("kv transfer: launching room %d's copies failed: %r", room.room, exc)
            room.all_launched = False
            return job
        room.backend = conn.backend
        return SendJob(room, job.pairs, job.ready, Launched([i.frame for i in items], done))

    def _announce(self, room: SenderRoom) -> None:
        """Where D's doorbells are mapped: the final status leaves now (caller's thread),
        and the bell rings behind the copies on the GPU when they were all launched, else
        from the lane once its copies returned."""
        conn = self._pool.shared.get(self._address)
        if conn is None or not conn.rings or room.bell < 0 or room.checksum:
            return
        if room.state.state.terminal or not self._pool.backend.deliver_done(room.room):
            return
        try:
            if room.all_launched:
                room.rung = conn.launch_ring(self._pool.source, room.bell, room.room)
        except Exception as exc:  # the lane rings instead
            logger.debug("kv transfer: queuing room %d's bell failed: %r", room.room, exc)
        room.announce()
        # the role's statistics show which path the final status takes
        self._pool.stats.add(rooms_announced=1, bells_launched=int(room.rung))

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        running = True
        while running:
            batch = [self._queue.get()]
            while True:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            running = None not in batch
            by_room: dict[SenderRoom, list[Job]] = {}
            for job in batch:
                if isinstance(job, ConnectJob):
                    self._open(job)
                elif job is not None:
                    by_room.setdefault(job.room, []).append(job)
            for room, jobs in by_room.items():
                self._process(room, jobs)
        if self._conn is not None:
            self._conn.close()

    def _connection(self) -> DataConnection:
        """The lane's connection, opened on first use."""
        if self._conn is None:
            pool = self._pool
            self._conn = pool.backend.connect(self._address, pool.hello)
            if self._conn.launches or self._conn.rings:  # any thread may use it
                pool.shared.setdefault(self._address, self._conn)
        return self._conn

    def _open(self, job: ConnectJob) -> None:
        try:
            self._connection()
        except Exception as exc:  # the first room connects again, and fails then
            logger.info("kv transfer: connecting to %s ahead failed: %s", self._address, exc)
            job.done(exc)
        else:
            job.done(None)

    def _process(self, room: SenderRoom, jobs: list[Job]) -> None:
        pool = self._pool
        try:
            sends = [job for job in jobs if isinstance(job, SendJob)]
            for job in sends:  # first of all: no launched write may outlive a release
                if job.launched is not None:
                    self._landed(room, job.launched)
                elif job.ready is not None:
                    job.ready.synchronize()  # the step that computed the pages is done
            pairs = [pair for job in sends if job.launched is None for pair in job.pairs]
            if pairs:
                self._push(room, coalesce(pairs, pool.page_bytes))
            if any(isinstance(job, FinishJob) for job in jobs) and not room.state.state.terminal:
                pool.backend.before_push(room.room)
                bells = pool.shared.get(self._address)
                if room.announced and not room.rung and bells is not None:
                    bells.ring(room.bell, room.room)  # every copy of the room returned
                direct = self._conn is not None and self._conn.direct
                room.complete(deliver=pool.backend.deliver_done(room.room), direct=direct)
        except PeerLostError as exc:
            logger.warning("kv transfer to %s broke: %s", self._address, exc)
            if self._conn is not None:
                self._conn.close()
                self._conn = None
            pool.shared.pop(self._address, None)
            pool.on_peer_lost(room.state.peer)
        except TransferError as exc:
            room.fail(str(exc), tell_peer=True)
        except Exception as exc:
            logger.exception("kv transfer of room %d failed", room.room)
            room.fail(f"internal error: {exc!r}", tell_peer=True)
        if any(isinstance(job, ReleaseJob) for job in jobs):
            room.released()

    def _landed(self, room: SenderRoom, launched: Launched) -> None:
        began = time.perf_counter()
        launched.done.synchronize()
        pool = self._pool
        pool.stats.add_seconds("send", time.perf_counter() - began)
        room.pushed(launched.frames, direct=True)
        size = sum(f.length for f in launched.frames)
        pool.stats.add(
            bytes_sent=size,
            pages_sent=size // pool.page_bytes,
            regions_sent=len(launched.frames),
            sends_launched=1,  # the role's statistics show which path the copies take
        )

    def _push(self, room: SenderRoom, regions: list[Region]) -> None:
        pool = self._pool
        start = 0
        while start < len(regions) and not room.state.state.terminal:
            end, size = start, 0
            while end < len(regions) and (end == start or size < _PUSH_BYTES):
                size += regions[end].length
                end += 1
            pool.backend.before_push(room.room)
            items = [self._outbound(room, region) for region in regions[start:end]]
            conn = self._connection()
            began = time.perf_counter()
            room.backend = conn.backend
            conn.push(pool.source, items)
            pool.stats.add_seconds("send", time.perf_counter() - began)
            room.pushed([item.frame for item in items], conn.direct)
            pool.stats.add(
                bytes_sent=size, pages_sent=size // pool.page_bytes, regions_sent=end - start
            )
            start = end

    def _outbound(self, room: SenderRoom, region: Region) -> Outbound:
        crc = None
        if room.checksum:
            crc = self._pool.source.crc32(region.src_offset, region.length)
        frame = RegionFrame(room.room, region.dst_offset, region.length, crc)
        return Outbound(frame, region.src_offset)


class TransferWorkers:
    """All transfer threads of one prefill manager, grouped by destination address."""

    def __init__(
        self,
        backend: TransferBackend,
        source: ByteBuffer,
        page_bytes: int,
        hello: DataHello,
        threads_per_destination: int,
        stats: TransferStats,
        on_peer_lost: Callable[[str], None],
    ):
        self.backend = backend
        self.source = source
        self.page_bytes = page_bytes
        self.hello = hello
        self.stats = stats
        self.on_peer_lost = on_peer_lost
        self._threads = threads_per_destination
        self._lock = threading.Lock()
        self._lanes: dict[str, list[_Lane]] = {}
        self._next_lane: dict[str, itertools.count[int]] = {}
        # A connection per destination that any thread may launch copies or ring bells
        # through (see _Lane)
        self.shared: dict[str, DataConnection] = {}
        self._closed = False

    def submit(self, job: Job) -> None:
        room = job.room
        address = room.transfer_address
        with self._lock:
            lanes = self._lanes_to(address)
            if room.lane is None:
                room.lane = next(self._next_lane[address]) % self._threads
        lanes[room.lane].submit(job)

    def connect(self, address: str) -> Future[None]:
        """Open every lane's connection to the receiver at `address` now, each in its own
        thread, so that the first room there waits for none; done once all are open, or
        with the first failure."""
        opened: Future[None] = Future()
        with self._lock:
            lanes = self._lanes_to(address)
        left = len(lanes)
        lock = threading.Lock()

        def done(error: BaseException | None) -> None:
            nonlocal left
            with lock:
                left -= 1
                if opened.done():
                    return
                if error is not None:
                    opened.set_exception(error)
                elif not left:
                    opened.set_result(None)

        for lane in lanes:
            lane.submit(ConnectJob(done))
        return opened

    def _lanes_to(self, address: str) -> list[_Lane]:
        """Under self._lock: the lanes to `address`, started on first use."""
        if self._closed:
            raise RuntimeError("the transfer manager is shut down")
        lanes = self._lanes.get(address)
        if lanes is None:
            first = len(self._lanes) * self._threads
            lanes = [_Lane(self, address, first + i) for i in range(self._threads)]
            self._lanes[address] = lanes
            self._next_lane[address] = itertools.count()
        return lanes

    def close(self) -> None:
        with self._lock:
            self._closed = True
            lanes = [lane for group in self._lanes.values() for lane in group]
        for lane in lanes:
            lane.submit(None)
        for lane in lanes:
            lane.join(timeout=5)
