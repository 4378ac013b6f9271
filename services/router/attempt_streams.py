"""Reading one attempt's worker streams into its generation's outputs (`generation.py`).

Two shapes. One worker computes the prompt and decodes (`single`): an aggregated worker,
a decode worker placed `local` (`placement.py`: `Generate` to D alone, without a room or a
peer), or a live migration's target, which continues from its source's pages (a room and
the source as its peer). Or a prefill/decode pair (`pd`: placements `disagg-delta` and
`disagg-full`): `Generate` goes to D and to P at the same time, naming each other and a
fresh room. P's stream carries the first token and ends; D's stream carries tokens 2..n
and the finish. The first token is passed on as soon as P sends it; anything D sends
before that waits behind it.

A worker that hands the request off (finish reason `MIGRATED`: a live migration's source)
ends the attempt with `Moved` after that output. A decode worker placed `local` that did
not start the prompt within `start_within` ends it unstarted (`HANDED_BACK`): `HandedBack`.
What the generation counts of each output it hears through `Reader`; this module does not
import the generation.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from typing import Protocol

from baton.common.protocol import TokenOut
from baton.common.rpc import baton_pb2 as pb
from baton.common.state import FinishReason
from baton.services.router.attempt import (
    Attempt,
    EngineRequest,
    HandedBack,
    Moved,
    Timings,
    WorkerFailure,
    grpc_request,
)
from baton.services.router.worker_handle import WorkerHandle

MIGRATED = FinishReason.MIGRATED.value  # a worker handed the request off (live)
HANDED_BACK = FinishReason.HANDED_BACK.value  # D did not start a local prompt in time


class Reader(Protocol):
    """The generation an attempt's outputs are read for (`Generation`)."""

    timings: Timings  # the current attempt's; `Attempt.next` fills it in

    def received(self, response: TokenOut) -> TokenOut | None:
        """`response`, unless it carries neither tokens nor the finish."""

    def finished_on(self, worker: WorkerHandle, last: TokenOut) -> None:
        """The generation finished on `worker`; `last` is its last output."""

    def count_computed(self, answer: TokenOut) -> None:
        """Count the prompt tokens the placed worker computed; `answer`: its last output."""

    def handed_off(self, attempt: Attempt, worker: WorkerHandle, output: TokenOut) -> TokenOut:
        """`worker` handed the request off (live): `output`, passed on as an ordinary one."""


async def single(
    reader: Reader,
    attempt: Attempt,
    request: EngineRequest,
    worker: WorkerHandle,
    room: int = 0,
    source: pb.PeerInfo | None = None,
    start_within: float = 0.0,
) -> AsyncIterator[TokenOut]:
    """One worker computes the prompt and decodes (aggregated, or D placed local: to be
    started within `start_within` s), or, with a room, continues a live migration from
    `source`'s pages."""
    attempt.start(worker, grpc_request(request, attempt.request_id, room, source, start_within))
    while True:
        _, response = await attempt.next(reader.timings)
        if response is None:
            raise WorkerFailure(worker.worker_id, "stream ended before the request finished")
        if response.finish_reason == HANDED_BACK:
            attempt.done(worker)  # it computed and holds nothing of it: no Abort owed
            raise HandedBack(worker.worker_id)
        if output := reader.received(response):
            if output.finish_reason == MIGRATED:
                yield reader.handed_off(attempt, worker, output)
                raise Moved()
            if output.finish_reason:
                # Marked before the yield: a consumer may stop at the finishing output.
                attempt.done(worker)
                reader.finished_on(worker, output)
                reader.count_computed(output)
            yield output
            if output.finish_reason:
                return


async def pd(
    reader: Reader,
    attempt: Attempt,
    request: EngineRequest,
    prefill: WorkerHandle,
    decode: WorkerHandle,
) -> AsyncIterator[TokenOut]:
    """P computes the prompt and sends its first token; D decodes the rest from P's pages."""
    room = random.getrandbits(63) | 1
    attempt.start(decode, grpc_request(request, attempt.request_id, room, prefill.peer()))
    attempt.start(prefill, grpc_request(request, attempt.request_id, room, decode.peer()))
    first: TokenOut | None = None  # P's first token, once passed on
    held: list[TokenOut] = []  # D's outputs that arrived before P's first token
    decode_finished = False
    while True:
        try:
            worker, response = await attempt.next(reader.timings)
        except WorkerFailure as e:
            if first is not None and e.worker_id == prefill.worker_id:
                # P's part ended with its first token; D owns the request now and
                # reports any transfer failure itself.
                attempt.ended(prefill)
                continue
            raise
        if worker is prefill:
            if response is None:
                if first is None:
                    raise WorkerFailure(prefill.worker_id, "prefill ended without a token")
                attempt.ended(prefill)  # its part is over: not in flight on it any more
                continue  # P may still be sending KV: it is aborted too if D never finishes
            output = reader.received(response)
            if first is not None or output is None:
                continue  # only timings matter after the first token
            first = output
            reader.count_computed(first)
            if first.finish_reason:
                attempt.done(prefill)  # D is aborted on close: it has nothing to do
            yield first
            if first.finish_reason:
                return
            pending, held = held, []
        else:
            if response is None:
                if decode_finished:
                    continue  # its finish waits behind P's first token
                raise WorkerFailure(decode.worker_id, "decode ended before finishing")
            output = reader.received(response)
            if output is None:
                continue
            decode_finished = output.finish_reason is not None
            if first is None:
                held.append(output)
                continue
            pending = [output]
        for output in pending:
            if output.finish_reason == MIGRATED:
                attempt.done(prefill)
                yield reader.handed_off(attempt, decode, output)
                raise Moved()
            if output.finish_reason:
                attempt.done(prefill, decode)
                reader.finished_on(decode, output)
            yield output
            if output.finish_reason:
                return
