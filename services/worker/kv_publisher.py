"""The worker's side of KV events: the frontend numbers the scheduler's cache changes and
streams them to every subscriber (the router's `SubscribeKVEvents`).

The scheduler process sends its radix cache's events once a step (`KVEventsOut`, over
ZMQ: in order, nothing lost while both processes live). Here they become `KVEventBatch`es
numbered from 1 in this incarnation, and are applied to a `PageSet`, the pages they add up
to, so a subscriber can start from a snapshot at any time without asking the scheduler.
The last `backlog` batches are kept for a subscriber that reconnects; one further behind,
of another incarnation, or asking for seq 0 gets a snapshot. A subscriber that falls
`backlog` batches behind live is dropped (it reconnects and catches up the same way).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator

from baton.common.kv_events import InconsistentEvents, KVEventBatch, PageEvent, PageSet
from baton.common.protocol import KVEventsOut

log = logging.getLogger("baton.worker")

KEEPALIVE_S = 1.0  # a quiet stream repeats its last seq this often, so the router trusts it
SNAPSHOT_PART_PAGES = 1 << 16  # pages per snapshot message (well under gRPC's 4 MiB)


class KVEventPublisher:
    def __init__(self, incarnation: str, page_size: int, backlog: int) -> None:
        self.incarnation = incarnation
        self.page_size = page_size
        self._backlog: deque[KVEventBatch] = deque(maxlen=backlog)
        self._pages = PageSet()
        self._seq = 0
        self._found_tokens = 0
        self._subscribers: set[asyncio.Queue[KVEventBatch | None]] = set()
        self._closed = False

    @property
    def seq(self) -> int:
        """The last batch's number (0 before the first)."""
        return self._seq

    def publish(self, out: KVEventsOut) -> KVEventBatch:
        """Number the scheduler's events, keep them, and pass them to every subscriber."""
        try:
            self._pages.apply(out.events)
        except InconsistentEvents as e:  # a bug: say so; subscribers resync from here
            log.error("the scheduler's KV events do not add up: %s", e)
            for queue in list(self._subscribers):
                self._drop(queue)
        self._seq += 1
        batch = self._batch(self._seq, out.created_at, out.events)
        self._backlog.append(batch)
        for queue in list(self._subscribers):
            if queue.qsize() >= (self._backlog.maxlen or 0):
                self._drop(queue)
            else:
                queue.put_nowait(batch)
        return batch

    def note_found(self, cached_tokens: int) -> None:
        """A finished response reported `cached_tokens` (told to the router with every
        batch, to set against its predictions)."""
        self._found_tokens += cached_tokens

    def close(self) -> None:
        """End every subscriber's stream, and refuse new ones: the worker is stopping, and
        gRPC waits for open streams before it stops."""
        self._closed = True
        for queue in list(self._subscribers):
            self._drop(queue)

    async def subscribe(self, incarnation: str, from_seq: int) -> AsyncIterator[KVEventBatch]:
        """The batches from `from_seq` on, or a snapshot, then each new one as it comes."""
        if self._closed:
            return
        queue: asyncio.Queue[KVEventBatch | None] = asyncio.Queue()
        self._subscribers.add(queue)
        try:
            sent = self._seq
            # taken before the first yield: whatever is published meanwhile is in `queue`
            first = self._replay(incarnation, from_seq) or self._snapshot()
            for batch in first:
                yield batch
            while True:
                try:
                    next_batch = await asyncio.wait_for(queue.get(), KEEPALIVE_S)
                except TimeoutError:  # quiet: every batch published was sent
                    yield self._batch(sent, time.time(), [])
                    continue
                if next_batch is None:
                    return
                if next_batch.seq > sent:
                    sent = next_batch.seq
                    yield next_batch
        finally:
            self._subscribers.discard(queue)

    def _replay(self, incarnation: str, from_seq: int) -> list[KVEventBatch]:
        """The backlog from `from_seq` on, if it reaches back that far (else [])."""
        if incarnation != self.incarnation or from_seq < 1 or from_seq > self._seq + 1:
            return []
        oldest = self._backlog[0].seq if self._backlog else self._seq + 1
        if from_seq < oldest:
            return []
        replay = [b for b in self._backlog if b.seq >= from_seq]
        # nothing new since: a keepalive, so the subscriber knows it is in sync
        return replay or [self._batch(self._seq, time.time(), [])]

    def _snapshot(self) -> list[KVEventBatch]:
        parts = list(self._pages.snapshot(SNAPSHOT_PART_PAGES)) or [[]]
        now = time.time()
        batches = []
        for i, part in enumerate(parts):
            batch = self._batch(self._seq, now, part)
            batch.reset, batch.complete = i == 0, i == len(parts) - 1
            batches.append(batch)
        return batches

    def _batch(self, seq: int, created_at: float, events: list[PageEvent]) -> KVEventBatch:
        return KVEventBatch(
            self.incarnation,
            seq,
            created_at,
            self.page_size,
            events,
            found_tokens=self._found_tokens,
        )

    def _drop(self, queue: asyncio.Queue[KVEventBatch | None]) -> None:
        self._subscribers.discard(queue)
        queue.put_nowait(None)
