"""The router's admission line: a fixed or capacity-derived limit, FIFO waiting, 429s."""

from __future__ import annotations

import asyncio

import pytest

from baton.services.router.admission import (
    CAPACITY_FACTOR,
    FALLBACK_LIMIT,
    Admission,
    Overloaded,
    derived_limit,
)


async def test_waiters_keep_their_place() -> None:
    admission = Admission(lambda: 1, max_queued=10, queue_timeout=5)
    await admission.enter()
    order: list[str] = []

    async def wait(name: str) -> None:
        await admission.enter()
        order.append(name)

    first = asyncio.create_task(wait("first"))
    await asyncio.sleep(0)
    second = asyncio.create_task(wait("second"))
    await asyncio.sleep(0)
    assert admission.queued == 2
    admission.leave()
    # A newcomer arriving now queues behind them instead of taking the freed slot.
    late = asyncio.create_task(wait("late"))
    await first
    admission.leave()
    await second
    admission.leave()
    await late
    assert order == ["first", "second", "late"]
    assert admission.active == 1 and admission.queued == 0


async def test_a_full_line_is_refused_at_once() -> None:
    admission = Admission(lambda: 1, max_queued=1, queue_timeout=5)
    await admission.enter()
    waiting = asyncio.create_task(admission.enter())
    await asyncio.sleep(0)
    with pytest.raises(Overloaded, match="1 queued"):
        await admission.enter()
    admission.leave()
    assert await waiting


async def test_waiting_too_long_is_refused_and_frees_the_place() -> None:
    admission = Admission(lambda: 1, max_queued=4, queue_timeout=0.05)
    await admission.enter()
    with pytest.raises(Overloaded, match=r"0\.05s"):
        await admission.enter()
    assert admission.queued == 0 and admission.active == 1


async def test_a_waiter_that_goes_away_leaks_no_slot() -> None:
    admission = Admission(lambda: 1, max_queued=4, queue_timeout=5)
    await admission.enter()
    gone = asyncio.create_task(admission.enter())
    await asyncio.sleep(0)
    admission.leave()  # the slot goes to `gone`...
    gone.cancel()  # ...which leaves before it runs: the slot must come back
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert admission.active == 0
    assert await asyncio.wait_for(admission.enter(), 1)


async def test_the_limit_follows_the_workers_capacity() -> None:
    capacity = 0
    limit = derived_limit(lambda: capacity)
    assert limit() == FALLBACK_LIMIT  # nobody reports a capacity
    capacity = 2
    assert limit() == 2 * CAPACITY_FACTOR
    admission = Admission(limit, max_queued=10, queue_timeout=5)
    for _ in range(limit()):
        await admission.enter()
    waiting = asyncio.create_task(admission.enter())
    await asyncio.sleep(0)
    assert not waiting.done()
    capacity = 3  # a worker joined
    admission.wake()
    assert await asyncio.wait_for(waiting, 1)
