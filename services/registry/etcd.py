"""The registry on an etcd cluster, through the etcd3aio client library (asyncio gRPC services
for KV, leases, watches and auth; the connection is etcd_session.py's).

Every worker is one key, `<prefix>/workers/<worker_id>`, holding its `WorkerRecord` as JSON
and attached to an etcd lease of `lease_ttl` seconds: renewing the lease is a keepalive,
publishing a new load rewrites the value, revoking the lease deletes the key at once, and a
worker that dies disappears when etcd expires its lease.

Registration checks the KV layout against the members it reads and writes only if no key
under the prefix was created since that read (a transaction), so two workers of clashing
layouts cannot both get in.

The watch is resumed by this module, not by the client library: it counts revisions from the
events themselves, re-creates the etcd watch after the last one it delivered, and replaces
the caller's view with a fresh snapshot when etcd has compacted that revision or is behind it
(a store restarted empty). A watch that hears nothing for `probe_interval` seconds probes
etcd, so an unreachable store is noticed even when nothing changes; a resumed watch counts as
live at its first response or first answered probe, since etcd refuses a compacted start
revision only after confirming the watch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import grpc.aio
from etcd3aio import prefix_range_end
from etcd3aio.kv import KVService

from baton.common.rpc import baton_pb2 as pb
from baton.common.rpc.layout import layout_conflict
from baton.services.registry import records
from baton.services.registry.base import (
    Change,
    Lease,
    Progress,
    RegistrationRefused,
    Registry,
    RegistryUnavailable,
    Snapshot,
    WatchItem,
)
from baton.services.registry.etcd_session import Connection, EtcdSession, describe

log = logging.getLogger(__name__)
# The library logs every reconnect of a watch; this module reports an outage once, and the
# watch is re-made here anyway.
logging.getLogger("etcd3aio.watch").setLevel(logging.ERROR)

_COMPARE_LESS = 2  # etcdserverpb.Compare.LESS
_EVENT_DELETE = 1  # mvccpb.Event.DELETE
_REGISTER_ATTEMPTS = 5
_MAX_REMEMBERED_BAD_KEYS = 1024


class EtcdRegistry(Registry):
    def __init__(
        self,
        endpoints: list[tuple[str, int]],
        prefix: str,
        *,
        lease_ttl: float = 5.0,
        username: str | None = None,
        password: str | None = None,
        ca_cert: bytes | None = None,
        client_cert: bytes | None = None,
        client_key: bytes | None = None,
        tls_server_name: str | None = None,
        timeout: float = 2.0,
        probe_interval: float = 1.0,
    ) -> None:
        self.address = "etcd://" + ",".join(f"{h}:{p}" for h, p in endpoints) + prefix
        self._session = EtcdSession(
            endpoints,
            self.address,
            username=username,
            password=password,
            ca_cert=ca_cert,
            client_cert=client_cert,
            client_key=client_key,
            tls_server_name=tls_server_name,
            timeout=timeout,
        )
        self._workers = f"{prefix}/workers/".encode()
        self._workers_end = prefix_range_end(self._workers)
        self._lease_ttl = max(1, math.ceil(lease_ttl))
        self._probe_interval = probe_interval
        self._bad_keys: dict[bytes, int] = {}  # malformed keys logged, at their mod revision

    async def close(self) -> None:
        await self._session.close()

    # -- registration -----------------------------------------------------------------------

    def _key(self, worker_id: str) -> bytes:
        return self._workers + worker_id.encode()

    async def register(self, info: pb.WorkerInfo) -> Lease:
        try:
            value = records.encode(records.to_record(info))
        except records.RecordError as e:
            raise RegistrationRefused(str(e)) from None
        grant = await self._session.call("grant a lease", lambda c: c.lease.grant(self._lease_ttl))
        try:
            for _ in range(_REGISTER_ATTEMPTS):
                snapshot = await self.snapshot()
                conflict = layout_conflict(info, snapshot.members)
                if conflict:
                    raise RegistrationRefused(conflict)
                # Write only if no worker joined since the snapshot: it might clash.
                unchanged = KVService.txn_compare_create_revision(
                    self._workers,
                    snapshot.revision + 1,
                    result=_COMPARE_LESS,
                    range_end=self._workers_end,
                )
                put = KVService.txn_op_put(self._key(info.worker_id), value, lease=grant.ID)
                txn = await self._session.call("register", _txn([unchanged], [put]))
                if txn.succeeded:
                    return Lease(str(grant.ID), info.worker_id, float(grant.TTL))
            raise RegistryUnavailable(f"{self.address}: workers kept joining while registering")
        except BaseException:
            with contextlib.suppress(RegistryUnavailable, grpc.aio.AioRpcError):
                await self._session.call("revoke a lease", lambda c: c.lease.revoke(grant.ID))
            raise

    async def keepalive(self, lease: Lease) -> bool:
        async def renew(connection: Connection) -> bool:
            stream = connection.lease.keep_alive(int(lease.id))
            try:
                async for response in stream:
                    return bool(response.TTL > 0)  # TTL <= 0: the lease is gone
                return False
            finally:
                stream.cancel()

        return await self._session.call("renew the lease", renew)

    async def update(self, lease: Lease, info: pb.WorkerInfo) -> bool:
        value = records.encode(records.to_record(info))
        if not await self.keepalive(lease):
            return False
        key = self._key(lease.worker_id)
        try:
            await self._session.call("update", lambda c: c.kv.put(key, value, lease=int(lease.id)))
        except grpc.aio.AioRpcError:  # NOT_FOUND: the lease lapsed after the renewal
            return False
        return True

    async def deregister(self, lease: Lease) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError):  # NOT_FOUND: already gone
            await self._session.call("revoke the lease", lambda c: c.lease.revoke(int(lease.id)))

    # -- membership -------------------------------------------------------------------------

    async def snapshot(self) -> Snapshot:
        response = await self._session.call(
            "list workers", lambda c: c.kv.get(self._workers, range_end=self._workers_end)
        )
        members = [info for kv in response.kvs if (info := self._read(kv)) is not None]
        return Snapshot(tuple(members), response.header.revision)

    async def watch(self, after: int) -> AsyncIterator[WatchItem]:
        if after <= 0:
            snapshot = await self.snapshot()
            yield snapshot
            after = snapshot.revision
        while True:
            connection = await self._session.connection()
            created = announced = False
            async with contextlib.aclosing(self._responses(connection, after + 1)) as responses:
                async for response in responses:
                    if response is None:  # a quiet spell, and etcd answered a probe
                        if created and not announced:
                            announced = True
                            yield Progress(after)
                        continue
                    if response.canceled or response.compact_revision:
                        log.info(
                            "%s: history after revision %d is compacted; resyncing",
                            self.address,
                            after,
                        )
                        break
                    if response.created:
                        # Not live yet: a compacted start revision is refused right after.
                        if created:  # the library re-created the watch from where it chose
                            raise RegistryUnavailable(f"{self.address}: watch re-established")
                        created = True
                        if response.header.revision < after:
                            log.warning(
                                "%s is at revision %d, behind the %d already seen: "
                                "the store was replaced; resyncing",
                                self.address,
                                response.header.revision,
                                after,
                            )
                            break
                        continue
                    floor = after  # one revision's events all come in one response
                    for event in response.events:
                        if event.kv.mod_revision > floor:
                            after = max(after, event.kv.mod_revision)
                            yield self._change(event)
                    if not response.events:  # a progress notification
                        after = max(after, response.header.revision)
                    if not announced:
                        announced = True
                        yield Progress(after)
            snapshot = await self.snapshot()
            yield snapshot
            after = snapshot.revision

    async def _responses(self, connection: Connection, start: int) -> AsyncGenerator[Any]:
        """The etcd watch's responses from revision `start`, and None after each quiet spell
        of `probe_interval` in which etcd answered a probe; raises RegistryUnavailable when
        the stream fails or a probe does."""
        queue: asyncio.Queue[Any] = asyncio.Queue()

        async def pump() -> None:
            try:
                async for response in connection.watch.watch(
                    self._workers, range_end=self._workers_end, start_revision=start
                ):
                    queue.put_nowait(response)
                queue.put_nowait(RegistryUnavailable(f"{self.address}: watch stream ended"))
            except Exception as e:
                queue.put_nowait(e)

        task = asyncio.create_task(pump(), name="etcd-watch")
        try:
            while True:
                # asyncio.wait, not wait_for: wait_for (Python < 3.12) can lose a cancellation
                # that arrives with a response, and the watch would outlive its stop().
                getter = asyncio.ensure_future(queue.get())
                try:
                    await asyncio.wait({getter}, timeout=self._probe_interval)
                finally:
                    getter.cancel()  # a response it had not taken stays in the queue
                if not getter.done() or getter.cancelled():
                    await self._probe(connection)
                    yield None
                    continue
                item = getter.result()
                if isinstance(item, RegistryUnavailable):
                    raise item
                if isinstance(item, Exception):
                    await self._session.drop(connection)
                    raise RegistryUnavailable(f"{self.address}: watch: {describe(item)}")
                yield item
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _probe(self, connection: Connection) -> None:
        if self._session.current is not connection:
            raise RegistryUnavailable(f"{self.address}: reconnecting")
        await self._session.call(
            "probe",
            lambda c: c.kv.get(self._workers, range_end=self._workers_end, count_only=True),
        )

    def _change(self, event: Any) -> Change:
        revision = event.kv.mod_revision
        worker_id = event.kv.key[len(self._workers) :].decode(errors="replace")
        info = None if event.type == _EVENT_DELETE else self._read(event.kv)
        if info is None:  # deleted, or no longer readable: either way not a usable member
            return Change(pb.MembershipEvent.REMOVED, pb.WorkerInfo(worker_id=worker_id), revision)
        added = event.kv.version == 1
        kind = pb.MembershipEvent.ADDED if added else pb.MembershipEvent.UPDATED
        return Change(kind, info, revision)

    def _read(self, kv: Any) -> pb.WorkerInfo | None:
        """The member a stored key holds; None (logged once per revision) if malformed."""
        worker_id = kv.key[len(self._workers) :].decode(errors="replace")
        try:
            record = records.decode(kv.value)
            if record.worker_id != worker_id:
                raise records.RecordError(f"it holds worker {record.worker_id!r}")
            return records.to_info(record)
        except records.RecordError as e:
            if self._bad_keys.get(kv.key) != kv.mod_revision:
                if len(self._bad_keys) >= _MAX_REMEMBERED_BAD_KEYS:
                    self._bad_keys.clear()
                self._bad_keys[kv.key] = kv.mod_revision
                log.warning(
                    "%s: skipping malformed key %r (revision %d): %s",
                    self.address,
                    kv.key.decode(errors="replace"),
                    kv.mod_revision,
                    e,
                )
            return None


def _txn(compare: list[Any], success: list[Any]) -> Callable[[Connection], Awaitable[Any]]:
    return lambda connection: connection.kv.txn(compare, success)
