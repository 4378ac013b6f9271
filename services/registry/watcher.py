"""The cluster's view over any store (`base.Registry`).

`MembershipWatcher` keeps a local view of the cluster. It follows the store's watch from the
last revision it has seen; when the watch breaks it keeps the last view readable, reconnects
with backoff, and resumes - or, where the store cannot replay, replaces the view with a fresh
snapshot, telling `on_change` what differs.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from baton.common.rpc import baton_pb2 as pb
from baton.services.registry.base import (
    Change,
    Progress,
    Registry,
    RegistryUnavailable,
    Snapshot,
    WatchItem,
)
from baton.services.registry.membership import Backoff, RegistryLoop, cancel_and_wait

log = logging.getLogger(__name__)

# Seconds a member missing from a resync stays, when the store does not tell its lease ttl.
DEFAULT_RESYNC_GRACE = 5.0


class MembershipWatcher(RegistryLoop):
    """A live view of the cluster's members, kept current through the registry's watch.

    `on_change(event)` is called for every ADDED / UPDATED / REMOVED change to the view,
    including those found by comparing a fresh snapshot after a reconnect; a REMOVED event
    carries the member as the view last knew it. It runs on the event loop and must not
    block.

    A fresh snapshot after a reconnect may come from a store that restarted empty (the
    bootstrap keeps soft state): its members register again within a lease ttl. Members it
    lacks therefore stay in the view, provisionally, for one lease ttl (the snapshot's, or
    `resync_grace`); those that do not come back are then removed. Restarting the store
    never empties the cluster.
    """

    def __init__(
        self,
        registry: Registry,
        on_change: Callable[[pb.MembershipEvent], None] | None = None,
        max_backoff: float = 2.0,
        resync_grace: float = DEFAULT_RESYNC_GRACE,
    ) -> None:
        self._registry = registry
        self._on_change = on_change
        self._backoff = Backoff(maximum=max_backoff)
        self._resync_grace = resync_grace
        self._view: dict[str, pb.WorkerInfo] = {}
        self._had_snapshot = False
        self._provisional: dict[str, asyncio.TimerHandle] = {}  # missing from a resync
        self._revision = 0  # the last revision the view reflects; 0: none yet
        self._synced = asyncio.Event()  # set while the view reflects a live watch
        self._task: asyncio.Task[None] | None = None

    @property
    def address(self) -> str:
        return self._registry.address

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
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="membership-watcher")

    async def wait_synced(self, timeout: float | None = None) -> None:
        """Wait until the view reflects a live watch (TimeoutError after `timeout` s)."""
        await asyncio.wait_for(self._synced.wait(), timeout)

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None
        self._synced.clear()
        for timer in self._provisional.values():
            timer.cancel()
        self._provisional.clear()

    # -- the loop ---------------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            try:
                async for item in self._registry.watch(self._revision):
                    self._follow(item)
                reason = "watch ended"
            except RegistryUnavailable as e:
                reason = str(e)
            except Exception as e:  # never let one bad event end the watch for good
                log.exception("membership watch failed")
                reason = repr(e)
            if self._synced.is_set():
                log.warning(
                    "membership watch lost (%s); keeping the last view, reconnecting", reason
                )
            self._synced.clear()
            await asyncio.sleep(self._backoff.next())

    def _follow(self, item: WatchItem) -> None:
        if isinstance(item, Snapshot):
            grace = item.lease_ttl or self._resync_grace
            self._replace_view({w.worker_id: w for w in item.members}, grace)
            self._revision = item.revision  # lower than before if the store was replaced
        else:
            if isinstance(item, Change):
                self._apply(item)
            self._revision = max(self._revision, item.revision)
        if isinstance(item, Snapshot | Progress) and not self._synced.is_set():
            self._backoff.reset()
            self._synced.set()

    def _apply(self, change: Change) -> None:
        worker_id = change.worker.worker_id
        self._confirm(worker_id)
        if change.type == pb.MembershipEvent.REMOVED:
            known = self._view.pop(worker_id, None)
            if known is not None:
                self._notify(pb.MembershipEvent(type=change.type, worker=known))
            return
        event_type = (
            pb.MembershipEvent.UPDATED if worker_id in self._view else pb.MembershipEvent.ADDED
        )
        self._view[worker_id] = change.worker
        self._notify(pb.MembershipEvent(type=event_type, worker=change.worker))

    def _replace_view(self, fresh: dict[str, pb.WorkerInfo], grace: float) -> None:
        old, self._view = self._view, fresh
        resync, self._had_snapshot = self._had_snapshot, True
        for worker_id in list(self._provisional):
            if worker_id in fresh:
                self._confirm(worker_id)
        for worker_id, info in old.items():
            if worker_id in fresh:
                continue
            if resync:  # keep it for now: a restarted store learns of it again soon
                self._view[worker_id] = info
                if worker_id not in self._provisional:
                    self._provisional[worker_id] = asyncio.get_running_loop().call_later(
                        grace, self._lapse, worker_id
                    )
            else:
                self._notify(pb.MembershipEvent(type=pb.MembershipEvent.REMOVED, worker=info))
        if self._provisional:
            log.info(
                "resynced with %s: %d members not (yet) registered there stay for %.1fs",
                self._registry.address,
                len(self._provisional),
                grace,
            )
        for worker_id, info in fresh.items():
            previous = old.get(worker_id)
            if previous is None:
                self._notify(pb.MembershipEvent(type=pb.MembershipEvent.ADDED, worker=info))
            elif previous != info:
                self._notify(pb.MembershipEvent(type=pb.MembershipEvent.UPDATED, worker=info))

    def _confirm(self, worker_id: str) -> None:
        timer = self._provisional.pop(worker_id, None)
        if timer is not None:
            timer.cancel()

    def _lapse(self, worker_id: str) -> None:
        """A member missing from a resync did not come back within the grace."""
        self._provisional.pop(worker_id, None)
        info = self._view.pop(worker_id, None)
        if info is not None:
            log.warning("worker %s did not register again after a resync; removed", worker_id)
            self._notify(pb.MembershipEvent(type=pb.MembershipEvent.REMOVED, worker=info))

    def _notify(self, event: pb.MembershipEvent) -> None:
        if self._on_change is None:
            return
        try:
            self._on_change(event)
        except Exception:
            log.exception("membership on_change callback failed")
