"""The registry on baton's own bootstrap service (`baton bootstrap`, gRPC).

The bootstrap keeps no revisions: every watch starts with the service's snapshot (the ADDED
events it sends before SYNCED), then follows its changes. Load travels in heartbeats.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import grpc.aio

from baton.common.rpc import baton_pb2 as pb
from baton.common.rpc import baton_pb2_grpc as pb_grpc
from baton.common.rpc.auth import make_channel
from baton.services.registry.base import (
    Change,
    Lease,
    RegistrationRefused,
    Registry,
    RegistryUnavailable,
    Snapshot,
    WatchItem,
)

# Codes with which the bootstrap refuses a registration; retrying unchanged will not help.
_REFUSED = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT)


class BootstrapRegistry(Registry):
    def __init__(self, address: str, cluster_token: str | None, timeout: float = 1.0) -> None:
        self.address = address
        self._token = cluster_token
        self._timeout = timeout
        self._channel: grpc.aio.Channel | None = None

    def _stub(self) -> pb_grpc.BootstrapStub:
        # Made on first use: a grpc.aio channel belongs to the loop that runs it.
        if self._channel is None:
            self._channel = make_channel(self.address, self._token)
        return pb_grpc.BootstrapStub(self._channel)

    def _unavailable(self, error: grpc.aio.AioRpcError) -> RegistryUnavailable:
        return RegistryUnavailable(
            f"bootstrap {self.address}: {error.code().name}: {error.details()}"
        )

    async def register(self, info: pb.WorkerInfo) -> Lease:
        try:
            response = await self._stub().Register(
                pb.RegisterRequest(worker=info), timeout=self._timeout
            )
        except grpc.aio.AioRpcError as e:
            if e.code() in _REFUSED:
                raise RegistrationRefused(e.details()) from None
            raise self._unavailable(e) from None
        return Lease(response.lease_id, info.worker_id, response.lease_ttl_seconds)

    async def keepalive(self, lease: Lease) -> bool:
        return await self._heartbeat(
            pb.HeartbeatRequest(lease_id=lease.id, worker_id=lease.worker_id)
        )

    async def update(self, lease: Lease, info: pb.WorkerInfo) -> bool:
        # The bootstrap takes only the load after registration.
        request = pb.HeartbeatRequest(lease_id=lease.id, worker_id=lease.worker_id, load=info.load)
        return await self._heartbeat(request)

    async def _heartbeat(self, request: pb.HeartbeatRequest) -> bool:
        try:
            response = await self._stub().Heartbeat(request, timeout=self._timeout)
        except grpc.aio.AioRpcError as e:
            raise self._unavailable(e) from None
        return bool(response.known)

    async def deregister(self, lease: Lease) -> None:
        request = pb.DeregisterRequest(lease_id=lease.id, worker_id=lease.worker_id)
        try:
            await self._stub().Deregister(request, timeout=self._timeout)
        except grpc.aio.AioRpcError as e:
            raise self._unavailable(e) from None

    async def snapshot(self) -> Snapshot:
        try:
            response = await self._stub().List(pb.ListRequest(), timeout=self._timeout)
        except grpc.aio.AioRpcError as e:
            raise self._unavailable(e) from None
        return Snapshot(tuple(response.workers), 0)

    async def watch(self, after: int) -> AsyncIterator[WatchItem]:
        call = self._stub().Watch(pb.WatchRequest())
        members: list[pb.WorkerInfo] = []
        in_snapshot = True
        try:
            async for event in call:
                if event.type == pb.MembershipEvent.SYNCED:
                    yield Snapshot(tuple(members), 0, event.lease_ttl_seconds)
                    in_snapshot = False
                elif in_snapshot:
                    members.append(event.worker)
                else:
                    yield Change(event.type, event.worker, 0)
        except grpc.aio.AioRpcError as e:
            raise self._unavailable(e) from None
        finally:
            call.cancel()
        # The service ends streams it drops (a watcher too far behind) or on shutdown.
        raise RegistryUnavailable(f"bootstrap {self.address}: watch stream ended")

    async def close(self) -> None:
        if self._channel is not None:
            channel, self._channel = self._channel, None
            await channel.close()
