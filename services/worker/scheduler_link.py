"""The frontend's end of the ZMQ link to the scheduler process (`SchedulerLink`).

It sends requests and control messages (flush, migrate, role change) to the scheduler and
routes what comes back: each request's outputs to its stream's queue, stats, spans, KV
events, and the answers to control messages to whoever waits for them.

Nothing here waits on a scheduler that is gone: sends never block (no peer on the PUSH
socket means the scheduler process ended), and once the scheduler is lost every open
stream ends with an error at once, so that the router moves its requests elsewhere.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio

from baton.common.protocol import (
    ConnectOut,
    ConnectReq,
    FlushCacheOut,
    FlushCacheReq,
    KVEventsOut,
    MigrateOut,
    MigrateReq,
    OutputBatch,
    ReadyOut,
    SpansOut,
    StatsOut,
    SwitchRoleOut,
    SwitchRoleReq,
    TokenOut,
    decode_from_scheduler,
    encode,
)
from baton.common.ratelog import RateLimitedLog
from baton.services.worker.kv_publisher import KVEventPublisher
from baton.services.worker.metrics import WorkerMetrics

log = logging.getLogger("baton.worker")
GC_WARN_S = 0.05  # a collection this long in the scheduler process is logged

SWITCH_MARGIN_S = 30.0  # past the drain: the new role's KV manager starting


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
        self._connecting: dict[str, asyncio.Future[ConnectOut]] = {}  # by transfer address
        self._flush_lock = asyncio.Lock()
        self.lost: str | None = None  # why the scheduler is gone, once it is
        self.on_spans: Callable[[SpansOut], None] | None = None  # tracing on: its records
        self._rate_log = RateLimitedLog(log)
        self._task = asyncio.create_task(self._route())

    async def _route(self) -> None:
        while True:
            raw = await self.pull.recv()
            try:
                msg = decode_from_scheduler(raw)
            except msgspec.DecodeError as e:
                self.metrics.dropped_messages.inc()
                self._rate_log.warning("dropped a malformed message from the scheduler: %s", e)
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
                for generation, seconds in msg.gc_pauses:
                    if seconds >= GC_WARN_S:
                        self._rate_log.warning(
                            "a garbage collection (generation %d) stopped the scheduler for "
                            "%.0f ms: every running stream waited",
                            generation,
                            seconds * 1e3,
                        )
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
            elif isinstance(msg, ConnectOut):
                connecting = self._connecting.pop(msg.transfer_address, None)
                if connecting is not None and not connecting.done():
                    connecting.set_result(msg)
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

    async def connect(self, msg: ConnectReq, timeout: float) -> ConnectOut:
        """Ask the scheduler to open its KV data connections to `msg.peer`; its answer, once
        they are open or failed (asks for one address while one is open share its answer).
        SchedulerGone at once if the scheduler is not there."""
        address = msg.peer.transfer_address
        answer = self._connecting.get(address)
        if answer is None:
            # registered before the ask goes: its answer finds it whenever it comes
            answer = self._connecting[address] = asyncio.get_running_loop().create_future()
            try:
                await self.send(msg)
            except BaseException:  # the scheduler is gone, or the caller cancelled
                del self._connecting[address]
                raise
        try:
            return await asyncio.wait_for(asyncio.shield(answer), timeout)
        except TimeoutError:
            return ConnectOut(address, "the scheduler did not answer in time")

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
