"""Clients of the bootstrap service.

`WorkerRegistration` keeps one worker registered: it registers, heartbeats with the current
load, registers again whenever the bootstrap no longer knows it (restart, lapsed lease),
rides out bootstrap outages, and deregisters on stop().

`MembershipWatcher` keeps a local view of the cluster through the Watch stream. When the
stream breaks it reconnects with backoff and replaces its view with the fresh snapshot,
telling `on_change` what differs; until then the last known view stays readable.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable
from types import TracebackType

import grpc
import grpc.aio

from baton.common.rpc import baton_pb2 as pb
from baton.common.rpc import baton_pb2_grpc as pb_grpc
from baton.common.rpc.auth import make_channel

log = logging.getLogger(__name__)

# Codes with which the bootstrap refuses a registration; retrying unchanged will not help.
_REFUSED = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT)


class RegistrationRefused(RuntimeError):
    """The bootstrap refused this worker (e.g. a KV layout its peers cannot use)."""


class _Backoff:
    def __init__(self, initial: float = 0.1, maximum: float = 2.0) -> None:
        self._initial, self._maximum = initial, maximum
        self._delay = initial

    def next(self) -> float:
        delay, self._delay = self._delay, min(self._delay * 2, self._maximum)
        return delay * random.uniform(0.8, 1.2)  # jitter: restarted peers don't stampede

    def reset(self) -> None:
        self._delay = self._initial


class WorkerRegistration:
    """Registers `info` with the bootstrap at `bootstrap_address` and keeps it registered.

    Heartbeats go out every `heartbeat_interval` seconds, or a third of the lease ttl the
    bootstrap grants if that is shorter; each carries `load_fn()` when given. A refusal
    (FAILED_PRECONDITION / INVALID_ARGUMENT) is logged, raised from `wait_registered()`, and
    retried on the heartbeat cadence in case the conflicting peer goes away.
    """

    def __init__(
        self,
        bootstrap_address: str,
        token: str | None,
        info: pb.WorkerInfo,
        heartbeat_interval: float = 1.0,
        load_fn: Callable[[], pb.Load] | None = None,
    ) -> None:
        if heartbeat_interval <= 0:
            raise ValueError(f"heartbeat_interval must be > 0, got {heartbeat_interval}")
        self._address = bootstrap_address
        self._token = token
        self._info = info
        self._configured_interval = heartbeat_interval
        self._interval = heartbeat_interval
        self._load_fn = load_fn
        self.lease_id: str | None = None
        self.refusal: str | None = None
        self._settled = asyncio.Event()  # set while registered or refused
        self._bootstrap_down = False
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.BootstrapStub | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def worker_id(self) -> str:
        return self._info.worker_id

    async def start(self) -> None:
        if self._task is not None:
            return
        self._channel = make_channel(self._address, self._token)
        self._stub = pb_grpc.BootstrapStub(self._channel)
        self._task = asyncio.create_task(self._run(), name=f"registration-{self.worker_id}")

    async def wait_registered(self, timeout: float | None = None) -> str:
        """The lease id once registered. Raises RegistrationRefused if the bootstrap refused
        this worker, TimeoutError if neither happened within `timeout` seconds."""
        await asyncio.wait_for(self._settled.wait(), timeout)
        if self.lease_id is None:
            raise RegistrationRefused(self.refusal or "registration refused")
        return self.lease_id

    async def stop(self) -> None:
        """Stop heartbeating and deregister (best effort: the lease lapses anyway)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self.lease_id is not None and self._stub is not None:
            request = pb.DeregisterRequest(lease_id=self.lease_id, worker_id=self.worker_id)
            try:
                await self._stub.Deregister(request, timeout=1.0)
            except grpc.aio.AioRpcError as e:
                log.warning("deregister %s: %s", self.worker_id, e.details())
            self.lease_id = None
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stub = None

    async def __aenter__(self) -> WorkerRegistration:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    # -- the loop ---------------------------------------------------------------------------

    async def _run(self) -> None:
        backoff = _Backoff(maximum=self._configured_interval)
        while True:
            if self.lease_id is None and not await self._register():
                await asyncio.sleep(backoff.next())
                continue
            backoff.reset()
            await asyncio.sleep(self._interval)
            await self._heartbeat()

    async def _register(self) -> bool:
        assert self._stub is not None
        info = pb.WorkerInfo()
        info.CopyFrom(self._info)
        load = self._current_load()
        if load is not None:
            info.load.CopyFrom(load)
        try:
            response = await self._stub.Register(
                pb.RegisterRequest(worker=info), timeout=self._rpc_timeout
            )
        except grpc.aio.AioRpcError as e:
            if e.code() in _REFUSED:
                if self.refusal != e.details():
                    log.error("bootstrap refused worker %s: %s", self.worker_id, e.details())
                self.refusal = e.details()
                self._settled.set()
            else:
                self._note_unreachable(e)
            return False
        self._note_reachable()
        self.lease_id = response.lease_id
        self.refusal = None
        if response.lease_ttl_seconds > 0:
            self._interval = min(self._configured_interval, response.lease_ttl_seconds / 3)
        self._settled.set()
        log.info("registered worker %s with bootstrap %s", self.worker_id, self._address)
        return True

    async def _heartbeat(self) -> None:
        assert self._stub is not None and self.lease_id is not None
        request = pb.HeartbeatRequest(lease_id=self.lease_id, worker_id=self.worker_id)
        load = self._current_load()
        if load is not None:
            request.load.CopyFrom(load)
        try:
            response = await self._stub.Heartbeat(request, timeout=self._rpc_timeout)
        except grpc.aio.AioRpcError as e:
            self._note_unreachable(e)
            return
        self._note_reachable()
        if not response.known:
            # The bootstrap restarted (soft state) or our lease lapsed: register again now.
            log.info("bootstrap no longer knows worker %s; registering again", self.worker_id)
            self.lease_id = None
            self._settled.clear()

    @property
    def _rpc_timeout(self) -> float:
        return max(1.0, self._interval)

    def _current_load(self) -> pb.Load | None:
        if self._load_fn is None:
            return None
        try:
            return self._load_fn()
        except Exception:
            log.exception("load_fn failed; heartbeat sent without load")
            return None

    def _note_unreachable(self, error: grpc.aio.AioRpcError) -> None:
        if not self._bootstrap_down:
            log.warning(
                "bootstrap %s unreachable (%s: %s); retrying",
                self._address,
                error.code().name,
                error.details(),
            )
        self._bootstrap_down = True

    def _note_reachable(self) -> None:
        if self._bootstrap_down:
            log.info("bootstrap %s reachable again", self._address)
        self._bootstrap_down = False


class MembershipWatcher:
    """A live view of the cluster's members, kept current through the Watch stream.

    `on_change(event)` is called for every ADDED / UPDATED / REMOVED change to the view,
    including those found by comparing a fresh snapshot after a reconnect. It runs on the
    event loop and must not block.
    """

    def __init__(
        self,
        bootstrap_address: str,
        token: str | None,
        on_change: Callable[[pb.MembershipEvent], None] | None = None,
        max_backoff: float = 2.0,
    ) -> None:
        self._address = bootstrap_address
        self._token = token
        self._on_change = on_change
        self._backoff = _Backoff(maximum=max_backoff)
        self._view: dict[str, pb.WorkerInfo] = {}
        self._synced = asyncio.Event()  # set while the view reflects a live stream
        self._channel: grpc.aio.Channel | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def connected(self) -> bool:
        return self._synced.is_set()

    def members(self, role: int | None = None) -> list[pb.WorkerInfo]:
        """Known members (all roles when `role` is None or ROLE_UNSPECIFIED), by worker_id.
        While disconnected this is the last view received."""
        return [w for _, w in sorted(self._view.items()) if not role or w.role == role]

    def get(self, worker_id: str) -> pb.WorkerInfo | None:
        return self._view.get(worker_id)

    async def start(self) -> None:
        if self._task is not None:
            return
        self._channel = make_channel(self._address, self._token)
        self._task = asyncio.create_task(self._run(), name="membership-watcher")

    async def wait_synced(self, timeout: float | None = None) -> None:
        """Wait until the view reflects a live stream (TimeoutError after `timeout` s)."""
        await asyncio.wait_for(self._synced.wait(), timeout)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
        self._synced.clear()

    async def __aenter__(self) -> MembershipWatcher:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    # -- the loop ---------------------------------------------------------------------------

    async def _run(self) -> None:
        assert self._channel is not None
        stub = pb_grpc.BootstrapStub(self._channel)
        while True:
            try:
                await self._follow(stub.Watch(pb.WatchRequest()))
                reason = "stream ended"
            except grpc.aio.AioRpcError as e:
                reason = f"{e.code().name}: {e.details()}"
            except Exception as e:  # never let one bad event end the watch for good
                log.exception("membership watch failed")
                reason = repr(e)
            if self._synced.is_set():
                log.warning("membership watch of %s lost (%s); reconnecting", self._address, reason)
            self._synced.clear()
            await asyncio.sleep(self._backoff.next())

    async def _follow(self, call: grpc.aio.UnaryStreamCall) -> None:
        snapshot: dict[str, pb.WorkerInfo] = {}
        in_snapshot = True
        async for event in call:
            if event.type == pb.MembershipEvent.SYNCED:
                self._replace_view(snapshot)
                in_snapshot = False
                self._backoff.reset()
                self._synced.set()
            elif in_snapshot:
                _apply(snapshot, event)
            else:
                _apply(self._view, event)
                self._notify(event)

    def _replace_view(self, fresh: dict[str, pb.WorkerInfo]) -> None:
        old, self._view = self._view, fresh
        for worker_id, info in old.items():
            if worker_id not in fresh:
                self._notify(pb.MembershipEvent(type=pb.MembershipEvent.REMOVED, worker=info))
        for worker_id, info in fresh.items():
            previous = old.get(worker_id)
            if previous is None:
                self._notify(pb.MembershipEvent(type=pb.MembershipEvent.ADDED, worker=info))
            elif previous != info:
                self._notify(pb.MembershipEvent(type=pb.MembershipEvent.UPDATED, worker=info))

    def _notify(self, event: pb.MembershipEvent) -> None:
        if self._on_change is None:
            return
        try:
            self._on_change(event)
        except Exception:
            log.exception("membership on_change callback failed")


def _apply(view: dict[str, pb.WorkerInfo], event: pb.MembershipEvent) -> None:
    if event.type == pb.MembershipEvent.REMOVED:
        view.pop(event.worker.worker_id, None)
    elif event.type in (pb.MembershipEvent.ADDED, pb.MembershipEvent.UPDATED):
        view[event.worker.worker_id] = event.worker
