"""What happens when a step fails: no innocent request fails with it.

    step fails ──▶ every request of the failed step(s) gives its memory back (a role may
                   keep pages a transfer still reads), the prefix cache drops what no one
                   holds (the failed step may have left garbage in pages it inserted), and
                   the requests are queued again as *suspects*, keeping their tokens
    suspect    ──▶ computed in a step of its own: success clears it; failure is its own,
                   and it alone ends with the error
    broken     ──▶ the device reports an error, or suspects keep failing one after the
                   other: `FatalEngineError` (the worker fails what it holds and exits)

An error while one request's results are processed is that request's alone.
Greedy outputs stay token-exact: a recomputed request continues from the tokens it had.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from baton.common.state import FinishReason, Req, ScheduledBatch

if TYPE_CHECKING:
    from baton.common.cache.manager import CacheManager, HeldMemory
    from baton.common.engine.decode import DecodeManager
    from baton.common.engine.prefill import PrefillManager
    from baton.common.engine.step import InFlight

log = logging.getLogger(__name__)

MAX_CONSECUTIVE_CULPRITS = 3  # suspects failing alone in a row: the engine is broken


class FatalEngineError(RuntimeError):
    """The engine cannot go on (a broken device, or every step fails)."""


def abandon_in_flight(
    flights: Sequence[InFlight | None], launching: ScheduledBatch | None
) -> list[ScheduledBatch]:
    """After a failure: wait for every launched step (`flights`), return the batches that
    were built (`launching`) or launched and not processed; the caller forgets them."""
    batches = []
    for flight in flights:
        if flight is not None:
            flight.result.exception()  # wait for it, whatever it did
            batches.append(flight.batch)
    if launching is not None and all(b is not launching for b in batches):
        batches.append(launching)
    return batches


class Recovery:
    """Acts on the scheduler's queues, running set and memory, handed to it; ends requests
    through the scheduler's `finish`; `keep_memory` is the role's hook."""

    def __init__(
        self,
        cache: CacheManager,
        prefill: PrefillManager,
        decode: DecodeManager,
        requests: dict[str, Req],
        keep_memory: Callable[[Req, HeldMemory], bool],
        finish: Callable[[Req, FinishReason], None],
        check_device: Callable[[], None],
    ) -> None:
        self.cache, self.prefill, self.decode, self.requests = cache, prefill, decode, requests
        self.keep_memory, self.finish, self.check_device = keep_memory, finish, check_device
        self.failed_steps = 0
        self._culprits_in_a_row = 0

    def step_succeeded(self) -> None:
        self._culprits_in_a_row = 0

    def step_failed(self, exc: Exception, batches: list[ScheduledBatch]) -> None:
        """`batches`: the steps that failed or ran on what they computed (in flight)."""
        self.failed_steps += 1
        reqs: list[Req] = []
        for batch in batches:
            for item in batch.items:
                if item.req not in reqs and not item.req.finished:
                    reqs.append(item.req)
        solo = len(reqs) == 1 and reqs[0].suspect
        log.error(
            "a step of %d request(s) failed%s: %r",
            len(reqs),
            " (a suspect alone: it gets the error)" if solo else "; recomputing them one by one",
            exc,
            exc_info=exc,
        )
        if solo:
            self._culprit(reqs[0], exc)
        else:
            for req in reqs:
                self._requeue(req)
        self.cache.drop_unlocked()
        self.check_device()

    def request_failed(self, req: Req, exc: Exception) -> None:
        """An error traced to one request: it ends with the error, the rest go on."""
        if not req.finished:
            req.error = f"internal error: {exc!r}"
            self.finish(req, FinishReason.ERROR)

    def _culprit(self, req: Req, exc: Exception) -> None:
        req.in_flight = 0
        self.request_failed(req, exc)
        self._culprits_in_a_row += 1
        if self._culprits_in_a_row >= MAX_CONSECUTIVE_CULPRITS:
            raise FatalEngineError(
                f"{self._culprits_in_a_row} requests in a row failed alone; last error: {exc!r}"
            ) from exc

    def _requeue(self, req: Req) -> None:
        self.prefill.remove(req)
        self.decode.remove(req)
        req.in_flight = 0  # the failed steps' samples never happened
        req.future, req.penalty = 0, None  # rebuilt from the tokens it keeps
        if req.slot is not None:
            held = self.cache.take(req)
            if not self.keep_memory(req, held):
                self.cache.release_held(held)
        req.suspect = True
        self.requests[req.rid] = req
        self.prefill.add(req, front=True)
