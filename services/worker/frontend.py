"""The worker's gRPC frontend: the Worker service over the scheduler process.

Generate sends the request to the scheduler (through `SchedulerLink`, scheduler_link.py) and
streams token ids back as the scheduler produces them. A cancelled stream or an Abort call
aborts the request in the scheduler, which frees everything it held. While draining
(SIGTERM), new requests are refused with UNAVAILABLE and running ones finish. SetRole
changes the worker's role in place the same way: new requests are refused while the open
streams end and then the scheduler's rooms (bounded), the scheduler swaps its role, and
`on_role_changed` registers it again. Once the scheduler is lost, new requests are refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import grpc

from baton.common.protocol import (
    AbortReq,
    ConnectReq,
    MigrateReq,
    PeerInfo,
    SpansOut,
    SwitchRoleOut,
    TokenOut,
    out_of_vocab,
)
from baton.common.rpc import baton_pb2 as pb
from baton.common.rpc import baton_pb2_grpc as pb_grpc
from baton.common.rpc.convert import (
    kv_batch_to_proto,
    request_from_proto,
    response_to_proto,
    stats_to_proto,
)
from baton.services.worker.metrics import WorkerMetrics
from baton.services.worker.scheduler_link import SchedulerGone, SchedulerLink
from baton.services.worker.tracing import StreamTrace, emit_late

if TYPE_CHECKING:
    from baton.services.otel import Tracing

log = logging.getLogger("baton.worker")

ROLES = ("prefill", "decode", "both")

MAX_PROMPT_TOKENS = 1 << 20
SWITCH_DRAIN_TIMEOUT_S = 60.0  # a role change waits this long for requests to end by default
MIGRATE_ANSWER_S = 1.5  # the scheduler's answer to a Migrate, inside the router's 2 s deadline
CONNECT_ANSWER_S = 4.5  # the scheduler's answer to a Connect, inside the router's 5 s deadline


def merge_outputs(earlier: TokenOut, later: TokenOut) -> TokenOut:
    """Two consecutive outputs of one request as one message: the tokens and logprobs of
    both in order; the later one's counts, finish and timings."""
    later.token_ids = earlier.token_ids + later.token_ids
    later.logprobs = earlier.logprobs + later.logprobs
    later.prompt_logprobs = earlier.prompt_logprobs + later.prompt_logprobs
    return later


class WorkerService(pb_grpc.WorkerServicer):
    def __init__(
        self,
        link: SchedulerLink,
        role: str,
        vocab_size: int,
        metrics: WorkerMetrics,
        stream_interval: int = 1,
        tracing: Tracing | None = None,
    ) -> None:
        self.link = link
        self.role = role
        self.vocab_size = vocab_size
        self.metrics = metrics
        self.stream_interval = stream_interval
        self.tracing = tracing  # None: off
        self.traces: dict[str, StreamTrace] = {}  # of the open streams, while tracing
        if tracing is not None:
            link.on_spans = self._recorded
        self.draining = False
        self.idle = asyncio.Event()
        self.idle.set()
        # Called with the scheduler's answer once the role changed (registers it again).
        self.on_role_changed: Callable[[SwitchRoleOut], Awaitable[None]] | None = None
        self.switching = False  # a role change is under way: new requests are refused

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        if self.draining or self.switching or self.link.lost is not None:
            why = self.link.lost or ("worker is changing role" if self.switching else "draining")
            await context.abort(grpc.StatusCode.UNAVAILABLE, why)
        received = time.monotonic()
        rid = request.request_id
        error = self._validate(request)
        if error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, error)
        try:
            message = request_from_proto(request)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        message.received_at = received
        try:
            queue = self.link.open(rid)
        except KeyError:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request {rid!r} is running")
        self.idle.clear()
        start = time.monotonic()
        trace = (
            StreamTrace(self.tracing, context, request, self.role, received)
            if self.tracing
            else None
        )
        if trace is not None:
            message.traceparent = trace.traceparent  # the scheduler records under it
            self.traces[rid] = trace
        finished = False
        self.metrics.requests_running.inc()
        try:
            try:
                await self.link.send(message)
            except SchedulerGone as e:
                finished = True  # nothing to abort
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
            held: TokenOut | None = None  # tokens waiting for the stream interval
            sent = False
            while not finished:
                out = await queue.get()
                if held is not None:
                    out, held = merge_outputs(held, out), None
                finished = out.finished
                if not finished and sent and len(out.token_ids) < self.stream_interval:
                    held = out  # the first message and the last never wait
                    continue
                if out.finished:
                    self.metrics.observe_finish(out, time.monotonic() - start)
                    if self.link.kv_events is not None:
                        self.link.kv_events.note_found(out.cached_tokens)
                sent = sent or bool(out.token_ids)
                if trace is not None:
                    trace.sent(out)
                yield response_to_proto(out)
        finally:
            self.metrics.requests_running.dec()
            if not finished:  # the client went away or cancelled: free what it held
                with contextlib.suppress(Exception):
                    await self.link.send(AbortReq(rid))
                self.metrics.aborts.inc()
            if trace is not None:
                del self.traces[rid]
                trace.end()
            self.link.close_stream(rid)
            if not self.link.streams:
                self.idle.set()

    def _recorded(self, spans: SpansOut) -> None:
        """The scheduler's records of a traced request: its stream's, or (P's transfer,
        after the stream ended) sent on their own."""
        assert self.tracing is not None
        trace = self.traces.get(spans.rid)
        if trace is not None:
            trace.recorded(spans.spans)
        else:
            emit_late(self.tracing, spans)

    def _validate(self, request: pb.GenerateRequest) -> str:
        if not request.request_id:
            return "request_id is required"
        if not request.input_ids:
            return "input_ids is empty"
        if len(request.input_ids) > MAX_PROMPT_TOKENS:
            return f"input_ids has more than {MAX_PROMPT_TOKENS} tokens"
        if error := out_of_vocab(request.input_ids, self.vocab_size):
            return f"input_ids: {error}"
        if error := out_of_vocab(request.sampling.logit_bias, self.vocab_size):
            return f"logit_bias: {error}"
        if request.sampling.output_offset > len(request.input_ids):
            return "sampling.output_offset exceeds the number of input_ids"
        if self.role == "prefill" and not request.room:  # (D computes one without: local)
            return "a prefill worker needs a room (disaggregated request)"
        return ""

    async def Abort(
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        with contextlib.suppress(SchedulerGone):  # gone: it holds nothing any more
            await self.link.send(AbortReq(request.request_id))
        return pb.AbortResponse()

    async def Migrate(
        self, request: pb.MigrateRequest, context: grpc.aio.ServicerContext
    ) -> pb.MigrateResponse:
        """Hand a running request off to another decode worker (live migration)."""
        if self.role != "decode":
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"live migration needs a decode worker, not {self.role}",
            )
        if not request.room or not request.peer.kv_control_address:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a room and a peer are needed")
        if request.request_id not in self.link.streams:
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"request {request.request_id!r} is not running here"
            )
        peer = PeerInfo(request.peer.worker_id, request.peer.kv_control_address)
        try:
            out = await self.link.migrate(
                MigrateReq(request.request_id, request.room, peer, request.precopy_tokens),
                MIGRATE_ANSWER_S,
            )
        except SchedulerGone as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        if out.refused:  # the router falls back (recompute) now, not after its move timeout
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, out.refused)
        return pb.MigrateResponse()

    async def Connect(
        self, request: pb.ConnectRequest, context: grpc.aio.ServicerContext
    ) -> pb.ConnectResponse:
        """Open the KV data connections to decode worker `request.peer` now, ahead of live
        migrations to it, so that their hand-offs wait for no handshake; answers once they
        are open."""
        if self.role != "decode":
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"live migration needs a decode worker, not {self.role}",
            )
        if not request.peer.transfer_address:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the peer's transfer address")
        peer = PeerInfo(
            request.peer.worker_id,
            request.peer.kv_control_address,
            request.peer.transfer_address,
        )
        try:
            out = await self.link.connect(ConnectReq(peer), CONNECT_ANSWER_S)
        except SchedulerGone as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        if out.error:
            await context.abort(grpc.StatusCode.UNAVAILABLE, out.error)
        return pb.ConnectResponse()

    async def Health(
        self, request: pb.HealthRequest, context: grpc.aio.ServicerContext
    ) -> pb.HealthResponse:
        ok = not self.draining and self.link.lost is None
        status = "serving" if ok else "draining" if self.link.lost is None else "scheduler lost"
        if ok and self.switching:
            status = "switching"
        return pb.HealthResponse(ok=ok, role=self.role, status=status)

    async def FlushCache(
        self, request: pb.FlushCacheRequest, context: grpc.aio.ServicerContext
    ) -> pb.FlushCacheResponse:
        out = await self.link.flush_cache(timeout=5.0)
        return pb.FlushCacheResponse(flushed=out.flushed, message=out.message)

    async def SetRole(
        self, request: pb.SetRoleRequest, context: grpc.aio.ServicerContext
    ) -> pb.SetRoleResponse:
        """Change role in place: refuse new requests, wait for the open streams and then
        the scheduler's rooms to end (bounded), swap the scheduler's role, register again."""
        if request.role not in ROLES:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"no role {request.role!r}")
        if self.switching or self.draining or self.link.lost is not None:
            await context.abort(grpc.StatusCode.ABORTED, "the worker is changing or stopping")
        previous = self.role
        if request.role == previous:
            return pb.SetRoleResponse(role=previous, previous_role=previous)
        timeout = request.drain_timeout_seconds or SWITCH_DRAIN_TIMEOUT_S
        self.switching = True
        started = time.monotonic()
        try:
            log.info(
                "changing role %s -> %s: draining %d streams",
                previous,
                request.role,
                len(self.link.streams),
            )
            try:
                await asyncio.wait_for(self.idle.wait(), timeout)
            except TimeoutError:
                await context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"{len(self.link.streams)} requests still ran after {timeout:g}s",
                )
            left = max(0.0, timeout - (time.monotonic() - started))
            out = await self.link.switch_role(request.role, previous, left)
            if out.error:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, out.error)
            self.role = out.role
            self.metrics.info.remove(previous)
            self.metrics.info.labels(role=out.role).set(1)
            if self.on_role_changed is not None:
                await self.on_role_changed(out)
        finally:
            self.switching = False
        log.info("role changed %s -> %s in %.2fs", previous, out.role, time.monotonic() - started)
        return pb.SetRoleResponse(
            role=out.role,
            previous_role=previous,
            kv_control_address=out.kv_control_address,
            transfer_address=out.transfer_address,
        )

    async def Stats(
        self, request: pb.StatsRequest, context: grpc.aio.ServicerContext
    ) -> pb.StatsResponse:
        s = self.link.stats
        return pb.StatsResponse() if s is None else stats_to_proto(s)

    async def SubscribeKVEvents(
        self, request: pb.KVEventsRequest, context: grpc.aio.ServicerContext
    ):
        publisher = self.link.kv_events
        if publisher is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "KV events are off")
            return
        async for batch in publisher.subscribe(request.incarnation, request.from_seq):
            yield kv_batch_to_proto(batch)
