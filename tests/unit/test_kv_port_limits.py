"""The KV data port closes connections that never say hello: a silent client cannot hold a
socket of the decode worker."""

from __future__ import annotations

import socket
import time

import pytest

from baton.common.transfer import tcp
from baton.common.transfer.base import KVArgs
from baton.common.transfer.manager import TransferManager
from baton.common.transfer.testing import kv_buffer

pytestmark = pytest.mark.timeout(30)


def test_a_silent_connection_is_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    assert tcp.HELLO_TIMEOUT_S <= 10  # what production uses
    monkeypatch.setattr(tcp, "HELLO_TIMEOUT_S", 0.5)  # the same rule, faster
    buffer, page_bytes = kv_buffer(16, 4)
    decode = TransferManager(KVArgs(buffer, page_bytes, 16), "decode", "tcp")
    try:
        host, port = decode.transfer_address.rsplit(":", 1)  # type: ignore[union-attr]
        with socket.create_connection((host, int(port))) as sock:
            sock.settimeout(10)
            started = time.monotonic()
            assert sock.recv(1) == b""  # closed by the worker, having sent nothing
            assert time.monotonic() - started < 5
        assert decode.stats()["frames_dropped"] >= 1
    finally:
        decode.shutdown()


def test_shutting_down_after_the_receiver_thread_stopped_raises_nothing() -> None:
    # CI: a decode side's shutdown raised BrokenPipeError when the receiving thread, between
    # two selects, saw the stop flag and closed its end of the wake-up pipe first
    buffer, page_bytes = kv_buffer(16, 4)
    decode = TransferManager(KVArgs(buffer, page_bytes, 16), "decode", "tcp")
    listener = decode._backend._listener  # type: ignore[attr-defined]
    listener._stopping = True  # as close() does, then the thread's select times out
    listener._thread.join(timeout=5)
    assert not listener._thread.is_alive()
    decode.shutdown()
