"""The worker's gRPC frontend: Worker service over the scheduler process.

Generate sends the request to the scheduler over ZMQ and streams token ids back as the
scheduler produces them. A cancelled stream or an Abort call aborts the request in the
scheduler, which frees everything it held. While draining (SIGTERM), new requests are
refused with UNAVAILABLE and running ones finish. SetRole changes the worker's role in place
the same way: new requests are refused while the open streams end and then the scheduler's
rooms (bounded), the scheduler swaps its role, and `on_role_changed` registers it again.

Nothing here waits on a scheduler that is gone: sends never block (no peer on the PUSH
socket means the scheduler process ended), and once the scheduler is lost every open
stream ends with an error at once, so that the router moves its requests elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import grpc
import msgspec
import zmq
import zmq.asyncio

from baton.common.protocol import (
    AbortReq,
    FlushCacheOut,
    FlushCacheReq,
    KVEventsOut,
    MigrateOut,
    MigrateReq,
    OutputBatch,
    PeerInfo,
    ReadyOut,
    SpansOut,
    StatsOut,
    SwitchRoleOut,
    SwitchRoleReq,
    TokenOut,
    decode_from_scheduler,
    encode,
    out_of_vocab,
)
from baton.common.ratelog import RateLimitedLog
from baton.common.rpc import baton_pb2 as pb
from baton.common.rpc import baton_pb2_grpc as pb_grpc
from baton.common.rpc.convert import (
    kv_batch_to_proto,
    request_from_proto,
    response_to_proto,
    stats_to_proto,
)
from baton.services.worker.kv_publisher import KVEventPublisher
from baton.services.worker.metrics import WorkerMetrics
from baton.services.worker.tracing import StreamTrace, emit_late

if TYPE_CHECKING:
    from baton.services.otel import Tracing

log = logging.getLogger("baton.worker")

ROLES = ("prefill", "decode", "both")

MAX_PROMPT_TOKENS = 1 << 20
SWITCH_DRAIN_TIMEOUT_S = 60.0  # a role change waits this long for requests to end by default
SWITCH_MARGIN_S = 30.0  # past the drain: the new role's KV manager starting
MIGRATE_ANSWER_S = 1.5  # the scheduler's answer to a Migrate, inside the router's 2 s deadline


def merge_outputs(earlier: TokenOut, later: TokenOut) -> TokenOut:
    """Two consecutive outputs of one request as one message: the tokens and logprobs of
    both in order; the later one's counts, finish and timings."""
    later.token_ids = earlier.token_ids + later.token_ids
    later.logprobs = earlier.logprobs + later.logprobs
    later.prompt_logprobs = earlier.prompt_logprobs + later.prompt_logprobs
    return later


class SchedulerGone(ConnectionError):
    """The scheduler process is not there to take a message."""


class SchedulerLink:
    """The frontend's end of the ZMQ link: sends requests, routes outputs per request."""

    def __init__(
        self,
        to_scheduler: str,
        from_scheduler: str,
        metrics: WorkerMetrics,
        kv_events: KVEventPublisher | None = None,
    ) -> None:
        self.kv_events = kv_events  # None: the scheduler sends none (--kv-events off)
        self.ctx = zmq.asyncio.Context()
        self.push = self.ctx.socket(zmq.PUSH)
        # No high-water mark: a send fails (zmq.Again) only when no scheduler is connected.
        self.push.setsockopt(zmq.SNDHWM, 0)
        self.push.bind(to_scheduler)
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.bind(from_scheduler)
        self.streams: dict[str, asyncio.Queue[TokenOut]] = {}
        self.stats: StatsOut | None = None
        self.ready: asyncio.Future[ReadyOut] = asyncio.get_running_loop().create_future()
        self.metrics = metrics
        self._flushed: asyncio.Future[FlushCacheOut] | None = None
        self._switched: asyncio.Future[SwitchRoleOut] | None = None
        self._migrating: dict[int, asyncio.Future[MigrateOut]] = {}  # by room
        self._flush_lock = asyncio.Lock()
        self.lost: str | None = None  # why the scheduler is gone, once it is
        self.on_spans: Callable[[SpansOut], None] | None = None  # tracing on: its records
        self._dropped_log = RateLimitedLog(log)
        self._task = asyncio.create_task(self._route())

    async def _route(self) -> None:
        while True:
            raw = await self.pull.recv()
            try:
                msg = decode_from_scheduler(raw)
            except msgspec.DecodeError as e:
                self.metrics.dropped_messages.inc()
                self._dropped_log.warning("dropped a malformed message from the scheduler: %s", e)
                continue
            if isinstance(msg, OutputBatch):
                if self.on_spans is not None:
                    for spans in msg.spans:  # before the items: a finish ends its stream
                        self.on_spans(spans)
                for item in msg.items:
                    q = self.streams.get(item.rid)
                    if q is not None:
                        q.put_nowait(item)
            elif isinstance(msg, StatsOut):
                self.stats = msg
                self.metrics.observe_stats(msg)
            elif isinstance(msg, ReadyOut) and not self.ready.done():
                self.ready.set_result(msg)
            elif isinstance(msg, FlushCacheOut) and self._flushed and not self._flushed.done():
                self._flushed.set_result(msg)
            elif isinstance(msg, SwitchRoleOut) and self._switched and not self._switched.done():
                self._switched.set_result(msg)
            elif isinstance(msg, MigrateOut):
                migrating = self._migrating.get(msg.room)
                if migrating is not None and not migrating.done():
                    migrating.set_result(msg)
            elif isinstance(msg, KVEventsOut) and self.kv_events is not None:
                self.kv_events.publish(msg)

    async def send(self, msg: msgspec.Struct) -> None:
        """Hand `msg` to the scheduler; raises SchedulerGone at once if it is not there."""
        if self.lost is not None:
            raise SchedulerGone(self.lost)
        try:
            await self.push.send(encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            raise SchedulerGone("the scheduler process is not connected") from None

    def scheduler_lost(self, reason: str) -> None:
        """The scheduler process ended: every open stream ends now with `reason`."""
        self.lost = reason
        for rid, queue in self.streams.items():
            queue.put_nowait(TokenOut(rid, [], finished=True, finish_reason="error", error=reason))
        if self.kv_events is not None:
            self.kv_events.close()  # the cache is gone: the router must stop trusting it

    async def flush_cache(self, timeout: float) -> FlushCacheOut:
        """Ask the scheduler to empty its prefix cache; one request at a time."""
        async with self._flush_lock:
            self._flushed = asyncio.get_running_loop().create_future()
            try:
                await self.send(FlushCacheReq())
                return await asyncio.wait_for(self._flushed, timeout)
            except SchedulerGone as e:
                return FlushCacheOut(False, str(e))
            except TimeoutError:
                return FlushCacheOut(False, "the scheduler did not answer in time")
            finally:
                self._flushed = None

    async def migrate(self, msg: MigrateReq, timeout: float) -> MigrateOut:
        """Ask the scheduler to hand `msg.rid` off; its answer says whether it took it.
        SchedulerGone at once if the scheduler is not there."""
        answer = asyncio.get_running_loop().create_future()
        self._migrating[msg.room] = answer
        try:
            await self.send(msg)
            return await asyncio.wait_for(answer, timeout)
        except TimeoutError:
            return MigrateOut(msg.room, "the scheduler did not answer in time")
        finally:
            self._migrating.pop(msg.room, None)

    async def switch_role(self, role: str, current: str, timeout: float) -> SwitchRoleOut:
        """Ask the scheduler to change its role once it holds nothing (waiting at most
        `timeout` seconds for that); the caller allows one change at a time."""
        self._switched = asyncio.get_running_loop().create_future()
        try:
            await self.send(SwitchRoleReq(role, timeout))
            # The scheduler answers by `timeout` itself; the margin covers starting the role.
            return await asyncio.wait_for(self._switched, timeout + SWITCH_MARGIN_S)
        except SchedulerGone as e:
            return SwitchRoleOut(current, error=str(e))
        except TimeoutError:
            return SwitchRoleOut(current, error="the scheduler did not answer in time")
        finally:
            self._switched = None

    def open(self, rid: str) -> asyncio.Queue[TokenOut]:
        if rid in self.streams:
            raise KeyError(rid)
        q: asyncio.Queue[TokenOut] = asyncio.Queue()
        self.streams[rid] = q
        return q

    def close_stream(self, rid: str) -> None:
        self.streams.pop(rid, None)

    def close(self) -> None:
        self._task.cancel()
        self.push.close(linger=0)
        self.pull.close(linger=0)
        self.ctx.term()


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

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):  # type: ignore[no-untyped-def]
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
        trace = StreamTrace(self.tracing, context, request, self.role) if self.tracing else None
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

    async def SubscribeKVEvents(  # type: ignore[no-untyped-def]
        self, request: pb.KVEventsRequest, context: grpc.aio.ServicerContext
    ):
        publisher = self.link.kv_events
        if publisher is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "KV events are off")
            return
        async for batch in publisher.subscribe(request.incarnation, request.from_seq):
            yield kv_batch_to_proto(batch)
