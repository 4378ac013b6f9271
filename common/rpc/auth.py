"""Cluster-token authentication and the channel/server settings of the control plane.

Every gRPC call inside a cluster carries the shared cluster token in the
`x-baton-cluster-token` metadata key. Servers built with `make_server(token)` reject calls
without the right token as UNAUTHENTICATED before any handler (or request parser) runs; a
server with no token accepts every call. Clients built with `make_channel(address, token)`
attach the token to every call. Everything is grpc.aio: no thread-pool servers.
"""

from __future__ import annotations

import argparse
import hmac
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc
import grpc.aio

from baton.common.options import secret

TOKEN_METADATA_KEY = "x-baton-cluster-token"

# Prompts are repeated int32: 64 MiB bounds a request far above any context length while
# still refusing absurd messages before they are parsed.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024

CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Detect a dead peer on an idle connection (a Watch stream, a worker between requests)
    # within ~15 s instead of waiting for TCP timeouts.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # gRPC's default reconnect backoff grows to 120 s; a restarted bootstrap or worker must be
    # found again within a few heartbeats.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
    # Each channel connects on its own: from gRPC's process-wide pool, a channel opened for
    # a worker restarted on the same port inherited the dead process's connection, in
    # back-off, and failed with its "Connection refused" (the router's pool opens one
    # channel per address and incarnation, so nothing is lost by not sharing).
    ("grpc.use_local_subchannel_pool", 1),
)

SERVER_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    # Must stay below the clients' keepalive_time_ms, or the server answers their pings
    # with GOAWAY ("too_many_pings").
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    # A second server on a busy port must fail to bind, not silently share the port.
    ("grpc.so_reuseport", 0),
    # A connection that does not finish its HTTP/2 handshake in 10 s (a half-open or
    # trickling client), or that carries no call for 5 minutes, is closed: neither may
    # hold a socket for free. Clients reconnect transparently when they next call.
    ("grpc.server_handshake_timeout_ms", 10_000),
    ("grpc.max_connection_idle_ms", 300_000),
)


INSECURE_HELP = (
    "start without a cluster token: anyone who can reach this process's ports may use "
    "them (by default a process without a token refuses to start)"
)


# 16 random bytes (`openssl rand -hex 16` gives 32 characters) cannot be guessed over the
# network; a word or a short string can, and then every internal port is open to it.
MIN_TOKEN_BYTES = 16


def token_refusal(token: str | None, insecure: bool, what: str) -> str | None:
    """Why `what` must not start with `token` (None: it may). Without a token every port
    is open to anyone who can reach it, so that takes an explicit `--insecure`; a token
    shorter than `MIN_TOKEN_BYTES` is refused, since it could be guessed."""
    token = normalize_token(token)
    if token is not None:
        return short_token_refusal(token, what)
    if insecure:
        return None
    return (
        f"{what} has no cluster token: set BATON_CLUSTER_TOKEN (or --cluster-token), or "
        "pass --insecure to run with every port open"
    )


def short_token_refusal(token: str | None, what: str) -> str | None:
    """Why `token` is too short for `what` (None: it is long enough, or there is none)."""
    token = normalize_token(token)
    if token is None or len(token) >= MIN_TOKEN_BYTES:
        return None
    return (
        f"{what}: the cluster token has {len(token)} bytes; at least {MIN_TOKEN_BYTES} are "
        "required so that it cannot be guessed (e.g. `openssl rand -hex 16`)"
    )


def normalize_token(token: str | None) -> str | None:
    """An empty token means "no token"; a token must be printable ASCII (gRPC metadata)."""
    try:
        return secret(token or "")
    except argparse.ArgumentTypeError as e:
        raise ValueError(f"cluster token {e}") from None


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls whose `x-baton-cluster-token` is missing or wrong (UNAUTHENTICATED)."""

    def __init__(self, token: str | None) -> None:
        token = normalize_token(token)
        self._expected = token.encode() if token else None

    def authorized(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> bool:
        if self._expected is None:
            return True
        for key, value in metadata or ():
            if key == TOKEN_METADATA_KEY:
                presented = value if isinstance(value, bytes) else value.encode()
                return hmac.compare_digest(presented, self._expected)
        return False

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None or self.authorized(handler_call_details.invocation_metadata):
            return handler
        return _rejecting_handler(handler)


async def _reject(request: Any, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong cluster token")


def _rejecting_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    # Same call shape as the real method so gRPC drives it correctly; no request
    # deserializer, so an unauthenticated payload is never parsed.
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(_reject)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(_reject)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(_reject)
    return grpc.stream_stream_rpc_method_handler(_reject)


def make_server(cluster_token: str | None) -> grpc.aio.Server:
    """A grpc.aio server with the control plane's options and token check."""
    return grpc.aio.server(
        interceptors=[TokenAuthInterceptor(cluster_token)], options=list(SERVER_OPTIONS)
    )


def bind_address(host: str, port: int) -> str:
    """host:port, bracketing IPv6 literals."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


Continuation = Callable[[grpc.aio.ClientCallDetails, Any], Awaitable[Any]]


class _TokenMetadata:
    def __init__(self, token: str) -> None:
        self._token = token

    def _with_token(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = [*(details.metadata or ()), (TOKEN_METADATA_KEY, self._token)]
        return grpc.aio.ClientCallDetails(
            details.method,
            details.timeout,
            grpc.aio.Metadata(*metadata),
            details.credentials,
            details.wait_for_ready,
        )


class _UnaryUnaryToken(_TokenMetadata, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(
        self,
        continuation: Continuation,
        client_call_details: grpc.aio.ClientCallDetails,
        request: Any,
    ) -> Any:
        return await continuation(self._with_token(client_call_details), request)


class _UnaryStreamToken(_TokenMetadata, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(
        self,
        continuation: Continuation,
        client_call_details: grpc.aio.ClientCallDetails,
        request: Any,
    ) -> Any:
        return await continuation(self._with_token(client_call_details), request)


class _StreamUnaryToken(_TokenMetadata, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(
        self,
        continuation: Continuation,
        client_call_details: grpc.aio.ClientCallDetails,
        request_iterator: Any,
    ) -> Any:
        return await continuation(self._with_token(client_call_details), request_iterator)


class _StreamStreamToken(_TokenMetadata, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(
        self,
        continuation: Continuation,
        client_call_details: grpc.aio.ClientCallDetails,
        request_iterator: Any,
    ) -> Any:
        return await continuation(self._with_token(client_call_details), request_iterator)


def make_channel(address: str, token: str | None) -> grpc.aio.Channel:
    """An insecure grpc.aio channel to `address` ("host:port") that sends `token` on every
    call. Close it with `await channel.close()`."""
    token = normalize_token(token)
    interceptors: list[grpc.aio.ClientInterceptor] = []
    if token is not None:
        interceptors = [
            _UnaryUnaryToken(token),
            _UnaryStreamToken(token),
            _StreamUnaryToken(token),
            _StreamStreamToken(token),
        ]
    return grpc.aio.insecure_channel(
        address, options=list(CHANNEL_OPTIONS), interceptors=interceptors or None
    )
