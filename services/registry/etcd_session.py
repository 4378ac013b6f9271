"""A connection to etcd, made again after any failure: channel, TLS, auth, timeouts.

The channel is made here rather than by etcd3aio's client facade, with the library's KV,
lease, watch and auth services on it, for its settings: gRPC's default reconnect backoff
grows to 2 minutes and its subchannels are shared process-wide, so a fresh channel would
inherit the old one's backoff and find a restarted etcd only seconds after it is back -
longer than a short lease. Endpoint names are resolved to IPv4 addresses when a connection
is made; any failure drops the connection, so the next call reconnects, resolves names
again and authenticates again (etcd forgets auth tokens when it restarts).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import grpc.aio
from etcd3aio import EtcdError, TokenRefresher
from etcd3aio.auth import AuthService
from etcd3aio.kv import KVService
from etcd3aio.lease import LeaseService
from etcd3aio.watch import WatchService

from baton.services.registry.base import RegistryUnavailable

T = TypeVar("T")

_CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 1_000),  # also the connect timeout: room for TLS
    ("grpc.max_reconnect_backoff_ms", 1_000),
    ("grpc.keepalive_time_ms", 10_000),  # etcd accepts pings every 5 s or more
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
)
_RPC_ATTEMPTS = 2  # the library retries a call once on UNAVAILABLE / DEADLINE_EXCEEDED


@dataclass(frozen=True)
class Connection:
    """One channel to etcd and the library's services on it."""

    channel: grpc.aio.Channel
    kv: KVService
    lease: LeaseService
    watch: WatchService
    refresher: TokenRefresher | None


class EtcdSession:
    """The current connection to the etcd at `endpoints`. `address` names it in errors."""

    def __init__(
        self,
        endpoints: list[tuple[str, int]],
        address: str,
        *,
        username: str | None = None,
        password: str | None = None,
        ca_cert: bytes | None = None,
        client_cert: bytes | None = None,
        client_key: bytes | None = None,
        tls_server_name: str | None = None,
        timeout: float = 2.0,
    ) -> None:
        if not endpoints:
            raise ValueError("etcd registry needs at least one endpoint")
        if (client_cert is None) != (client_key is None):
            raise ValueError("a client certificate needs its key, and a key its certificate")
        if (client_cert is not None or tls_server_name) and ca_cert is None:
            raise ValueError("TLS to etcd needs the CA certificate (--registry-ca-file)")
        if (username is None) != (password is None):
            raise ValueError("etcd authentication needs both a user name and a password")
        self._endpoints = endpoints
        self.address = address
        self._username, self._password = username, password
        self._credentials: grpc.ChannelCredentials | None = None
        self._server_name = tls_server_name or _common_name(endpoints)
        if ca_cert is not None:
            self._credentials = grpc.ssl_channel_credentials(ca_cert, client_key, client_cert)
        self.timeout = timeout
        self.current: Connection | None = None
        self._connecting = asyncio.Lock()

    async def connection(self) -> Connection:
        async with self._connecting:
            if self.current is None:
                self.current = await self._open()
            return self.current

    async def call(self, what: str, op: Callable[[Connection], Awaitable[T]]) -> T:
        """Run `op` on the connection within the timeout. Failures become RegistryUnavailable
        (and drop the connection), except NOT_FOUND, which the caller handles (e.g. a lapsed
        lease)."""
        connection = await self.connection()
        try:
            return await asyncio.wait_for(op(connection), self.timeout)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                raise
            await self.drop(connection)
            raise RegistryUnavailable(f"{self.address}: {what}: {describe(e)}") from None
        except (EtcdError, TimeoutError) as e:
            await self.drop(connection)
            raise RegistryUnavailable(f"{self.address}: {what}: {describe(e)}") from None

    async def drop(self, connection: Connection) -> None:
        """Forget `connection` (if still current) so the next call connects afresh."""
        if self.current is not connection:
            return
        self.current = None
        if connection.refresher is not None:
            await connection.refresher.__aexit__(None, None, None)
        await connection.channel.close()

    async def close(self) -> None:
        if self.current is not None:
            await self.drop(self.current)

    async def _open(self) -> Connection:
        loop = asyncio.get_running_loop()
        addresses: list[str] = []
        for host, port in self._endpoints:
            try:
                found = await loop.getaddrinfo(host, port, family=socket.AF_INET)
            except OSError as e:
                raise RegistryUnavailable(f"{self.address}: cannot resolve {host}: {e}") from None
            addresses += dict.fromkeys(f"{info[4][0]}:{port}" for info in found)
        target = "ipv4:" + ",".join(addresses)
        options: list[tuple[str, Any]] = list(_CHANNEL_OPTIONS)
        if self._credentials is None:
            channel = grpc.aio.insecure_channel(target, options)
        else:
            if self._server_name:  # the addresses are IPs: verify the certificate's name
                options.append(("grpc.ssl_target_name_override", self._server_name))
            channel = grpc.aio.secure_channel(target, self._credentials, options)
        kv = KVService(channel, max_attempts=_RPC_ATTEMPTS)
        lease = LeaseService(channel, max_attempts=_RPC_ATTEMPTS)
        watch = WatchService(channel, max_attempts=_RPC_ATTEMPTS)
        refresher = None
        if self._username is not None and self._password is not None:
            auth = AuthService(channel, max_attempts=_RPC_ATTEMPTS)

            def set_token(token: str | None) -> None:
                for service in (kv, lease, watch, auth):
                    service.set_token(token)

            refresher = TokenRefresher(auth, set_token, self._username, self._password)
            try:
                await asyncio.wait_for(refresher.__aenter__(), self.timeout)
            except (EtcdError, grpc.aio.AioRpcError, TimeoutError) as e:
                await channel.close()
                raise RegistryUnavailable(
                    f"{self.address}: authenticating as {self._username!r}: {describe(e)}"
                ) from None
        return Connection(channel, kv, lease, watch, refresher)


def _common_name(endpoints: list[tuple[str, int]]) -> str | None:
    """The host name TLS should verify when every endpoint is that one name."""
    hosts = {host for host, _ in endpoints}
    if len(hosts) != 1:
        return None
    (host,) = hosts
    with contextlib.suppress(OSError):
        socket.inet_aton(host)
        return None  # an IP address: verified as it is
    return host


def describe(error: BaseException) -> str:
    if isinstance(error, grpc.aio.AioRpcError):
        return f"{error.code().name}: {error.details()}"
    if isinstance(error, TimeoutError):
        return "timed out"
    return str(error) or type(error).__name__
