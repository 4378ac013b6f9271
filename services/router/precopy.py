"""Live migration's pre-copy (issue 41): warm the target's prefix cache while the source
decodes on, so that the hand-off that follows sends only the pages written since.

    target D2 (with a prefix cache) ◀── Generate(context[:n], max_new_tokens=1, room,
        peer D1): to D2, D1 is a prefill worker that computed those n tokens
    source D1 ◀── Migrate(request, room, D2, precopy_tokens=n): D1 sends the pages of the n
        tokens that D2 does not hold, with the token at n, and decodes on
    D2's one-token request ends ──▶ its n tokens' pages stay in D2's prefix cache (its
        output is dropped here)

n is the context (prompt and tokens passed on) but its last token, rounded down to whole
pages: tokens whose KV D1 computed steps ago; contexts under `MIN_TOKENS` move without. While a round runs the request decodes on, so
a round that leaves more than `SETTLED_PAGES` new whole pages behind is followed by another
(up to `ROUNDS`), which D2 matches against the first round's pages and so copies only the
pages written since. At the hand-off D2 finds them all in its cache (`KVInit.prefix_pages`):
the stall copies only the last round's delta and the partial last page. A pre-copy that
fails in any way (refused, the source gone, a timeout, the pages evicted since) only costs
its time: the hand-off sends whatever D2 lacks, as without it.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable, Sequence

import grpc.aio

from baton.common.rpc import baton_pb2 as pb
from baton.common.rpc.convert import request_to_proto
from baton.common.sampling import SamplingParams
from baton.services.router.worker_handle import WorkerHandle

log = logging.getLogger(__name__)

PRECOPY_TIMEOUT_S = 10.0  # every round together; the hand-off follows either way
MIGRATE_TIMEOUT_S = 2.0
ENDED = ("length", "stop")  # the target's one-token request ended well: its pages cached
ROUNDS = 3
# Below this, copying the whole context at the hand-off costs about what a pre-copy's
# control round trips do, and a pre-copy only delays the move (by its rounds' steps).
MIN_TOKENS = 1024
SETTLED_PAGES = 2  # whole pages written during a round that need no further round


def precopy_tokens(context: int, page_size: int) -> int:
    """The tokens of a `context`-token context to copy ahead: all but the last (its KV is
    not computed yet), rounded down to whole pages."""
    return (context - 1) // page_size * page_size


async def warm_rounds(
    source: WorkerHandle,
    target: WorkerHandle,
    request_id: str,
    context: Callable[[], Sequence[int]],
) -> int:
    """`warm` in rounds over the growing `context()` until few new pages are left; the
    pages the target holds after the last round that succeeded (0: none)."""
    held = 0
    loop = asyncio.get_running_loop()
    deadline = loop.time() + PRECOPY_TIMEOUT_S
    for _ in range(ROUNDS):
        left = deadline - loop.time()
        pages = await warm(source, target, request_id, context(), left) if left > 0 else 0
        if pages <= held:  # failed, or nothing new
            break
        held = pages
        whole = precopy_tokens(len(context()), target.info.layout.page_size)
        if whole // target.info.layout.page_size - held <= SETTLED_PAGES:
            break
    return held


async def warm(
    source: WorkerHandle,
    target: WorkerHandle,
    request_id: str,
    context: Sequence[int],
    timeout: float = PRECOPY_TIMEOUT_S,
) -> int:
    """Copy the pages of `context` (request `request_id` decoding on `source`) to
    `target`'s prefix cache within `timeout` seconds; the pages it holds after (0 when
    nothing was done)."""
    page_size = target.info.layout.page_size
    tokens = precopy_tokens(len(context), page_size)
    if tokens < MIN_TOKENS or not target.info.load.prefix_cache:
        return 0  # (a target without a prefix cache would drop the pages at once)
    room = random.getrandbits(63) | 1
    warming = request_to_proto(
        f"{request_id}-precopy-{room:x}",
        list(context[:tokens]),
        SamplingParams(max_new_tokens=1),
        room,
        source.peer(),
    )
    call = target.stub.Generate(warming, timeout=timeout)
    ask = pb.MigrateRequest(
        request_id=request_id, room=room, peer=target.peer(), precopy_tokens=tokens
    )
    finish = ""
    try:
        async with asyncio.timeout(timeout):
            await source.stub.Migrate(ask, timeout=MIGRATE_TIMEOUT_S)
            async for response in call:
                finish = finish or response.finish_reason
    except (grpc.aio.AioRpcError, grpc.aio.UsageError, TimeoutError) as e:
        finish = f"failed: {e}"
    finally:
        call.cancel()  # (a no-op once it ended: else the target aborts its request)
    if finish not in ENDED:
        log.info("request %s: pre-copy to %s %s", request_id, target.worker_id, finish)
        return 0
    return tokens // page_size
