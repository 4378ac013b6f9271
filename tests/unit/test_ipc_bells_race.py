"""Two transfer threads connecting to the same decode worker at once (a flip's or a
migration's rooms do) each map its doorbells; the mapping kept is one, and the other is
closed at once, not left to the garbage collector. On a GPU a mapping dropped unclosed
kept its CUDA registration past its unmapping, the next mapping at that address failed to
register, and the failure surfaced as a failed KV transfer (H200, a role flip under load)."""

from __future__ import annotations

import threading

import pytest

from baton.common.transfer.base import KVArgs
from baton.common.transfer.doorbell import BellMapping
from baton.common.transfer.ipc import IpcBackend, IpcConnection
from baton.common.transfer.messages import DataHello
from baton.common.transfer.testing import kv_buffer

pytestmark = pytest.mark.timeout(30)


def test_the_mapping_a_racing_thread_loses_is_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    buffer, page_bytes = kv_buffer(8, 4)
    decode = IpcBackend()
    address = decode.start(KVArgs(buffer, page_bytes, 8), sink=object())  # type: ignore[arg-type]
    assert address is not None and hasattr(decode, "doorbells")

    made: list[BellMapping] = []
    closed: list[BellMapping] = []
    both_mapping = threading.Barrier(2, timeout=10)
    real_init, real_close = BellMapping.__init__, BellMapping.close

    def init(self: BellMapping, *args: object) -> None:
        real_init(self, *args)  # type: ignore[arg-type]
        made.append(self)
        both_mapping.wait()  # neither thread has stored its mapping yet

    def close(self: BellMapping) -> None:
        closed.append(self)
        real_close(self)

    monkeypatch.setattr(BellMapping, "__init__", init)
    monkeypatch.setattr(BellMapping, "close", close)
    prefill = IpcBackend()
    prefill.start(KVArgs(*kv_buffer(8, 4), 8), sink=None)
    connections: list[IpcConnection] = []

    def connect() -> None:
        conn = prefill.connect(address, DataHello("token", "p"))
        assert isinstance(conn, IpcConnection)
        connections.append(conn)

    threads = [threading.Thread(target=connect) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert len(made) == 2 and len(connections) == 2
    assert len(closed) == 1  # the loser's, at once
    kept = [m for m in made if m not in closed]
    assert len(kept) == 1
    prefill.shutdown()
    assert closed[-1] is kept[0]  # and the kept one when the backend shuts down
    decode.shutdown()
