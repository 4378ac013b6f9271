"""The membership registry as its clients see it: one small interface, two stores.

A worker `register`s its `WorkerInfo` under a lease, renews the lease (`keepalive`), publishes
its load (`update`) and gives the lease back on a clean stop (`deregister`); a worker that dies
disappears when its lease lapses. The router, and workers that must notice a lost peer, read a
`snapshot` and then `watch` the changes after it.

Two stores implement it: `bootstrap.BootstrapRegistry`, baton's own gRPC service (the
default, embedded in `baton up`), and `etcd.EtcdRegistry`, an etcd cluster. The loops that
use them - keep one worker registered, keep one view of the cluster - live in
`membership.py` and `watcher.py` and are the same for both.

Revisions order changes. etcd has them; the bootstrap has none (every revision is 0), so a
bootstrap watch always starts with a fresh `Snapshot`, which the view diffs against what it
held. Either way a change is never missed: a watch resumes after the last revision seen, or
starts again from a snapshot.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass

from baton.common.rpc import baton_pb2 as pb


class RegistryUnavailable(ConnectionError):
    """The store cannot be reached now (down, partitioned, timed out); try again later."""


class RegistrationRefused(RuntimeError):
    """The store refuses this worker (a malformed record, or a KV layout its peers cannot
    use). Retrying unchanged helps only once the conflicting peers are gone."""


@dataclass(frozen=True)
class Lease:
    """One worker's registration. `id` is opaque to callers; `ttl` is in seconds as granted."""

    id: str
    worker_id: str
    ttl: float


@dataclass(frozen=True)
class Snapshot:
    """Every member, as of `revision` (0 where the store keeps no revisions)."""

    members: tuple[pb.WorkerInfo, ...]
    revision: int
    lease_ttl: float = 0.0  # seconds a member lives without renewing; 0: not told


@dataclass(frozen=True)
class Change:
    """One member joined (ADDED), changed (UPDATED) or left (REMOVED) at `revision`."""

    type: pb.MembershipEvent.Type
    worker: pb.WorkerInfo
    revision: int


@dataclass(frozen=True)
class Progress:
    """The watch is live and nothing changed after `revision` that was not delivered."""

    revision: int


WatchItem = Snapshot | Change | Progress


class Registry(ABC):
    """A connection to one membership store. Methods raise `RegistryUnavailable` when the
    store cannot be reached; nothing here retries - the loops in `membership.py` and `watcher.py` do."""

    #: Where the store is, fit for logs: never credentials.
    address: str

    @abstractmethod
    async def register(self, info: pb.WorkerInfo) -> Lease:
        """Publish `info` under a new lease. A record with the same worker_id is replaced.
        Raises RegistrationRefused for a worker the cluster could never use."""

    @abstractmethod
    async def keepalive(self, lease: Lease) -> bool:
        """Renew the lease; False when it is gone (lapsed, revoked, store restarted empty):
        the caller must register again."""

    @abstractmethod
    async def update(self, lease: Lease, info: pb.WorkerInfo) -> bool:
        """Renew the lease and publish `info` (same worker, e.g. a new load); False when
        the lease is gone."""

    @abstractmethod
    async def deregister(self, lease: Lease) -> None:
        """Give the lease back: the record disappears now rather than at the lapse.
        A lease that is already gone is not an error."""

    @abstractmethod
    async def snapshot(self) -> Snapshot:
        """Every current member (sorted by worker_id) and the revision it reflects."""

    @abstractmethod
    def watch(self, after: int) -> AsyncIterator[WatchItem]:
        """Changes after revision `after`, as they happen. It may first yield a `Snapshot`
        that replaces the caller's view (always with `after == 0`, and whenever the store
        cannot replay from `after`); it yields `Progress` once the watch is live. Ends by
        raising RegistryUnavailable when the store is lost."""

    @abstractmethod
    async def close(self) -> None:
        """Release connections. Safe to call twice."""
