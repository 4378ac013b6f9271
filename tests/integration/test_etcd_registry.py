"""The etcd registry against a real etcd (tests/integration/etcd_server.py): leases, watches that
resume from a revision, compaction, malformed keys, layout refusal, an etcd that appears
late, TLS with user/password auth."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import subprocess
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from etcd3aio import Etcd3Client, PermissionType

from baton.common.rpc import baton_pb2 as pb
from baton.services.registry.base import (
    Change,
    Progress,
    RegistrationRefused,
    Registry,
    Snapshot,
)
from baton.services.registry.config import RegistryConfig, open_registry
from baton.services.registry.membership import WorkerRegistration
from baton.services.registry.watcher import MembershipWatcher
from tests.integration.etcd_server import EtcdServer

pytestmark = pytest.mark.timeout(60)

TTL = 2.0  # etcd's smallest lease is about 1.5 s
ADDED, UPDATED, REMOVED = (
    pb.MembershipEvent.ADDED,
    pb.MembershipEvent.UPDATED,
    pb.MembershipEvent.REMOVED,
)


def worker(worker_id: str, role: pb.Role = pb.DECODE, page_size: int = 16) -> pb.WorkerInfo:
    return pb.WorkerInfo(
        worker_id=worker_id,
        role=role,
        grpc_address="127.0.0.1:50051",
        kv_control_address="127.0.0.1:50052",
        transfer_backend="fake",
        layout=pb.KVLayout(model="tiny", page_size=page_size, dtype="float32", num_layers=2),
    )


async def eventually(predicate: Callable[[], bool], timeout: float, what: str) -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"not within {timeout}s: {what}")
        await asyncio.sleep(0.02)
    return time.monotonic() - start


@pytest.fixture
async def client(etcd: EtcdServer) -> AsyncIterator[Callable[..., Registry]]:
    """Registry clients under one fresh prefix of the shared etcd, closed after the test."""
    url = etcd.url()
    made: list[Registry] = []

    def make(**settings: object) -> Registry:
        made.append(open_registry(RegistryConfig(url, **settings), None, lease_ttl=TTL))  # type: ignore[arg-type]
        return made[-1]

    try:
        yield make
    finally:
        for registry in made:
            await registry.close()


@pytest.fixture
async def raw(etcd: EtcdServer) -> AsyncIterator[Etcd3Client]:
    """A plain etcd client, to write what no worker would."""
    async with Etcd3Client([etcd.endpoint]) as c:
        yield c


async def test_register_update_and_deregister_reach_a_watcher(
    client: Callable[..., Registry],
) -> None:
    changes: list[tuple[int, str, int]] = []
    loads = iter(range(1_000_000))
    registration = WorkerRegistration(
        client(), worker("d0"), 0.2, lambda: pb.Load(running=next(loads) % 3)
    )
    watcher = MembershipWatcher(
        client(), lambda e: changes.append((e.type, e.worker.worker_id, e.worker.load.running))
    )
    try:
        await watcher.start()
        await watcher.wait_synced(timeout=10)
        assert watcher.members() == []
        await registration.start()
        await registration.wait_registered(timeout=10)
        await eventually(lambda: any(c[0] == UPDATED for c in changes), 5, "a load update")
        assert changes[0][:2] == (ADDED, "d0")
        assert watcher.get("d0") is not None and watcher.get("d0").layout.page_size == 16  # type: ignore[union-attr]
        # Renewals outlive the ttl.
        await asyncio.sleep(TTL * 1.5)
        assert [w.worker_id for w in watcher.members(pb.DECODE)] == ["d0"]
        # A clean stop revokes the lease: the key goes at once, not at the lapse.
        stopped = time.monotonic()
        await registration.stop()
        await eventually(lambda: not watcher.members(), 1.0, "the removal")
        assert changes[-1][:2] == (REMOVED, "d0")
        assert time.monotonic() - stopped < TTL / 2
    finally:
        await registration.stop()
        await watcher.stop()


async def test_a_lease_that_is_not_renewed_lapses(client: Callable[..., Registry]) -> None:
    registry = client()
    await registry.register(worker("d0"))  # and never renewed: the process "died"
    watcher = MembershipWatcher(client())
    async with watcher:
        await watcher.wait_synced(timeout=10)
        assert [w.worker_id for w in watcher.members()] == ["d0"]
        took = await eventually(lambda: not watcher.members(), TTL + 3, "the lapse")
        assert took <= TTL + 1.5
    assert (await registry.snapshot()).members == ()


async def test_a_decode_worker_with_another_kv_layout_is_refused(
    client: Callable[..., Registry],
) -> None:
    registry = client()
    await registry.register(worker("p0", pb.PREFILL, page_size=16))
    with pytest.raises(RegistrationRefused, match=r"page_size 1 != 16"):
        await registry.register(worker("d0", pb.DECODE, page_size=1))
    await registry.register(worker("b0", pb.BOTH, page_size=1))  # exchanges no KV
    assert [w.worker_id for w in (await registry.snapshot()).members] == ["b0", "p0"]
    # The refusal is what a starting worker reports, and retries, without writing anything.
    async with WorkerRegistration(client(), worker("d1", pb.DECODE, page_size=1), 0.2) as d1:
        with pytest.raises(RegistrationRefused, match="page_size"):
            await d1.wait_registered(timeout=10)
    assert [w.worker_id for w in (await registry.snapshot()).members] == ["b0", "p0"]


async def test_malformed_keys_are_logged_and_skipped(
    client: Callable[..., Registry],
    raw: Etcd3Client,
    etcd: EtcdServer,
    caplog: pytest.LogCaptureFixture,
) -> None:
    registry = client()
    prefix = registry.address.split(etcd.endpoint, 1)[1] + "/workers/"
    await registry.register(worker("good"))
    watcher = MembershipWatcher(client())
    assert raw.kv is not None
    with caplog.at_level(logging.WARNING, logger="baton.services.registry.etcd"):
        await raw.kv.put(prefix + "junk", b"\x00not json")
        # A valid record under someone else's key is not trusted either.
        await raw.kv.put(prefix + "impostor", (await _stored(raw, prefix + "good")))
        async with watcher:
            await watcher.wait_synced(timeout=10)
            await raw.kv.put(prefix + "late-junk", b'{"worker_id": "late-junk", "role": 7}')
            await registry.register(worker("after"))
            await eventually(lambda: watcher.get("after") is not None, 5, "a later join")
            assert [w.worker_id for w in watcher.members()] == ["after", "good"]
    assert [w.worker_id for w in (await registry.snapshot()).members] == ["after", "good"]
    logged = " ".join(r.getMessage() for r in caplog.records)
    for key in ("junk", "impostor", "late-junk"):
        assert f"workers/{key}'" in logged
    assert "it holds worker 'good'" in logged


async def _stored(raw: Etcd3Client, key: str) -> bytes:
    assert raw.kv is not None
    return bytes((await raw.kv.get(key)).kvs[0].value)


async def test_a_watch_resumes_after_its_revision_without_missing_a_change(
    client: Callable[..., Registry],
) -> None:
    registry = client()
    before = await registry.snapshot()
    lease = await registry.register(worker("d0"))
    await registry.update(lease, worker("d0"))  # same record again: still a change
    await registry.deregister(lease)
    await registry.register(worker("d1"))
    seen: list[tuple[int, str]] = []
    stream = registry.watch(before.revision)
    async for item in stream:
        assert not isinstance(item, Snapshot), "the history is there: no resync needed"
        if isinstance(item, Change):
            seen.append((item.type, item.worker.worker_id))
        if len(seen) == 4:
            break
    await stream.aclose()  # type: ignore[attr-defined]
    assert seen == [(ADDED, "d0"), (UPDATED, "d0"), (REMOVED, "d0"), (ADDED, "d1")]


async def test_a_compacted_history_resyncs_from_a_snapshot(
    client: Callable[..., Registry], raw: Etcd3Client
) -> None:
    registry = client()
    lease = await registry.register(worker("gone"))
    before = await registry.snapshot()
    await registry.deregister(lease)
    await registry.register(worker("new"))
    assert raw.kv is not None
    await raw.kv.compact((await registry.snapshot()).revision, physical=True)
    stream = registry.watch(before.revision)
    first = await anext(stream)  # type: ignore[call-overload]
    await stream.aclose()  # type: ignore[attr-defined]
    assert isinstance(first, Snapshot)
    assert [w.worker_id for w in first.members] == ["new"]


async def test_the_last_view_serves_while_etcd_is_down_and_the_watch_resumes(
    client: Callable[..., Registry], etcd: EtcdServer
) -> None:
    changes: list[tuple[int, str]] = []
    registration = WorkerRegistration(client(), worker("d0"), 0.2)
    watcher = MembershipWatcher(client(), lambda e: changes.append((e.type, e.worker.worker_id)))
    other = client()
    try:
        await registration.start()
        await registration.wait_registered(timeout=10)
        await watcher.start()
        await watcher.wait_synced(timeout=10)
        etcd.stop()
        await eventually(lambda: not watcher.connected, 10, "the watcher notices the outage")
        assert [w.worker_id for w in watcher.members()] == ["d0"]  # the last view serves
        await eventually(lambda: not registration.registered, 10, "the worker notices")
        await asyncio.to_thread(etcd.start)
        await eventually(lambda: watcher.connected, 15, "the watch resumes")
        await eventually(lambda: registration.registered, 15, "renewals resume")
        # etcd keeps leases across a restart: the same registration, no re-register.
        assert changes == [(ADDED, "d0")]
        await other.register(worker("d1"))
        await eventually(lambda: watcher.get("d1") is not None, 5, "a change after the restart")
    finally:
        if etcd.proc is None:
            etcd.start()
        await registration.stop()
        await watcher.stop()


async def test_a_worker_that_starts_before_etcd_joins_when_it_appears(
    tmp_path: Path, etcd_server: EtcdServer, caplog: pytest.LogCaptureFixture
) -> None:
    late = EtcdServer(tmp_path / "late", etcd_server.binary)
    registry = open_registry(RegistryConfig(late.url()), None, lease_ttl=TTL)
    registration = WorkerRegistration(registry, worker("d0"), 0.2)
    try:
        with caplog.at_level(logging.WARNING, logger="baton.services.registry.membership"):
            await registration.start()
            await asyncio.sleep(1.0)
            assert not registration.registered
        assert "registry unreachable" in caplog.text  # it says so, once, and retries
        await asyncio.to_thread(late.start)
        await registration.wait_registered(timeout=15)
        assert [w.worker_id for w in (await registry.snapshot()).members] == ["d0"]
    finally:
        await registration.stop()
        await registry.close()
        late.stop()


async def test_tls_and_password_auth(
    tmp_path: Path, etcd_server: EtcdServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: no certificates to test TLS with")
    ca, cert, key = _certificates(tmp_path)
    secure = EtcdServer(
        tmp_path / "tls", etcd_server.binary, **{"cert-file": str(cert), "key-file": str(key)}
    )
    secure.start()
    try:
        tls = {"ca_file": str(ca), "tls_server_name": "localhost"}
        async with Etcd3Client([secure.endpoint], ca_cert=ca.read_bytes(), **_sni()) as admin:
            assert admin.auth is not None
            await admin.auth.user_add("root", "root-pw")
            await admin.auth.user_grant_role("root", "root")
            await admin.auth.user_add("baton", "s3cret")
            await admin.auth.role_add("baton")
            await admin.auth.role_grant_permission(
                "baton", "/", "\x00", perm_type=PermissionType.READWRITE
            )
            await admin.auth.user_grant_role("baton", "baton")
            await admin.auth.auth_enable()
        url = secure.url()
        wrong = open_registry(RegistryConfig(url, username="baton", password="nope", **tls), None)
        with pytest.raises(ConnectionError, match="authenticating as 'baton'"):
            await wrong.snapshot()
        monkeypatch.setenv("BATON_REGISTRY_PASSWORD", "s3cret")
        password = os.environ["BATON_REGISTRY_PASSWORD"]
        config = RegistryConfig(url, username="baton", password=password, **tls)
        registry = open_registry(config, None, lease_ttl=TTL)
        try:
            lease = await registry.register(worker("d0"))
            assert await registry.keepalive(lease)
            assert [w.worker_id for w in (await registry.snapshot()).members] == ["d0"]
            assert "s3cret" not in registry.address and "s3cret" not in repr(config)
        finally:
            await registry.close()
            await wrong.close()
    finally:
        secure.stop()


def _sni() -> dict[str, str]:
    return {"tls_server_name": "localhost"}


def _certificates(folder: Path) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for localhost / 127.0.0.1 (openssl)."""
    ca_key, ca, key, csr, cert = (
        folder / n for n in ("ca.key", "ca.pem", "s.key", "s.csr", "s.pem")
    )
    ext = folder / "ext.cnf"
    ext.write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=test-ca",
            "-keyout", str(ca_key), "-out", str(ca))  # fmt: skip
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=localhost",
            "-keyout", str(key), "-out", str(csr))  # fmt: skip
    openssl("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key),
            "-CAcreateserial", "-days", "1", "-extfile", str(ext), "-out", str(cert))  # fmt: skip
    return ca, cert, key


# Progress is part of the interface: a resumed watch says it is live before any change.
async def test_a_resumed_watch_says_it_is_live(client: Callable[..., Registry]) -> None:
    registry = client()
    await registry.register(worker("d0"))
    now = (await registry.snapshot()).revision
    stream = registry.watch(now)
    first = await anext(stream)  # type: ignore[call-overload]
    await stream.aclose()  # type: ignore[attr-defined]
    assert first == Progress(now)
