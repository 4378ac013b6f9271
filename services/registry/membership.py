"""A worker's loop over any store (`base.Registry`), and what both registry loops share.

`WorkerRegistration` keeps one worker registered: it registers, renews its lease and
publishes its load, registers again whenever the store no longer knows it (a lapsed lease, a
restarted bootstrap), rides out outages, and deregisters on stop(). The other loop, the
cluster's view, is `watcher.MembershipWatcher`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable
from types import TracebackType
from typing import Self

from baton.common.rpc import baton_pb2 as pb
from baton.services.registry.base import (
    Lease,
    RegistrationRefused,
    Registry,
    RegistryUnavailable,
)

log = logging.getLogger(__name__)


async def cancel_and_wait(task: asyncio.Task[None], retry: float = 1.0) -> None:
    """Cancel `task` and wait until it has ended. Cancels again every `retry` seconds:
    Python < 3.12's `asyncio.wait_for` loses a cancellation that arrives as its inner
    future completes, and the task would otherwise run on."""
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=retry)
    with contextlib.suppress(asyncio.CancelledError):
        task.result()


class RegistryLoop:
    """A loop that talks to the registry, run by `async with` (start, then stop)."""

    async def start(self) -> None:
        raise NotImplementedError

    async def stop(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()


class Backoff:
    def __init__(self, initial: float = 0.1, maximum: float = 2.0) -> None:
        self._initial, self._maximum = initial, maximum
        self._delay = initial

    def next(self) -> float:
        delay, self._delay = self._delay, min(self._delay * 2, self._maximum)
        return delay * random.uniform(0.8, 1.2)  # jitter: restarted peers don't stampede

    def reset(self) -> None:
        self._delay = self._initial


class WorkerRegistration(RegistryLoop):
    """Registers `info` with `registry` and keeps it registered.

    The lease is renewed every `heartbeat_interval` seconds, or a third of the lease ttl the
    store grants if that is shorter; when `load_fn()` reports a load that differs from the
    one last published, the renewal publishes it. A refusal is logged, raised from
    `wait_registered()`, and retried on the heartbeat cadence in case the conflicting peer
    goes away. The registry stays open after stop(): its owner closes it.
    """

    def __init__(
        self,
        registry: Registry,
        info: pb.WorkerInfo,
        heartbeat_interval: float = 1.0,
        load_fn: Callable[[], pb.Load] | None = None,
    ) -> None:
        if heartbeat_interval <= 0:
            raise ValueError(f"heartbeat_interval must be > 0, got {heartbeat_interval}")
        self._registry = registry
        self._info = info
        self._configured_interval = heartbeat_interval
        self._interval = heartbeat_interval
        self._load_fn = load_fn
        self._published_load: pb.Load | None = None
        self.lease: Lease | None = None
        self.refusal: str | None = None
        self._settled = asyncio.Event()  # set while registered or refused
        self._stopping = asyncio.Event()
        self._unreachable = False
        self._task: asyncio.Task[None] | None = None
        self._calls = asyncio.Lock()  # one call to the store at a time: republish vs. the loop

    @property
    def worker_id(self) -> str:
        return self._info.worker_id

    @property
    def registry(self) -> Registry:
        return self._registry

    @property
    def registered(self) -> bool:
        """Registered, and the store answered the last renewal."""
        return self.lease is not None and not self._unreachable

    async def start(self) -> None:
        if self._task is None:
            self._stopping.clear()
            self._task = asyncio.create_task(self._run(), name=f"registration-{self.worker_id}")

    async def wait_registered(self, timeout: float | None = None) -> Lease:
        """The lease once registered. Raises RegistrationRefused if the store refused this
        worker, TimeoutError if neither happened within `timeout` seconds."""
        await asyncio.wait_for(self._settled.wait(), timeout)
        if self.lease is None:
            raise RegistrationRefused(self.refusal or "registration refused")
        return self.lease

    @property
    def info(self) -> pb.WorkerInfo:
        """What this worker publishes (without its load)."""
        return self._info

    async def republish(self, info: pb.WorkerInfo) -> None:
        """Publish `info` (the same worker_id) in place of what was registered: a worker
        that changed role registers again under a new lease at once, and gives the old one
        back, so the cluster sees the change now rather than at the next lapse. While not
        registered, the loop registers `info` when it can."""
        if info.worker_id != self._info.worker_id:
            raise ValueError("republish keeps the worker_id")
        async with self._calls:
            self._info = info
            old = self.lease
            if old is None:
                return
            self.lease = None
            self._settled.clear()
            if not await self._register_unlocked() or self.lease is None:
                return
            if self.lease.id != old.id:
                try:
                    await self._registry.deregister(old)  # the record stays: a new lease holds it
                except RegistryUnavailable as e:
                    log.warning("giving back the old lease of %s: %s", self.worker_id, e)

    async def stop(self, timeout: float = 10.0) -> None:
        """Stop renewing and deregister (best effort: the lease lapses anyway). A call to the
        store in flight is let finish first (for up to `timeout` seconds), so a registration
        it completes is deregistered too."""
        if self._task is not None:
            self._stopping.set()
            await asyncio.wait({self._task}, timeout=timeout)
            await cancel_and_wait(self._task)
            self._task = None
        if self.lease is not None:
            try:
                await self._registry.deregister(self.lease)
            except RegistryUnavailable as e:
                log.warning("deregister %s: %s", self.worker_id, e)
            self.lease = None

    # -- the loop ---------------------------------------------------------------------------

    async def _run(self) -> None:
        backoff = Backoff(maximum=self._configured_interval)
        while not self._stopping.is_set():
            try:
                if self.lease is None and not await self._register():
                    await self._pause(backoff.next())
                    continue
                backoff.reset()
                await self._pause(self._interval)
                if not self._stopping.is_set():
                    await self._renew()
            except Exception:  # a bug must not end the registration for good
                log.exception("registration of worker %s failed; retrying", self.worker_id)
                await self._pause(self._configured_interval)

    async def _pause(self, seconds: float) -> None:
        """Sleep, waking early when stop() is called."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), seconds)

    async def _register(self) -> bool:
        async with self._calls:
            if self.lease is not None:  # republish registered meanwhile
                return True
            return await self._register_unlocked()

    async def _register_unlocked(self) -> bool:
        info = self._with_load(self._current_load())
        try:
            lease = await self._registry.register(info)
        except RegistrationRefused as e:
            if self.refusal != str(e):
                log.error("registry refused worker %s: %s", self.worker_id, e)
            self.refusal = str(e)
            self._settled.set()
            return False
        except RegistryUnavailable as e:
            self._note_unreachable(e)
            return False
        self._note_reachable()
        self.lease, self.refusal = lease, None
        self._published_load = info.load
        if lease.ttl > 0:
            self._interval = min(self._configured_interval, lease.ttl / 3)
        self._settled.set()
        log.info("registered worker %s with %s", self.worker_id, self._registry.address)
        return True

    async def _renew(self) -> None:
        async with self._calls:
            if self.lease is not None:  # republish may have just replaced it
                await self._renew_unlocked()

    async def _renew_unlocked(self) -> None:
        assert self.lease is not None
        load = self._current_load()
        try:
            if load is not None and load != self._published_load:
                known = await self._registry.update(self.lease, self._with_load(load))
                if known:
                    self._published_load = load
            else:
                known = await self._registry.keepalive(self.lease)
        except RegistryUnavailable as e:
            self._note_unreachable(e)
            return
        self._note_reachable()
        if not known:
            log.info(
                "%s no longer knows worker %s; registering again",
                self._registry.address,
                self.worker_id,
            )
            self.lease = None
            self._settled.clear()

    def _with_load(self, load: pb.Load | None) -> pb.WorkerInfo:
        info = pb.WorkerInfo()
        info.CopyFrom(self._info)
        if load is not None:
            info.load.CopyFrom(load)
        return info

    def _current_load(self) -> pb.Load | None:
        if self._load_fn is None:
            return None
        try:
            return self._load_fn()
        except Exception:
            log.exception("load_fn failed; renewing without a load")
            return None

    def _note_unreachable(self, error: RegistryUnavailable) -> None:
        if not self._unreachable:
            log.warning("registry unreachable (%s); worker %s retrying", error, self.worker_id)
        self._unreachable = True

    def _note_reachable(self) -> None:
        if self._unreachable:
            log.info("%s reachable again", self._registry.address)
        self._unreachable = False
