"""The bootstrap service over real gRPC on loopback: leases, watch, restart, auth, CLI."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable

import grpc
import grpc.aio
import pytest

from baton.common.rpc import baton_pb2 as pb
from baton.common.rpc import baton_pb2_grpc as pb_grpc
from baton.common.rpc.auth import make_channel
from baton.services.bootstrap.server import BootstrapServer, serve
from baton.services.registry.base import RegistrationRefused
from baton.services.registry.bootstrap import BootstrapRegistry
from baton.services.registry.membership import WorkerRegistration
from baton.services.registry.watcher import MembershipWatcher

pytestmark = pytest.mark.timeout(30)

TOKEN = "test-cluster-token"
TTL = 0.5
ADDED, UPDATED, REMOVED, SYNCED = (
    pb.MembershipEvent.ADDED,
    pb.MembershipEvent.UPDATED,
    pb.MembershipEvent.REMOVED,
    pb.MembershipEvent.SYNCED,
)


def worker(worker_id: str, role: pb.Role = pb.DECODE, page_size: int = 16) -> pb.WorkerInfo:
    return pb.WorkerInfo(
        worker_id=worker_id,
        role=role,
        grpc_address="127.0.0.1:50051",
        kv_control_address="tcp://127.0.0.1:50052",
        transfer_backend="fake",
        layout=pb.KVLayout(model="tiny", page_size=page_size, dtype="float32", num_layers=2),
    )


async def eventually(predicate: Callable[[], bool], timeout: float, what: str) -> float:
    """Wait until `predicate()` holds; return how long it took."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"not within {timeout}s: {what}")
        await asyncio.sleep(0.02)
    return time.monotonic() - start


@pytest.fixture
async def bootstrap() -> AsyncIterator[tuple[BootstrapServer, str]]:
    server, port = await serve("127.0.0.1", 0, lease_ttl=TTL, cluster_token=TOKEN)
    try:
        yield server, f"127.0.0.1:{port}"
    finally:
        await server.stop(grace=None)


@pytest.fixture
async def client(
    bootstrap: tuple[BootstrapServer, str],
) -> AsyncIterator[Callable[[], BootstrapRegistry]]:
    """Registry clients of the bootstrap, closed after the test."""
    made: list[BootstrapRegistry] = []

    def make() -> BootstrapRegistry:
        made.append(BootstrapRegistry(bootstrap[1], TOKEN))
        return made[-1]

    try:
        yield make
    finally:
        for registry in made:
            await registry.close()


@pytest.fixture
async def stub(bootstrap: tuple[BootstrapServer, str]) -> AsyncIterator[pb_grpc.BootstrapStub]:
    channel = make_channel(bootstrap[1], TOKEN)
    try:
        yield pb_grpc.BootstrapStub(channel)
    finally:
        await channel.close()


async def test_register_list_and_watch_until_the_lease_lapses(
    stub: pb_grpc.BootstrapStub,
) -> None:
    response = await stub.Register(pb.RegisterRequest(worker=worker("d0")))
    assert response.lease_id and response.lease_ttl_seconds == TTL
    listed = await stub.List(pb.ListRequest())
    assert [w.worker_id for w in listed.workers] == ["d0"]
    assert listed.workers[0].layout.page_size == 16
    assert (await stub.List(pb.ListRequest(role=pb.PREFILL))).workers == []

    watch = stub.Watch(pb.WatchRequest())
    try:
        first, second = await watch.read(), await watch.read()
        assert (first.type, first.worker.worker_id) == (ADDED, "d0")
        assert second.type == SYNCED
        # No heartbeats: the lease lapses and watchers hear about it promptly.
        started = time.monotonic()
        removed = await asyncio.wait_for(watch.read(), timeout=TTL * 4)
        assert (removed.type, removed.worker.worker_id) == (REMOVED, "d0")
        assert time.monotonic() - started < TTL * 2
    finally:
        watch.cancel()
    assert (await stub.List(pb.ListRequest())).workers == []


async def test_registration_survives_a_bootstrap_restart_on_the_same_port(
    bootstrap: tuple[BootstrapServer, str], client: Callable[[], BootstrapRegistry]
) -> None:
    server, _ = bootstrap
    port = server.port
    interval = 0.1
    changes: list[tuple[int, str]] = []
    loads = iter(range(1_000_000))
    registration = WorkerRegistration(
        client(),
        worker("d0"),
        heartbeat_interval=interval,
        load_fn=lambda: pb.Load(running=next(loads) % 2),
    )
    watcher = MembershipWatcher(
        client(), on_change=lambda e: changes.append((e.type, e.worker.worker_id))
    )
    restarted: BootstrapServer | None = None
    try:
        await registration.start()
        await registration.wait_registered(timeout=5)
        await watcher.start()
        await watcher.wait_synced(timeout=5)
        assert [w.worker_id for w in watcher.members(pb.DECODE)] == ["d0"]
        assert changes[0] == (ADDED, "d0")

        # Heartbeats outlive the ttl and carry the load.
        await asyncio.sleep(TTL * 3)
        assert [w.worker_id for w in server.registry.list()] == ["d0"]
        assert any(kind == UPDATED for kind, _ in changes)

        await server.stop(grace=None)
        await eventually(lambda: not watcher.connected, 5, "watcher notices the outage")
        assert [w.worker_id for w in watcher.members()] == ["d0"]  # last view stays readable
        await asyncio.sleep(4 * interval)  # a few heartbeats fail while it is down

        restarted, _ = await serve("127.0.0.1", port, lease_ttl=TTL, cluster_token=TOKEN)
        took = await eventually(
            lambda: bool(restarted and restarted.registry.list()), 5, "worker registers again"
        )
        # Reconnect backoff is capped at 2 s by make_channel; then one heartbeat.
        assert took < 2.5 + 3 * interval
        await eventually(lambda: watcher.connected, 5, "watcher resyncs")
        assert [w.worker_id for w in watcher.members()] == ["d0"]
        # The restarted bootstrap's first (possibly empty) snapshot never dropped the worker.
        assert (REMOVED, "d0") not in changes

        await registration.stop()
        # Deregistered at once, not after the lease lapses.
        assert restarted.registry.list() == []
        await eventually(lambda: watcher.members() == [], 2, "watcher sees the removal")
        assert changes[-1] == (REMOVED, "d0")
    finally:
        await registration.stop()
        await watcher.stop()
        if restarted is not None:
            await restarted.stop(grace=None)


async def test_watcher_resyncs_provisionally_with_a_restarted_bootstrap(
    bootstrap: tuple[BootstrapServer, str], client: Callable[[], BootstrapRegistry]
) -> None:
    server, _ = bootstrap
    changes: list[tuple[int, str]] = []
    watcher = MembershipWatcher(
        client(), on_change=lambda e: changes.append((e.type, e.worker.worker_id))
    )
    restarted: BootstrapServer | None = None
    try:
        server.registry.register(worker("gone"))
        await watcher.start()
        await watcher.wait_synced(timeout=5)
        await server.stop(grace=None)
        await eventually(lambda: not watcher.connected, 5, "watcher notices the outage")

        restarted, _ = await serve("127.0.0.1", server.port, lease_ttl=TTL, cluster_token=TOKEN)
        restarted.registry.register(worker("new"))
        await eventually(lambda: watcher.connected, 5, "watcher resyncs")
        # A member the restarted registry does not know (yet) stays for one lease ttl...
        assert [w.worker_id for w in watcher.members()] == ["gone", "new"]
        assert changes[-1] == (ADDED, "new")
        # ...and is removed when it does not register again within it.
        took = await eventually(
            lambda: watcher.get("gone") is None, 5, "'gone' is removed after the grace"
        )
        assert TTL / 2 < took < TTL * 4
        assert (REMOVED, "gone") in changes
    finally:
        await watcher.stop()
        if restarted is not None:
            await restarted.stop(grace=None)


async def test_mismatched_kv_layout_is_refused_at_registration(
    client: Callable[[], BootstrapRegistry],
) -> None:
    async with WorkerRegistration(client(), worker("p0", pb.PREFILL), 0.1) as prefill:
        await prefill.wait_registered(timeout=5)
        decode = WorkerRegistration(client(), worker("d0", pb.DECODE, page_size=1), 0.1)
        async with decode:
            with pytest.raises(RegistrationRefused, match="page_size 1 != 16"):
                await decode.wait_registered(timeout=5)


@pytest.mark.parametrize("token", [None, "wrong-token"])
async def test_calls_without_the_cluster_token_are_unauthenticated(
    bootstrap: tuple[BootstrapServer, str], token: str | None
) -> None:
    server, address = bootstrap
    channel = make_channel(address, token)
    try:
        stub = pb_grpc.BootstrapStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as unary:
            await stub.Register(pb.RegisterRequest(worker=worker("intruder")))
        assert unary.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.aio.AioRpcError) as stream:
            await stub.Watch(pb.WatchRequest()).read()
        assert stream.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await channel.close()
    assert server.registry.list() == []


async def test_baton_bootstrap_command_serves_and_stops_on_sigterm() -> None:
    env = {**os.environ, "BATON_CLUSTER_TOKEN": TOKEN}
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "baton.services.cli",
        "bootstrap",
        "--port",
        "0",
        "--lease-ttl",
        "1",
        env=env,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert process.stderr is not None
        port = None
        while port is None:
            line = (await asyncio.wait_for(process.stderr.readline(), timeout=20)).decode()
            assert line, "bootstrap exited before listening"
            if match := re.search(r"listening on 127\.0\.0\.1:(\d+)", line):
                port = int(match.group(1))
        channel = make_channel(f"127.0.0.1:{port}", TOKEN)
        try:
            stub = pb_grpc.BootstrapStub(channel)
            await stub.Register(pb.RegisterRequest(worker=worker("d0")), timeout=5)
            listed = await stub.List(pb.ListRequest(), timeout=5)
            assert [w.worker_id for w in listed.workers] == ["d0"]
        finally:
            await channel.close()
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), timeout=10) == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_server_without_a_token_accepts_any_caller() -> None:
    server, port = await serve("127.0.0.1", 0, lease_ttl=TTL, cluster_token=None)
    try:
        for token in (None, "whatever"):
            channel = make_channel(f"127.0.0.1:{port}", token)
            try:
                stub = pb_grpc.BootstrapStub(channel)
                assert (await stub.List(pb.ListRequest(), timeout=5)).workers == []
            finally:
                await channel.close()
    finally:
        await server.stop(grace=None)
