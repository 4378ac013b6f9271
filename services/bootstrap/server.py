"""The bootstrap gRPC service: the registry on the wire, plus the task that expires leases.

`serve(host, port, lease_ttl, cluster_token)` starts it in the running event loop (port 0
picks a free port) and returns `(BootstrapServer, bound_port)`; `await server.stop()` ends it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import grpc
import grpc.aio

from baton.common.rpc import baton_pb2 as pb
from baton.common.rpc import baton_pb2_grpc as pb_grpc
from baton.common.rpc.auth import bind_address, make_server
from baton.services.bootstrap.registry import LayoutMismatchError, RegistrationError, Registry

log = logging.getLogger(__name__)


class BootstrapServicer(pb_grpc.BootstrapServicer):
    def __init__(self, registry: Registry) -> None:
        self._registry = registry

    async def Register(
        self, request: pb.RegisterRequest, context: grpc.aio.ServicerContext
    ) -> pb.RegisterResponse:
        try:
            lease_id = self._registry.register(request.worker)
        except LayoutMismatchError as e:
            log.error("refused registration: %s", e)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except RegistrationError as e:
            log.error("refused registration: %s", e)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.RegisterResponse(lease_id=lease_id, lease_ttl_seconds=self._registry.lease_ttl)

    async def Heartbeat(
        self, request: pb.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> pb.HeartbeatResponse:
        load = request.load if request.HasField("load") else None
        known = self._registry.heartbeat(request.lease_id, request.worker_id, load)
        return pb.HeartbeatResponse(known=known)

    async def Deregister(
        self, request: pb.DeregisterRequest, context: grpc.aio.ServicerContext
    ) -> pb.DeregisterResponse:
        removed = self._registry.deregister(request.lease_id, request.worker_id)
        return pb.DeregisterResponse(removed=removed)

    async def List(
        self, request: pb.ListRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListResponse:
        return pb.ListResponse(workers=self._registry.list(request.role))

    async def Watch(
        self, request: pb.WatchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.MembershipEvent]:
        queue = self._registry.subscribe()
        try:
            # None: the registry dropped this watcher (too far behind) or is shutting down.
            while (event := await queue.get()) is not None:
                yield event
        finally:
            self._registry.unsubscribe(queue)


class BootstrapServer:
    """A running bootstrap service: the gRPC server, its registry and the expiry task."""

    def __init__(self, server: grpc.aio.Server, registry: Registry, port: int) -> None:
        self.server = server
        self.registry = registry
        self.port = port
        self._expiry = asyncio.create_task(self._expire_forever(), name="bootstrap-expiry")

    async def _expire_forever(self) -> None:
        # Reads expire lazily; this sweep exists so watchers hear REMOVED soon after a lapse,
        # and its cadence is how the registry tells a stall of its own (registry.py).
        assert self.registry.sweep_period is not None
        while True:
            await asyncio.sleep(self.registry.sweep_period)
            self.registry.expire()

    async def stop(self, grace: float | None = 1.0) -> None:
        """Stop serving: end watch streams, let unary calls finish within `grace` seconds."""
        self._expiry.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._expiry
        self.registry.close_watchers()
        await self.server.stop(grace)

    async def wait_for_termination(self) -> None:
        await self.server.wait_for_termination()


async def serve(
    host: str = "127.0.0.1",
    port: int = 0,
    lease_ttl: float = 5.0,
    cluster_token: str | None = None,
) -> tuple[BootstrapServer, int]:
    """Start the bootstrap service on host:port (0 = a free port); return it and its port.
    Raises OSError when the address cannot be bound."""
    registry = Registry(lease_ttl, sweep_period=min(lease_ttl / 4, 1.0))
    server = make_server(cluster_token)
    pb_grpc.add_BootstrapServicer_to_server(BootstrapServicer(registry), server)
    address = bind_address(host, port)
    try:
        bound_port = server.add_insecure_port(address)
    except RuntimeError as e:  # grpc raises RuntimeError on bind failure
        raise OSError(f"cannot bind the bootstrap service to {address}: {e}") from e
    if bound_port == 0:
        raise OSError(f"cannot bind the bootstrap service to {address}")
    await server.start()
    return BootstrapServer(server, registry, bound_port), bound_port
