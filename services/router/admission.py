"""Admission: how many generation requests the router runs at once, and who waits.

Up to `limit()` requests run. More wait in a queue, in arrival order: a slot that frees
goes to the oldest waiter, never to a newcomer, so queued requests keep their place. A
request is refused with `Overloaded` (the caller answers 429 with Retry-After) when the
queue already holds `max_queued`, or when it waited `queue_timeout` seconds.

The limit is a fixed number (`--max-concurrent-requests`) or follows the workers'
reported capacity (`derived_limit`): what the decode and aggregated workers run at once,
times `CAPACITY_FACTOR` so that each worker also holds its next batch (prefill and KV
transfer overlap the running decode batch). Call `wake()` when the capacity grows.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable

CAPACITY_FACTOR = 2
FALLBACK_LIMIT = 256  # workers that report no capacity (older workers, fakes)


class Overloaded(Exception):
    """The request cannot be admitted now; it may be retried later."""


def derived_limit(capacity: Callable[[], int]) -> Callable[[], int]:
    """A limit that follows `capacity()` (requests the workers run at once; 0: unknown)."""

    def limit() -> int:
        reported = capacity()
        return CAPACITY_FACTOR * reported if reported > 0 else FALLBACK_LIMIT

    return limit


class Admission:
    def __init__(self, limit: Callable[[], int], max_queued: int, queue_timeout: float) -> None:
        self.limit = limit
        self.max_queued = max_queued
        self.queue_timeout = queue_timeout
        self.active = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def queued(self) -> int:
        return len(self._waiters)

    async def enter(self) -> bool:
        """Take a slot (True), waiting in line for one if needed. Raises Overloaded."""
        if not self._waiters and self.active < self.limit():
            self.active += 1
            return True
        if len(self._waiters) >= self.max_queued:
            raise Overloaded(
                f"the router is at its limit of {self.limit()} concurrent requests and "
                f"{self.max_queued} queued; retry later"
            )
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(self.queue_timeout):
                await waiter
        except BaseException as e:  # timed out, or the client went away
            if waiter.done() and not waiter.cancelled():
                self.leave()  # the slot came just as we gave up: pass it on
            else:
                waiter.cancel()
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
            if isinstance(e, TimeoutError):
                raise Overloaded(
                    f"no slot freed within {self.queue_timeout:g}s (limit "
                    f"{self.limit()} concurrent requests); retry later"
                ) from None
            raise
        return True

    def leave(self) -> None:
        self.active -= 1
        self.wake()

    def wake(self) -> None:
        """Hand free slots to the oldest waiters (after a leave, or when the limit grew)."""
        while self._waiters and self.active < self.limit():
            waiter = self._waiters.popleft()
            if waiter.done():
                continue
            self.active += 1
            waiter.set_result(None)
